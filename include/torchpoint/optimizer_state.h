// Optimizer state for LibTorch 1.13's six optimizers (SGD, Adam, AdamW, RMSprop, Adagrad,
// LBFGS): every per-parameter state tensor and counter, keyed by (group, position) rather than
// by tensor address, and every param-group option.
#pragma once

#include <torch/optim/optimizer.h>

#include <memory>
#include <string>

#include "torchpoint/error.h"
#include "torchpoint/state_dict.h"

namespace torchpoint {

// The state of `optimizer`:
//   type                              "Adam", "SGD", ...
//   param_groups.count                number of groups
//   param_groups.<g>.num_params       parameters in group g
//   param_groups.<g>.<option>         lr, betas, eps, weight_decay, momentum, ...
//   state.<g>.<i>.<field>             per-parameter state of the i-th parameter of group g
// Tensors are detached views: save them before the next step. Throws Unsupported for an
// optimizer type torchpoint does not know (wrap it in your own Stateful instead).
StateDict optimizer_state_dict(const torch::optim::Optimizer& optimizer);

// Restores `state` into `optimizer`, whose param groups must hold the same number of
// parameters with the same shapes as when it was saved. Everything is checked before anything
// changes: another optimizer type, another group layout or a state tensor whose shape differs
// from its parameter's is an Incompatible error, and the optimizer is left untouched.
// The optimizer's state tensors are replaced, never written into: tensors taken from it
// before the call keep the old state. State tensors are copied, except those a torchpoint load
// read into memory of their own (load_file, load_state) and already of their parameter's dtype
// and device: the optimizer takes those, as Python's load_state_dict does, and shares their
// memory with `state`.
//
// Example:
//   torch::optim::Adam adam(model->parameters());
//   torchpoint::load_optimizer_state_dict(adam, checkpoint.child("optimizer"));
void load_optimizer_state_dict(torch::optim::Optimizer& optimizer, const StateDict& state);

namespace detail {
// While one lives, load_optimizer_state_dict() on its thread also takes every state tensor that
// is the whole of its memory and of its parameter's dtype and device, as it takes a load's:
// for a caller whose `state` holds tensors it made for the call alone (ZeRO's assembled pieces).
class TakeLoadedState {
 public:
  TakeLoadedState();
  ~TakeLoadedState();
  TakeLoadedState(const TakeLoadedState&) = delete;
  TakeLoadedState& operator=(const TakeLoadedState&) = delete;

 private:
  bool previous_;
};
}  // namespace detail

// The optimizer's type name as used in its state ("Adam"), or "" when unknown.
std::string optimizer_type_name(const torch::optim::Optimizer& optimizer);

// An optimizer as a Stateful object. Holds a shared pointer, or refers to an optimizer the
// caller keeps alive (see AnyStateful::ref).
class OptimizerState {
 public:
  // load_optimizer_state_dict() replaces the state: no copy is needed to put it back.
  static constexpr bool kLoadReplacesState = true;

  explicit OptimizerState(std::shared_ptr<torch::optim::Optimizer> optimizer)
      : optimizer_(std::move(optimizer)) {}
  StateDict state_dict() const { return optimizer_state_dict(*optimizer_); }
  void load_state_dict(const StateDict& state) { load_optimizer_state_dict(*optimizer_, state); }

 private:
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
};

}  // namespace torchpoint
