// Module state: parameters and buffers by name, loaded only after every key, shape and dtype
// has been checked.
#pragma once

#include <torch/nn/module.h>

#include <string>
#include <vector>

#include "torchpoint/error.h"
#include "torchpoint/state_dict.h"

namespace torchpoint {

// What a load did: the keys restored and, for a non-strict load, those left alone.
struct LoadReport {
  std::vector<std::string> loaded;
  std::vector<std::string> missing;     // in the module, not in the state
  std::vector<std::string> unexpected;  // in the state, not in the module
  std::vector<std::string>
      mismatched;  // "size mismatch for fc.weight: checkpoint [1, 10], model [2, 10]"
  bool complete() const { return missing.empty() && unexpected.empty() && mismatched.empty(); }
  // One line per problem, or "all N keys loaded".
  std::string summary() const;
};

// Every parameter and buffer of `module` and its submodules, by dotted name ("0.weight",
// "encoder.norm.running_mean"), parameters first. The tensors are detached views, not copies:
// save them before changing the module.
StateDict module_state_dict(const torch::nn::Module& module);

// Copies `state` into the parameters and buffers of `module` (in place, so optimizers keep
// pointing at them). Every key, shape and dtype is checked first: when `strict` and anything
// is missing, unexpected or mismatched, throws Incompatible listing all of it and changes
// nothing. When not strict, loads the keys that match and reports the rest.
//
// Example:
//   torchpoint::LoadReport r = torchpoint::load_module_state_dict(*model, sd);
LoadReport load_module_state_dict(torch::nn::Module& module, const StateDict& state,
                                  bool strict = true);

// A module as a Stateful object (for register_for_checkpointing and friends).
class ModuleState {
 public:
  explicit ModuleState(std::shared_ptr<torch::nn::Module> module, bool strict = true)
      : module_(std::move(module)), strict_(strict) {}
  StateDict state_dict() const { return module_state_dict(*module_); }
  void load_state_dict(const StateDict& state) { load_module_state_dict(*module_, state, strict_); }

 private:
  std::shared_ptr<torch::nn::Module> module_;
  bool strict_;
};

}  // namespace torchpoint
