#include "format/dtype.h"

#include <fmt/format.h>

#include <vector>

#include "compat/torch_compat.h"
#include "torchpoint/error.h"

namespace torchpoint {
namespace {

// Every safetensors dtype the running LibTorch can hold.
const std::vector<DtypeInfo>& dtypes() {
  static const std::vector<DtypeInfo> table = [] {
    std::vector<DtypeInfo> t = {
        {c10::ScalarType::Bool, "BOOL", 1}, {c10::ScalarType::Byte, "U8", 1},
        {c10::ScalarType::Char, "I8", 1},   {c10::ScalarType::Short, "I16", 2},
        {c10::ScalarType::Int, "I32", 4},   {c10::ScalarType::Long, "I64", 8},
        {c10::ScalarType::Half, "F16", 2},  {c10::ScalarType::BFloat16, "BF16", 2},
        {c10::ScalarType::Float, "F32", 4}, {c10::ScalarType::Double, "F64", 8},
    };
    for (const compat::NewerDtype& n : compat::kNewerDtypes) {
      if (auto type = compat::scalar_type_for(n.safetensors)) {
        t.push_back({*type, n.safetensors, n.size});
      }
    }
    return t;
  }();
  return table;
}

std::string supported_list() {
  std::vector<std::string> names;
  for (const DtypeInfo& info : dtypes()) names.push_back(c10::toString(info.type));
  return fmt::format("{}", fmt::join(names, ", "));
}

}  // namespace

const DtypeInfo& dtype_info(c10::ScalarType type, std::string_view tensor_name) {
  for (const DtypeInfo& info : dtypes()) {
    if (info.type == type) return info;
  }
  throw Error(ErrorCode::Unsupported,
              fmt::format("tensor '{}' has dtype {}, which the safetensors format cannot hold; "
                          "supported: {} (convert it, e.g. with .to(torch::kFloat))",
                          tensor_name, c10::toString(type), supported_list()));
}

std::optional<DtypeInfo> dtype_from_name(std::string_view name, bool* known_unsupported) {
  *known_unsupported = false;
  for (const DtypeInfo& info : dtypes()) {
    if (info.name == name) return info;
  }
  for (const compat::NewerDtype& n : compat::kNewerDtypes) {
    if (n.safetensors == name) *known_unsupported = true;
  }
  return std::nullopt;
}

}  // namespace torchpoint
