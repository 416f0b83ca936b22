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
#include <functional>
#include <utility>
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
// Throws Incompatible: "<where>: <what>".
[[noreturn]] void incompatible(const std::string& where, const std::string& what);
// The optimizer type a Python param group's options belong to (torch 2.x's names).
std::string python_optimizer_type(const PyValue& group);
// A scheduler's state (torchpoint's or torch::optim::StepLR's), which Accelerate's guide
// registers with register_for_checkpointing and so is saved as a custom object.
bool is_scheduler_state(const StateDict& s);

// A Python value as JSON: numbers, strings, None, bools, lists and tuples (as arrays), dicts
// with str keys (as objects). Throws Unsupported naming (`where`) the first value that is not.
Json to_json(const PyValue& v, const std::string& where);
// A value of a StateDict as a Python value (a JSON object as a dict).
PyValue entry_value(const StateDict::Value& v);

// --- LR schedulers (accelerate_schedulers.cc has the mapping, field by field) ---------------

// The optimizer a scheduler drives, read only when needed: torch 2.x's OneCycleLR keeps its
// learning rates and momenta in the optimizer's param groups.
struct PairedOptimizer {
  std::string path;               // its file; empty when the scheduler has none
  std::function<PyValue()> read;  // its torch.save value
};
// The optimizer component that the scheduler component `scheduler` drives, among `optimizers`:
// "optimizer_1" for "scheduler_1"; for a registered scheduler (custom_checkpoint_<i>), the only
// optimizer; "" when there is none.
std::string paired_optimizer_name(std::string_view scheduler,
                                  const std::vector<std::string>& optimizers);
// Python's state_dict() of a scheduler (`saved`, read from `where`) as the state of the
// scheduler prepared here, whose state now is `current` (torchpoint's or torch::optim::StepLR's).
// Throws Incompatible naming the Python class when it is another, and naming the missing key,
// what it means and its file when one is missing.
StateDict scheduler_from_python(const PyValue& saved, const StateDict& current,
                                const std::string& where, const PairedOptimizer& optimizer);
// What Python's scheduler needs: its state_dict(), and the keys it keeps in each param group of
// its optimizer (initial_lr; OneCycleLR's max_lr, min_lr, max_momentum, base_momentum).
struct PythonScheduler {
  PyValue state;
  std::vector<std::vector<std::pair<std::string, PyValue>>> group_keys;
  std::vector<std::string> notes;  // what the export had to fill in
};
// The scheduler state `sd` (torchpoint's or torch::optim::StepLR's) as Python's; `optimizer` is
// the state of the optimizer it drives (null when none). Throws Unsupported naming what is
// missing when Python's scheduler cannot be given what it needs.
PythonScheduler scheduler_to_python(const StateDict& sd, const std::string& where,
                                    const StateDict* optimizer);

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
