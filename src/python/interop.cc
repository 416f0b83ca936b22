#include "torchpoint/interop.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <algorithm>
#include <bit>
#include <cstring>

#include "format/container.h"
#include "python/torch_pickle.h"
#include "python/torch_value.h"
#include "python/torch_zip.h"
#include "torchpoint/error.h"

namespace torchpoint {
namespace {

// torch.save's format before PyTorch 1.6 (_use_new_zipfile_serialization=False) starts with
// a pickled magic number instead of a zip record.
constexpr std::string_view kLegacyMagic = "\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8";

// The bytes of storage `key`: record "<archive>/data/<key>", which must hold exactly `numel`
// elements of `dtype`, copied into a fresh tensor so nothing points into the file's buffer.
at::Tensor load_storage(const detail::TorchZip& zip, const std::string& path,
                        const std::string& key, c10::ScalarType dtype, std::int64_t numel) {
  std::string name = fmt::format("{}/data/{}", zip.prefix(), key);
  if (!zip.contains(name)) {
    throw Error(
        ErrorCode::Corruption,
        fmt::format("{}: the bytes of storage '{}' (record '{}') are missing", path, key, name));
  }
  std::uint64_t bytes = 0;
  const bool overflow =
      __builtin_mul_overflow(static_cast<std::uint64_t>(numel), c10::elementSize(dtype), &bytes);
  if (overflow || zip.size(name) != bytes) {
    throw Error(ErrorCode::Corruption,
                fmt::format("{}: record '{}' holds {} bytes, but its storage of {} {} elements "
                            "needs {}",
                            path, name, zip.size(name), numel, c10::toString(dtype),
                            overflow ? std::string("more than 2^64") : std::to_string(bytes)));
  }
  at::Tensor out = at::empty({numel}, at::TensorOptions().dtype(dtype));
  if (bytes > 0) zip.read_into(name, out.data_ptr());  // straight into the tensor: one copy
  if (dtype == c10::ScalarType::Bool) {
    // Any byte but 0 and 1 would be an invalid bool in C++.
    const auto* raw = static_cast<const std::uint8_t*>(out.data_ptr());
    for (std::uint64_t i = 0; i < bytes; ++i) {
      if (raw[i] > 1) {
        throw Error(
            ErrorCode::Corruption,
            fmt::format("{}: bool storage '{}' holds a byte that is neither 0 nor 1", path, key));
      }
    }
  }
  return out;
}

// Opens a torch.save file and checks what comes before its pickle; `read` gets the zip.
template <typename Read>
auto with_torch_zip(const std::string& path, Env& env, Read read) {
  std::unique_ptr<File> file = env.open(path, OpenMode::Read);
  std::string magic(std::min<std::uint64_t>(file->size(), kLegacyMagic.size()), '\0');
  file->read_exact(magic.data(), magic.size(), 0);
  if (magic == kLegacyMagic) {
    throw Error(ErrorCode::Unsupported,
                fmt::format("{} was written by torch.save in the format before PyTorch 1.6 "
                            "(_use_new_zipfile_serialization=False); save it again with a "
                            "newer PyTorch's default",
                            path));
  }
  detail::TorchZip zip(*file, path);
  // Storage bytes are little-endian; recent PyTorch records the writer's byte order.
  std::string order_record = zip.prefix() + "/byteorder";
  if (zip.contains(order_record) && zip.read(order_record) != "little") {
    throw Error(ErrorCode::Unsupported,
                fmt::format("{} was written on a big-endian machine", path));
  }
  if constexpr (std::endian::native != std::endian::little) {
    throw Error(
        ErrorCode::Unsupported,
        "load_torch_state_dict reads little-endian storages on little-endian machines only");
  }
  detail::StorageLoader load = [&](const std::string& key, c10::ScalarType dtype,
                                   std::int64_t numel) {
    return load_storage(zip, path, key, dtype, numel);
  };
  return read(zip.read(zip.prefix() + "/data.pkl"), load);
}

// Runs `body`, turning allocation failures and LibTorch's errors into Errors.
template <typename Body>
auto guarded(const std::string& path, Body body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    // A storage too large for this machine's memory (or a hostile size that passed every
    // check because the file really is that large, sparse).
    throw Error(ErrorCode::Unsupported,
                fmt::format("{}: its tensors do not fit in this process's memory", path));
  } catch (const c10::Error& e) {
    throw Error(ErrorCode::Unsupported, fmt::format("{}: LibTorch could not build its tensors: {}",
                                                    path, e.what_without_backtrace()));
  }
}

StateDict load_torch_state_dict_impl(const std::string& path, Env& env) {
  auto entries = with_torch_zip(path, env, [&](const std::string& pickle,
                                               const detail::StorageLoader& load) {
    return detail::unpickle_state_dict(pickle, load, path);
  });
  StateDict out;
  out.set_description(path);
  for (auto& [key, tensor] : entries) out.set(key, std::move(tensor));
  return out;
}

}  // namespace

StateDict load_torch_state_dict(const std::string& path, Env& env) {
  return guarded(path, [&] { return load_torch_state_dict_impl(path, env); });
}

detail::PyValue detail::load_torch_value(const std::string& path, Env& env) {
  return guarded(path, [&] {
    return with_torch_zip(path, env, [&](const std::string& pickle, const StorageLoader& load) {
      return unpickle_value(pickle, load, path);
    });
  });
}

ForeignContainer load_safetensors(const std::string& path, Env& env) {
  ForeignContainer out;
  bool verified = false;
  out.contents = load_container(env, path, nullptr, /*allow_foreign=*/true, &verified);
  out.verified = verified;
  return out;
}

}  // namespace torchpoint
