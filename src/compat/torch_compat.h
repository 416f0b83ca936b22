// What differs between the LibTorch versions torchpoint supports (1.13 and 2.x), in one place,
// so that the rest of the code reads as if there were one LibTorch (LevelDB's port/).
//
// Differences met so far, and where each is handled:
//   - Optimizer::state() is keyed by a hex string of the parameter's TensorImpl address before
//     LibTorch 2.2 and by the address itself (void*) from 2.2 on: optimizer_state_key().
//   - Optimizer::zero_grad() zeroes gradients in 1.13 and leaves them undefined from 2.0 on:
//     zero_grad() below keeps one behaviour (undefined, as 2.x and PyTorch do).
//   - dtypes that LibTorch 1.13 lacks (float8, uint16/32/64): ScalarTypeSupport below.
//   - CUDAHooksInterface::getDefaultCUDAGenerator is gone in 2.x: both have
//     at::globalContext().defaultGenerator(device), which rng_state.cc uses.
//   - c10::optional is std::optional's alias in 2.x; both spell c10::optional.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <torch/optim/optimizer.h>
#include <torch/version.h>

#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>

namespace torchpoint::compat {

// The running LibTorch's version, "major.minor.patch".
std::string torch_version();

// The key of Optimizer::state() for `param`.
using OptimizerStateKey =
    typename std::decay_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;

namespace detail {
template <typename Key>
Key optimizer_state_key(void* impl) {
  if constexpr (std::is_same_v<Key, void*>) {
    return impl;
  } else {
    // LibTorch 1.13 builds the key with c10::guts::to_string, which streams the pointer.
    std::ostringstream out;
    out << impl;
    return out.str();
  }
}
}  // namespace detail

inline OptimizerStateKey optimizer_state_key(const at::Tensor& param) {
  return detail::optimizer_state_key<OptimizerStateKey>(param.unsafeGetTensorImpl());
}

// Sets every gradient of the optimizer's parameters to undefined, as LibTorch 2.x's
// zero_grad() does by default (1.13's zeroes them instead, which makes a later step apply
// momentum and weight decay to parameters that got no gradient). The Learner uses it so a fit
// runs the same steps on both versions.
void zero_grad(torch::optim::Optimizer& optimizer);

// The dtypes that only some LibTorch versions have (none of them is in 1.13): their
// safetensors name, Python name (torch.save writes them with _rebuild_tensor_v3) and size.
struct NewerDtype {
  std::string_view safetensors;
  std::string_view python;
  std::size_t size;
};
inline constexpr NewerDtype kNewerDtypes[] = {{"U16", "uint16", 2},
                                              {"U32", "uint32", 4},
                                              {"U64", "uint64", 8},
                                              {"F8_E4M3", "float8_e4m3fn", 1},
                                              {"F8_E5M2", "float8_e5m2", 1}};

// A dtype by its safetensors name (F8_E4M3, U16, ...), or nullopt where this LibTorch has no
// such dtype (float8 and the wide unsigned integers are absent from 1.13).
std::optional<at::ScalarType> scalar_type_for(std::string_view safetensors_name);

}  // namespace torchpoint::compat
