#include "compat/torch_compat.h"

#include <fmt/format.h>

namespace torchpoint::compat {
namespace {

// Each: the enumerator of E, where E has it. A requires-expression on the dependent
// name keeps this free of version numbers: a LibTorch that gains the dtype gets it here.
template <typename E>
std::optional<at::ScalarType> float8_e4m3() {
  if constexpr (requires { E::Float8_e4m3fn; }) return E::Float8_e4m3fn;
  return std::nullopt;
}
template <typename E>
std::optional<at::ScalarType> float8_e5m2() {
  if constexpr (requires { E::Float8_e5m2; }) return E::Float8_e5m2;
  return std::nullopt;
}
template <typename E>
std::optional<at::ScalarType> uint16() {
  if constexpr (requires { E::UInt16; }) return E::UInt16;
  return std::nullopt;
}
template <typename E>
std::optional<at::ScalarType> uint32() {
  if constexpr (requires { E::UInt32; }) return E::UInt32;
  return std::nullopt;
}
template <typename E>
std::optional<at::ScalarType> uint64() {
  if constexpr (requires { E::UInt64; }) return E::UInt64;
  return std::nullopt;
}

}  // namespace

std::string torch_version() {
  return fmt::format("{}.{}.{}", TORCH_VERSION_MAJOR, TORCH_VERSION_MINOR, TORCH_VERSION_PATCH);
}

void zero_grad(torch::optim::Optimizer& optimizer) {
  for (auto& group : optimizer.param_groups()) {
    for (auto& param : group.params()) {
      if (!param.mutable_grad().defined()) continue;
      param.mutable_grad().detach_();  // as LibTorch does: leave no autograd history behind
      param.mutable_grad().reset();
    }
  }
}

std::optional<at::ScalarType> scalar_type_for(std::string_view name) {
  if (name == "F8_E4M3") return float8_e4m3<at::ScalarType>();
  if (name == "F8_E5M2") return float8_e5m2<at::ScalarType>();
  if (name == "U16") return uint16<at::ScalarType>();
  if (name == "U32") return uint32<at::ScalarType>();
  if (name == "U64") return uint64<at::ScalarType>();
  return std::nullopt;
}

}  // namespace torchpoint::compat
