// Fuzzes the reader of torch.save files: the input is a .pt file (a zip archive) or a bare
// data.pkl pickle. Each input goes through load_torch_state_dict and load_torch_value (zip
// directory, records, CRC-32, pickle, storages; the second with the plain values of Python
// Accelerate's files: NumPy arrays, bytes, Counter), and through both pickle interpreters
// alone with storages of zeros, which mutated pickles reach without having to keep a zip CRC
// right. Only torchpoint::Error
// may escape; anything else is a bug and crashes the fuzzer.
#include <ATen/ops/zeros.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "memory_env.h"
#include "python/torch_pickle.h"
#include "python/torch_value.h"
#include "torchpoint/error.h"
#include "torchpoint/interop.h"

namespace tp = torchpoint;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string_view input(reinterpret_cast<const char*>(data), size);
  tp::fuzz::MemoryEnv env;
  env.add_file("/fuzz/input.pt", input);
  try {
    tp::load_torch_state_dict("/fuzz/input.pt", env);
  } catch (const tp::Error&) {
  }
  try {
    tp::detail::load_torch_value("/fuzz/input.pt", env);
  } catch (const tp::Error&) {
  }

  // Like the real loader, storages are bounded by the bytes of the file they come from.
  auto zeros = [&](const std::string&, c10::ScalarType dtype, std::int64_t numel) {
    if (numel < 0 || static_cast<std::uint64_t>(numel) * c10::elementSize(dtype) > size) {
      throw tp::Error(tp::ErrorCode::Corruption, "storage larger than the input");
    }
    return at::zeros({numel}, at::TensorOptions().dtype(dtype));
  };
  try {
    tp::detail::unpickle_state_dict(input, zeros, "data.pkl");
  } catch (const tp::Error&) {
  }
  try {
    tp::detail::unpickle_value(input, zeros, "data.pkl");
  } catch (const tp::Error&) {
  }
  return 0;
}
