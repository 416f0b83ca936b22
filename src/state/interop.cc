#include "torchpoint/interop.h"

#include <fmt/format.h>
#include <torch/csrc/jit/serialization/pickle.h>

#include "format/container.h"
#include "torchpoint/error.h"

namespace torchpoint {
namespace {

std::uint32_t le16(const std::string& b, std::size_t at) {
  return static_cast<std::uint8_t>(b[at]) | static_cast<std::uint8_t>(b[at + 1]) << 8;
}

// LibTorch 1.13's unpickler turns every collections.OrderedDict into None (tensors carry an
// empty one for their hooks, which is harmless; a state dict that is one fails). torch.save
// writes data.pkl first and uncompressed, so the pickle's first opcodes are readable here.
bool top_level_is_ordered_dict(const std::string& b) {
  constexpr std::size_t kLocalHeader = 30;
  if (b.size() < kLocalHeader || b.compare(0, 4, "PK\x03\x04") != 0) return false;
  std::size_t name_len = le16(b, 26), extra_len = le16(b, 28);
  std::size_t data = kLocalHeader + name_len + extra_len;
  if (data + 2 > b.size()) return false;
  std::string_view name(b.data() + kLocalHeader, name_len);
  if (!name.ends_with("data.pkl")) return false;
  std::size_t at = data;
  if (static_cast<std::uint8_t>(b[at]) == 0x80) at += 2;  // PROTO n
  static constexpr std::string_view kGlobal = "ccollections\nOrderedDict\n";
  return b.compare(at, kGlobal.size(), kGlobal) == 0;
}

}  // namespace

StateDict load_torch_state_dict(const std::string& path, Env& env) {
  std::string bytes = env.read_file(path);
  if (top_level_is_ordered_dict(bytes)) {
    throw Error(ErrorCode::Unsupported,
                fmt::format("{} holds an OrderedDict (what model.state_dict() returns), which "
                            "LibTorch 1.13 cannot unpickle; in Python save "
                            "torch.save(dict(model.state_dict()), path) or a .safetensors file",
                            path));
  }
  c10::IValue value;
  try {
    value = torch::jit::pickle_load(std::vector<char>(bytes.begin(), bytes.end()));
  } catch (const std::exception& e) {
    throw Error(ErrorCode::Corruption,
                fmt::format("{} is not a file written by torch.save (zip format) or is damaged: "
                            "{}",
                            path, std::string(e.what()).substr(0, 300)));
  }
  if (!value.isGenericDict()) {
    throw Error(ErrorCode::Incompatible,
                fmt::format("{} holds a {}, not a state dict; save it with "
                            "torch.save(model.state_dict(), path)",
                            path, value.tagKind()));
  }
  StateDict out;
  out.set_description(path);
  for (const auto& entry : value.toGenericDict()) {
    if (!entry.key().isString()) {
      throw Error(ErrorCode::Incompatible,
                  fmt::format("{}: a key of the state dict is a {}, not a string", path,
                              entry.key().tagKind()));
    }
    const std::string& key = entry.key().toStringRef();
    if (!entry.value().isTensor()) {
      throw Error(ErrorCode::Incompatible,
                  fmt::format("{}: '{}' is a {}, not a tensor; only tensors can be loaded into "
                              "a module",
                              path, key, entry.value().tagKind()));
    }
    out.set(key, entry.value().toTensor());
  }
  return out;
}

ForeignContainer load_safetensors(const std::string& path, Env& env) {
  ForeignContainer out;
  bool verified = false;
  out.contents = load_container(env, path, nullptr, /*allow_foreign=*/true, &verified);
  out.verified = verified;
  return out;
}

}  // namespace torchpoint
