// The files of Python Accelerate's save_state, read into torchpoint's component states and
// written from them. The mapping of names and fields lives here and nowhere else:
//   model.safetensors (model_<i>.safetensors, or pytorch_model.bin)  <->  model (model_<i>)
//   optimizer.bin (optimizer_<i>.bin)    torch.save(optimizer.state_dict())  <->  optimizer
//   scheduler.bin (scheduler_<i>.bin)    torch.save(scheduler.state_dict())  <->  scheduler
//   custom_checkpoint_<i>.pkl            torch.save(obj.state_dict())        <->  custom_checkpoint_<i>
//   random_states_<rank>.pkl             step, Python's random and NumPy's states, and
//                                        torch.get_rng_state()                <->  random_states_<rank>
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <string_view>

#include "python/torch_value.h"
#include "torchpoint/env.h"
#include "torchpoint/state_dict.h"

namespace torchpoint::detail {

using Kind = PyValue::Kind;

constexpr const char* kRngPrefix = "random_states_";
constexpr const char* kCustomPrefix = "custom_checkpoint_";

// The kind of a component, or of an Accelerate file, by its name without the extension:
// "model" for "model" and "model_1", ..., "custom" for "custom_checkpoint_<i>", "random_states"
// for "random_states_<rank>", "data loader" for "dl_state_dict"; "" for any other name.
std::string component_kind(std::string_view stem);
// The optimizer type a Python param group's options belong to (torch 2.x's names).
std::string python_optimizer_type(const PyValue& group);
// A scheduler's state (torchpoint's or torch::optim::StepLR's), which Accelerate's guide
// registers with register_for_checkpointing and so is saved as a custom object.
bool is_scheduler_state(const StateDict& s);

// A component the loading program registered: its file stem ("optimizer_1"), its kind
// ("model", "optimizer", "scheduler", "scaler", "sampler", "custom") and its state now, which
// shows the names, types and layout the translated state must have (left empty for a model
// and a sampler, whose translation does not need it).
struct WantedComponent {
  std::string name;
  std::string kind;
  StateDict current;
};

// What read_accelerate_directory found.
struct AccelerateRead {
  StateDict all;  // each component's state under "<name>.", the RNG's under `rng_name`
  std::int64_t step = 0;
  std::vector<std::string> files;           // the files read, in the order read
  std::vector<std::string> not_applicable;  // Python-side state with no C++ counterpart
  std::vector<std::string> notes;
  std::vector<std::string> not_in_checkpoint;  // registered components left as they are
};

// Reads the Accelerate checkpoint `dir` into the states of `wanted` and of the RNG (its state
// now: `rng_current`, saved under `rng_name`) for process `rank`. Everything is read and
// translated before the caller changes anything. Throws NotFound naming a missing file,
// Corruption for a damaged one, Unsupported naming a Python type or global torchpoint does not
// read, Incompatible naming what differs (optimizer type, parameter count, a field missing).
AccelerateRead read_accelerate_directory(const std::string& dir,
                                         const std::vector<WantedComponent>& wanted,
                                         const std::string& rng_name, const StateDict& rng_current,
                                         int rank, Env& env);

}  // namespace torchpoint::detail
