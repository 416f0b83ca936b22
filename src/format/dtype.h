// The mapping between LibTorch dtypes and the dtype names of the safetensors format.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace torchpoint {

struct DtypeInfo {
  c10::ScalarType type;
  std::string_view name;  // safetensors spelling, e.g. "F32"
  std::size_t size;       // bytes per element
};

// The safetensors dtype of `type`; throws Unsupported naming `tensor_name` for a dtype the
// format cannot hold (complex, quantized, ...).
const DtypeInfo& dtype_info(c10::ScalarType type, std::string_view tensor_name);

// The dtype named `name`. nullopt when the name is not a safetensors dtype at all;
// `*known_unsupported` is set when safetensors names it but the running LibTorch cannot hold
// it (U16, U32, U64, F8_E4M3 and F8_E5M2 under LibTorch 1.13).
std::optional<DtypeInfo> dtype_from_name(std::string_view name, bool* known_unsupported);

}  // namespace torchpoint
