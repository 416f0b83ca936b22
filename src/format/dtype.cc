#include "format/dtype.h"

#include <fmt/format.h>

#include <array>

#include "torchpoint/error.h"

namespace torchpoint {
namespace {

constexpr std::array<DtypeInfo, 10> kDtypes = {{
    {c10::ScalarType::Bool, "BOOL", 1},
    {c10::ScalarType::Byte, "U8", 1},
    {c10::ScalarType::Char, "I8", 1},
    {c10::ScalarType::Short, "I16", 2},
    {c10::ScalarType::Int, "I32", 4},
    {c10::ScalarType::Long, "I64", 8},
    {c10::ScalarType::Half, "F16", 2},
    {c10::ScalarType::BFloat16, "BF16", 2},
    {c10::ScalarType::Float, "F32", 4},
    {c10::ScalarType::Double, "F64", 8},
}};

constexpr std::array<std::string_view, 5> kKnownUnsupported = {"U16", "U32", "U64", "F8_E4M3",
                                                               "F8_E5M2"};

}  // namespace

const DtypeInfo& dtype_info(c10::ScalarType type, std::string_view tensor_name) {
  for (const DtypeInfo& info : kDtypes) {
    if (info.type == type) return info;
  }
  throw Error(ErrorCode::Unsupported,
              fmt::format("tensor '{}' has dtype {}, which the safetensors format cannot hold; "
                          "supported: bool, uint8, int8, int16, int32, int64, float16, bfloat16, "
                          "float32, float64 (convert it, e.g. with .to(torch::kFloat))",
                          tensor_name, c10::toString(type)));
}

std::optional<DtypeInfo> dtype_from_name(std::string_view name, bool* known_unsupported) {
  *known_unsupported = false;
  for (const DtypeInfo& info : kDtypes) {
    if (info.name == name) return info;
  }
  for (std::string_view unsupported : kKnownUnsupported) {
    if (unsupported == name) *known_unsupported = true;
  }
  return std::nullopt;
}

}  // namespace torchpoint
