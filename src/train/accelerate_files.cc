// Python Accelerate's checkpoint files, read into torchpoint's component states and written
// from them. Python keys an optimizer's state by the parameter's index over all its param
// groups and names no optimizer type; torchpoint keys it by (group, position) and records the
// type. The type is recognised from the param groups' option names, and must be the one of the
// optimizer the C++ program prepared.
#include "train/accelerate_files.h"

#include <ATen/ops/scalar_tensor.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <set>

#include "format/container.h"
#include "io/atomic_commit.h"
#include "io/filename.h"
#include "state/torch_value.h"
#include "torchpoint/accelerate_interop.h"
#include "torchpoint/checkpoint_dir.h"
#include "torchpoint/error.h"
#include "torchpoint/interop.h"
#include "torchpoint/tensor_file.h"

namespace torchpoint {
namespace detail {
namespace {

using Kind = PyValue::Kind;

constexpr const char* kRngPrefix = "random_states_";
constexpr const char* kCustomPrefix = "custom_checkpoint_";

// The file of component `name` of `kind` in Accelerate's layout (the first existing one of
// its candidates), or the first candidate when none exists.
std::vector<std::string> accelerate_files_of(const std::string& name, const std::string& kind) {
  // "optimizer_1" -> "optimizer_1.bin"; "model_1" -> "model_1.safetensors", "pytorch_model_1.bin"
  if (kind == "model") {
    std::string suffix = name.substr(std::string("model").size());
    return {name + ".safetensors", "pytorch_model" + suffix + ".bin"};
  }
  if (kind == "optimizer" || kind == "scheduler") return {name + ".bin"};
  if (kind == "scaler") return {"scaler.pt"};
  if (kind == "custom") return {name + ".pkl"};
  return {};
}

// The kind of a component, or of an Accelerate file, by its name without the extension:
// "model" for "model" and "model_1", ..., "custom" for "custom_checkpoint_<i>", "random_states"
// for "random_states_<rank>", "data loader" for "dl_state_dict"; "" for any other name.
std::string component_kind(std::string_view stem) {
  if (stem == "scaler") return "scaler";
  if (stem.starts_with(kCustomPrefix)) return "custom";
  if (stem.starts_with(kRngPrefix)) return "random_states";
  static constexpr std::pair<std::string_view, std::string_view> kNumbered[] = {
      {"model", "model"},     {"optimizer", "optimizer"},       {"scheduler", "scheduler"},
      {"sampler", "sampler"}, {"dl_state_dict", "data loader"}};
  for (const auto& [prefix, kind] : kNumbered) {
    if (stem == prefix) return std::string(kind);
    if (stem.size() > prefix.size() + 1 && stem.starts_with(prefix) && stem[prefix.size()] == '_' &&
        stem.find_first_not_of("0123456789", prefix.size() + 1) == std::string_view::npos) {
      return std::string(kind);
    }
  }
  return "";
}

[[noreturn]] void incompatible(const std::string& where, const std::string& what) {
  throw Error(ErrorCode::Incompatible, fmt::format("{}: {}", where, what));
}

// Throws Incompatible unless `saved` is a dict: `what`'s state_dict().
void require_dict(const PyValue& saved, const std::string& where, const char* what) {
  if (!saved.is(Kind::kDict)) {
    incompatible(where, fmt::format("it holds a {}, not {} state_dict()", saved.type_name(), what));
  }
}

const PyValue& need(const PyValue& dict, std::string_view key, const std::string& where) {
  const PyValue* v = dict.find(key);
  if (v == nullptr) {
    incompatible(where, fmt::format("it has no '{}' (a {} with keys: {})", key, dict.type_name(),
                                    [&] {
                                      std::vector<std::string> keys;
                                      for (const auto& [k, _] : dict.entries) {
                                        if (k.is(Kind::kStr)) keys.push_back(k.text);
                                      }
                                      return fmt::format("{}", fmt::join(keys, ", "));
                                    }()));
  }
  return *v;
}

double as_number(const PyValue& v, const std::string& where, const std::string& key) {
  if (v.is(Kind::kFloat)) return v.number;
  if (v.is(Kind::kInt)) return static_cast<double>(v.integer);
  if (v.is(Kind::kBool)) return v.boolean ? 1 : 0;
  if (v.is(Kind::kTensor) && v.tensor.numel() == 1) return v.tensor.item<double>();
  incompatible(where, fmt::format("'{}' is a {}, not a number", key, v.type_name()));
}

// A Python value as JSON: numbers, strings, None, bools, lists and tuples (as arrays), dicts
// with str keys (as objects). Throws Unsupported naming the first value that is not.
Json to_json(const PyValue& v, const std::string& where) {
  switch (v.kind) {
    case Kind::kNone:
      return nullptr;
    case Kind::kBool:
      return v.boolean;
    case Kind::kInt:
      return v.integer;
    case Kind::kFloat:
      return v.number;
    case Kind::kStr:
      return v.text;
    case Kind::kTuple:
    case Kind::kList: {
      Json out = Json::array();
      for (std::size_t i = 0; i < v.items.size(); ++i) {
        out.push_back(to_json(v.items[i], fmt::format("{}[{}]", where, i)));
      }
      return out;
    }
    case Kind::kDict: {
      Json out = Json::object();
      for (const auto& [k, value] : v.entries) {
        if (!k.is(Kind::kStr)) {
          throw Error(ErrorCode::Unsupported,
                      fmt::format("{}: a dict key of type {} (only str keys are read)", where,
                                  k.type_name()));
        }
        out[k.text] = to_json(value, where + "." + k.text);
      }
      return out;
    }
    default:
      throw Error(ErrorCode::Unsupported,
                  fmt::format("{} is a Python {}, which has no place in a state dict of "
                              "torchpoint here (tensors, numbers, strings, None, lists and dicts "
                              "of those)",
                              where, v.type_name()));
  }
}

bool holds_tensor(const PyValue& v) {
  if (v.is(Kind::kTensor)) return true;
  for (const PyValue& item : v.items) {
    if (holds_tensor(item)) return true;
  }
  for (const auto& [k, value] : v.entries) {
    if (holds_tensor(value)) return true;
  }
  return false;
}

// A custom object's state dict: str keys; tensors as tensors; a nested dict that holds tensors
// flattened under "<key>."; everything else as JSON.
void custom_entries(const PyValue& dict, const std::string& prefix, const std::string& where,
                    StateDict& out) {
  for (const auto& [k, value] : dict.entries) {
    if (!k.is(Kind::kStr)) {
      throw Error(ErrorCode::Unsupported,
                  fmt::format("{}: a key of type {} (a state dict's keys are str)", where,
                              k.type_name()));
    }
    const std::string key = prefix + k.text;
    if (value.is(Kind::kTensor)) {
      out.set(key, value.tensor);
    } else if (value.is(Kind::kDict) && holds_tensor(value)) {
      custom_entries(value, key + ".", where, out);
    } else if (holds_tensor(value)) {
      throw Error(ErrorCode::Unsupported,
                  fmt::format("{}: '{}' is a {} holding tensors; torchpoint reads tensors as "
                              "values of a dict only",
                              where, key, value.type_name()));
    } else {
      out.set(key, to_json(value, fmt::format("{} '{}'", where, key)));
    }
  }
}

// --- optimizers -------------------------------------------------------------------------------

// The optimizer type a Python param group's options belong to (torch 2.x's names).
std::string python_optimizer_type(const PyValue& group) {
  auto has = [&](const char* key) { return group.find(key) != nullptr; };
  if (has("betas") && has("amsgrad")) {
    const PyValue* decoupled = group.find("decoupled_weight_decay");
    return decoupled != nullptr && decoupled->is(Kind::kBool) && decoupled->boolean ? "AdamW"
                                                                                    : "Adam";
  }
  if (has("nesterov") && has("dampening")) return "SGD";
  if (has("alpha") && has("centered")) return "RMSprop";
  if (has("lr_decay") && has("initial_accumulator_value")) return "Adagrad";
  if (has("history_size") && has("line_search_fn")) return "LBFGS";
  return "";
}

// Python-only options that change the arithmetic: a run with them cannot continue in C++.
void check_python_only_options(const PyValue& group, const std::string& where) {
  for (const char* key : {"maximize", "differentiable"}) {
    const PyValue* v = group.find(key);
    if (v != nullptr && v->is(Kind::kBool) && v->boolean) {
      throw Error(ErrorCode::Unsupported,
                  fmt::format("{}: the Python optimizer has {}=True, which LibTorch's optimizers "
                              "do not have; the run cannot continue the same in C++",
                              where, key));
    }
  }
  const PyValue* lr = group.find("lr");
  if (lr != nullptr && lr->is(Kind::kTensor)) {
    throw Error(ErrorCode::Unsupported,
                fmt::format("{}: the Python optimizer's lr is a tensor; LibTorch's is a number",
                            where));
  }
}

StateDict optimizer_from_python(const PyValue& saved, const StateDict& current,
                                const std::string& where) {
  require_dict(saved, where, "an optimizer's");
  const PyValue& groups = need(saved, "param_groups", where);
  const PyValue& state = need(saved, "state", where);
  if (!groups.is(Kind::kList) || groups.items.empty() || !state.is(Kind::kDict)) {
    incompatible(where, "'param_groups' is not a list of groups or 'state' not a dict");
  }
  const std::string type = python_optimizer_type(groups.items[0]);
  const std::string want = current.get<std::string>("type");
  if (type.empty()) {
    throw Error(ErrorCode::Unsupported,
                fmt::format("{}: its param groups' options are not those of SGD, Adam, AdamW, "
                            "RMSprop or Adagrad",
                            where));
  }
  if (type != want) {
    incompatible(where, fmt::format("it was saved by a Python torch.optim.{} but the prepared "
                                    "optimizer is a torch::optim::{}; prepare the same type",
                                    type, want));
  }
  if (type == "LBFGS") {
    throw Error(ErrorCode::Unsupported,
                fmt::format("{}: LBFGS state is not carried between Python and C++", where));
  }
  // The options torchpoint records for this type, from the optimizer's state now.
  std::vector<std::string> options;
  for (const std::string& key : current.keys()) {
    if (key.starts_with("param_groups.0.") && key != "param_groups.0.num_params") {
      options.push_back(key.substr(std::string("param_groups.0.").size()));
    }
  }
  const auto want_groups = current.get<std::int64_t>("param_groups.count");
  if (static_cast<std::int64_t>(groups.items.size()) != want_groups) {
    incompatible(where, fmt::format("it has {} param groups, the prepared optimizer {}",
                                    groups.items.size(), want_groups));
  }
  StateDict out;
  out.set_description(where);
  out.set("type", type);
  out.set("param_groups.count", static_cast<std::int64_t>(groups.items.size()));
  // Python parameter index -> "state.<g>.<i>."
  std::map<std::int64_t, std::string> position;
  for (std::size_t g = 0; g < groups.items.size(); ++g) {
    const PyValue& group = groups.items[g];
    const std::string gw = fmt::format("{} param group {}", where, g);
    if (!group.is(Kind::kDict)) incompatible(gw, "it is not a dict");
    check_python_only_options(group, gw);
    const PyValue& params = need(group, "params", gw);
    if (!params.is(Kind::kList)) incompatible(gw, "'params' is not a list");
    const std::string p = fmt::format("param_groups.{}.", g);
    const auto want_params = current.get<std::int64_t>(p + "num_params");
    if (static_cast<std::int64_t>(params.items.size()) != want_params) {
      incompatible(gw, fmt::format("it has {} parameters, the prepared optimizer's group {} has "
                                   "{}: the models differ",
                                   params.items.size(), g, want_params));
    }
    out.set(p + "num_params", static_cast<std::int64_t>(params.items.size()));
    for (std::size_t i = 0; i < params.items.size(); ++i) {
      if (!params.items[i].is(Kind::kInt)) incompatible(gw, "a parameter index is not an int");
      position[params.items[i].integer] = fmt::format("state.{}.{}.", g, i);
    }
    for (const std::string& option : options) {
      const PyValue& v = need(group, option, gw);
      const Json& now = current.value(p + option);
      if (v.is(Kind::kBool)) {
        out.set(p + option, v.boolean);
      } else if (now.is_array()) {
        out.set(p + option, to_json(v, gw + " " + option));
      } else if (now.is_number_integer() && v.is(Kind::kInt)) {
        out.set(p + option, v.integer);
      } else if (now.is_null() || now.is_string()) {
        out.set(p + option, to_json(v, gw + " " + option));
      } else {
        out.set(p + option, as_number(v, gw, option));
      }
    }
  }
  for (const auto& [index, fields] : state.entries) {
    if (!index.is(Kind::kInt) || !position.contains(index.integer)) {
      incompatible(where, fmt::format("it has state for parameter {}, which no param group "
                                      "lists",
                                      index.is(Kind::kInt) ? std::to_string(index.integer)
                                                           : index.type_name()));
    }
    if (!fields.is(Kind::kDict)) incompatible(where, "a parameter's state is not a dict");
    const std::string& p = position[index.integer];
    for (const auto& [name, value] : fields.entries) {
      if (!name.is(Kind::kStr)) incompatible(where, "a parameter's state has a non-str key");
      if (value.is(Kind::kNone)) continue;  // SGD's momentum_buffer before momentum is used
      if (name.text == "step") {
        const double step = as_number(value, where, "step");
        if (!(step >= 0) || step != std::floor(step) || step > 9.0e15) {
          incompatible(where, fmt::format("parameter {}'s step {} is not a count",
                                          index.integer, step));
        }
        out.set(p + "step", static_cast<std::int64_t>(step));
      } else if (value.is(Kind::kTensor)) {
        out.set(p + name.text, value.tensor);
      } else {
        incompatible(where, fmt::format("parameter {}'s '{}' is a {}", index.integer, name.text,
                                        value.type_name()));
      }
    }
  }
  return out;
}

// --- schedulers -------------------------------------------------------------------------------

StateDict scheduler_from_python(const PyValue& saved, const StateDict& current,
                                const std::string& where) {
  require_dict(saved, where, "a scheduler's");
  StateDict out;
  out.set_description(where);
  const std::string type = current.get<std::string>("type");
  out.set("type", type);
  if (type == "torch::optim::StepLR") {
    // LibTorch's StepLR counts its steps, which is Python's last_epoch.
    const PyValue& last = need(saved, "last_epoch", where);
    if (!last.is(Kind::kInt) || last.integer < 0) incompatible(where, "bad last_epoch");
    out.set("step_count", static_cast<std::uint64_t>(last.integer));
    return out;
  }
  static const std::map<std::string, std::string> kPythonName = {
      {"step_count", "_step_count"}, {"last_lrs", "_last_lr"}};
  for (const auto& [key, now] : current.entries()) {
    if (key == "type") continue;
    auto renamed = kPythonName.find(key);
    const std::string python = renamed == kPythonName.end() ? key : renamed->second;
    const PyValue* v = saved.find(python);
    if (v == nullptr) {
      incompatible(where, fmt::format("it has no '{}': it was saved by another scheduler class "
                                      "than torchpoint::{}, or another PyTorch version",
                                      python, type));
    }
    if (std::holds_alternative<at::Tensor>(now)) {
      out.set_double(key, as_number(*v, where, python));
    } else if (v->is(Kind::kDict) && v->type == "Counter") {
      // MultiStepLR's milestones: a Counter of milestone -> times.
      std::vector<std::int64_t> milestones;
      for (const auto& [m, times] : v->entries) {
        if (!m.is(Kind::kInt) || !times.is(Kind::kInt)) incompatible(where, "bad milestones");
        for (std::int64_t t = 0; t < times.integer && t < 1000000; ++t) milestones.push_back(m.integer);
      }
      std::sort(milestones.begin(), milestones.end());
      out.set(key, Json(milestones));
    } else {
      out.set(key, to_json(*v, fmt::format("{} '{}'", where, python)));
    }
  }
  return out;
}

// A GradScaler's state: PyTorch's keys and torchpoint's are the same (scale, growth_factor,
// backoff_factor, growth_interval, _growth_tracker).
StateDict scaler_from_python(const PyValue& saved, const StateDict& current,
                             const std::string& where) {
  require_dict(saved, where, "a GradScaler's");
  if (saved.entries.empty()) {
    incompatible(where, "it is the state of a disabled GradScaler (empty), but a GradScaler is "
                        "prepared");
  }
  StateDict out;
  out.set_description(where);
  for (const auto& [key, now] : current.entries()) {
    const PyValue& v = need(saved, key, where);
    if (std::holds_alternative<at::Tensor>(now)) {
      out.set_double(key, as_number(v, where, key));
    } else {
      out.set(key, to_json(v, fmt::format("{} '{}'", where, key)));
    }
  }
  return out;
}

// --- random states ----------------------------------------------------------------------------

StateDict rng_from_python(const PyValue& saved, const StateDict& current, const std::string& where,
                          AccelerateRead& read) {
  if (!saved.is(Kind::kDict)) incompatible(where, "it does not hold a dict of random states");
  const PyValue& torch_state = need(saved, "torch_manual_seed", where);
  const at::Tensor& now = current.tensor("cpu");
  if (!torch_state.is(Kind::kTensor) || torch_state.tensor.scalar_type() != at::kByte ||
      torch_state.tensor.numel() != now.numel()) {
    incompatible(where, fmt::format("torch_manual_seed is not the {} bytes of torch's CPU "
                                    "generator state",
                                    now.numel()));
  }
  for (const auto& [k, v] : saved.entries) {
    const std::string key = k.is(Kind::kStr) ? k.text : "";
    if (key == "step" || key == "torch_manual_seed") continue;
    if (key == "random_state") {
      read.not_applicable.push_back(fmt::format(
          "{}: random_state (Python's random module) has no C++ counterpart: not restored",
          where));
    } else if (key == "numpy_random_seed") {
      read.not_applicable.push_back(fmt::format(
          "{}: numpy_random_seed (NumPy's global generator) has no C++ counterpart: not restored",
          where));
    } else {
      // torch_cuda_manual_seed, torch_xpu_manual_seed, xm_seed, ...: an accelerator's streams.
      throw Error(ErrorCode::Incompatible,
                  fmt::format("{} holds '{}', the random state of an accelerator of the Python "
                              "run; torchpoint restores only torch's CPU generator from an "
                              "Accelerate checkpoint, and the run would not continue the same "
                              "without it: load it on the CPU in Python and save it again",
                              where, key));
    }
  }
  StateDict out;
  out.set_description(where);
  for (const auto& [key, value] : current.entries()) {
    if (key == "cpu") {
      out.set(key, torch_state.tensor.contiguous());
    } else {
      read.not_in_checkpoint.push_back(fmt::format("{} (random generator '{}')", where, key));
      if (const at::Tensor* t = std::get_if<at::Tensor>(&value)) {
        out.set(key, *t);
      } else {
        out.set(key, std::get<Json>(value));
      }
    }
  }
  return out;
}

bool exists(Env& env, const std::string& path) { return env.stat(path).exists; }

}  // namespace

// A scheduler's state (torchpoint's or torch::optim::StepLR's): what Accelerate's guide
// registers with register_for_checkpointing, saved as a custom object.
bool is_scheduler_state(const StateDict& s) {
  if (!s.contains("type") || s.is_tensor("type")) return false;
  return (s.contains("last_epoch") && s.contains("base_lrs")) ||
         s.get<std::string>("type") == "torch::optim::StepLR";
}

namespace {

}  // namespace

AccelerateRead read_accelerate_directory(const std::string& dir,
                                         const std::vector<WantedComponent>& wanted,
                                         const std::string& rng_name, const StateDict& rng_current,
                                         int rank, Env& env) {
  AccelerateRead read;
  std::set<std::string> claimed;
  for (const WantedComponent& c : wanted) {
    if (c.kind == "sampler") {
      read.not_in_checkpoint.push_back(fmt::format(
          "{} (an Accelerate checkpoint has no data position: the loader continues from where it "
          "is; skip the batches already seen with skip_first_batches)",
          c.name));
      continue;
    }
    std::vector<std::string> candidates = accelerate_files_of(c.name, c.kind);
    std::string file;
    for (const std::string& name : candidates) {
      if (exists(env, join_path(dir, name))) {
        file = name;
        break;
      }
    }
    if (file.empty()) {
      throw Error(ErrorCode::NotFound,
                  fmt::format("{}: the Accelerate checkpoint has no {} for the prepared {} '{}'; "
                              "prepare the same objects as the Python run, in the same order",
                              dir, fmt::join(candidates, " or "), c.kind, c.name));
    }
    claimed.insert(file);
    const std::string path = join_path(dir, file);
    StateDict state;
    if (c.kind == "model") {
      if (file.ends_with(".safetensors")) {
        state = StateDict::from_container(load_safetensors(path, env).contents);
      } else {
        state = load_torch_state_dict(path, env);
      }
    } else if (c.kind == "scaler") {
      state = scaler_from_python(load_torch_value(path, env), c.current, path);
    } else {
      PyValue value = load_torch_value(path, env);
      if (c.kind == "optimizer") {
        state = optimizer_from_python(value, c.current, path);
      } else if (c.kind == "scheduler" || is_scheduler_state(c.current)) {
        state = scheduler_from_python(value, c.current, path);
      } else {
        if (!value.is(Kind::kDict)) {
          throw Error(ErrorCode::Unsupported,
                      fmt::format("{} holds a Python {}, not a state dict; torchpoint reads a "
                                  "registered object's state_dict() when it is a dict",
                                  path, value.type_name()));
        }
        custom_entries(value, "", path, state);
      }
    }
    state.set_description(path);
    read.all.set_child(c.name, state);
    read.files.push_back(file);
  }
  const std::string rng_file = fmt::format("{}{}.pkl", kRngPrefix, rank);
  const std::string rng_path = join_path(dir, rng_file);
  if (!exists(env, rng_path)) {
    throw Error(ErrorCode::NotFound,
                fmt::format("{}: the Accelerate checkpoint has no {}: the random state of "
                            "process {} cannot be restored",
                            dir, rng_file, rank));
  }
  PyValue rng = load_torch_value(rng_path, env);
  read.all.set_child(rng_name, rng_from_python(rng, rng_current, rng_path, read));
  if (const PyValue* step = rng.find("step")) {
    if (!step->is(Kind::kInt) || step->integer < 0) incompatible(rng_path, "'step' is not a count");
    read.step = step->integer;
  }
  read.files.push_back(rng_file);
  claimed.insert(rng_file);
  // Files of objects the program did not prepare: Accelerate would ignore them; torchpoint
  // refuses, as it does for its own checkpoints, rather than drop state silently.
  std::vector<std::string> unclaimed;
  for (const std::string& name : env.list_dir(dir)) {
    if (claimed.contains(name) || name.starts_with(kRngPrefix)) continue;
    const bool known = name.starts_with("model") || name.starts_with("pytorch_model") ||
                       name.starts_with("optimizer") || name.starts_with("scheduler") ||
                       name.starts_with(kCustomPrefix) || name == "scaler.pt";
    if (known) {
      unclaimed.push_back(name);
    } else if (name.starts_with("sampler") || name.starts_with("dl_state_dict")) {
      read.not_applicable.push_back(fmt::format(
          "{}: {} (the state of a Python data loader or sampler object) has no C++ counterpart: "
          "not restored; the prepared loaders keep their position",
          dir, name));
    } else {
      read.notes.push_back(fmt::format("{}: {} is not a file of Accelerate's save_state: ignored",
                                       dir, name));
    }
  }
  if (!unclaimed.empty()) {
    std::sort(unclaimed.begin(), unclaimed.end());
    throw Error(ErrorCode::Incompatible,
                fmt::format("{} holds {}, which no prepared or registered object takes; prepare "
                            "and register the same objects as the Python run",
                            dir, fmt::join(unclaimed, ", ")));
  }
  return read;
}

// --- writing ----------------------------------------------------------------------------------

namespace {

PyValue from_json(const Json& j) {
  if (j.is_null()) return PyValue::none();
  if (j.is_boolean()) return PyValue::of(j.get<bool>());
  if (j.is_number_unsigned()) {
    auto u = j.get<std::uint64_t>();
    if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      return PyValue::of(static_cast<double>(u));
    }
    return PyValue::of(static_cast<std::int64_t>(u));
  }
  if (j.is_number_integer()) return PyValue::of(j.get<std::int64_t>());
  if (j.is_number()) return PyValue::of(j.get<double>());
  if (j.is_string()) return PyValue::of(j.get<std::string>());
  if (j.is_array()) {
    std::vector<PyValue> items;
    for (const Json& item : j) items.push_back(from_json(item));
    return PyValue::list(std::move(items));
  }
  PyValue dict = PyValue::dict();
  for (const auto& [k, v] : j.items()) dict.set(k, from_json(v));
  return dict;
}

PyValue entry_value(const StateDict::Value& v) {
  if (const at::Tensor* t = std::get_if<at::Tensor>(&v)) return PyValue::of(*t);
  return from_json(std::get<Json>(v));
}

// The options Python's optimizer of `type` keeps in every param group besides the arithmetic
// ones torchpoint records, at their defaults.
void python_only_options(const std::string& type, PyValue& group) {
  group.set("maximize", PyValue::of(false));
  group.set("foreach", PyValue::none());
  group.set("differentiable", PyValue::of(false));
  if (type == "Adam" || type == "AdamW" || type == "RMSprop") {
    group.set("capturable", PyValue::of(false));
  }
  if (type != "RMSprop") group.set("fused", PyValue::none());
  if (type == "Adam" || type == "AdamW") {
    group.set("decoupled_weight_decay", PyValue::of(type == "AdamW"));
  }
}

PyValue optimizer_to_python(const StateDict& sd, const std::vector<double>& initial_lrs,
                            const std::string& where) {
  const std::string type = sd.get<std::string>("type");
  if (type == "LBFGS" || type.empty()) {
    throw Error(ErrorCode::Unsupported,
                fmt::format("{}: a {} optimizer's state is not carried to Python Accelerate "
                            "(Adam, AdamW, SGD, RMSprop and Adagrad are)",
                            where, type));
  }
  PyValue state = PyValue::dict();
  PyValue groups = PyValue::list({});
  const auto count = sd.get<std::int64_t>("param_groups.count");
  std::int64_t index = 0;
  for (std::int64_t g = 0; g < count; ++g) {
    const std::string p = fmt::format("param_groups.{}.", g);
    PyValue group = PyValue::dict();
    const StateDict options = sd.child(p.substr(0, p.size() - 1));
    for (const auto& [key, value] : options.entries()) {
      if (key == "num_params") continue;
      PyValue v = entry_value(value);
      if (key == "betas") v.kind = Kind::kTuple;
      group.set(key, std::move(v));
    }
    python_only_options(type, group);
    if (static_cast<std::size_t>(g) < initial_lrs.size()) {
      group.set("initial_lr", PyValue::of(initial_lrs[g]));
    }
    PyValue params = PyValue::list({});
    const auto n = sd.get<std::int64_t>(p + "num_params");
    for (std::int64_t i = 0; i < n; ++i, ++index) {
      params.items.push_back(PyValue::of(index));
      const std::string sp = fmt::format("state.{}.{}", g, i);
      if (!sd.has_child(sp)) continue;
      PyValue fields = PyValue::dict();
      const StateDict param_state = sd.child(sp);
      for (const auto& [key, value] : param_state.entries()) {
        if (key == "step") {
          // Python keeps the step as a float32 tensor (on the CPU unless capturable).
          fields.set(key, PyValue::of(at::scalar_tensor(static_cast<double>(
                                                            std::get<Json>(value).get<std::int64_t>()),
                                                        at::TensorOptions().dtype(at::kFloat))));
        } else {
          fields.set(key, entry_value(value));
        }
      }
      state.entries.push_back({PyValue::of(index), std::move(fields)});
    }
    group.set("params", std::move(params));
    groups.items.push_back(std::move(group));
  }
  PyValue out = PyValue::dict();
  out.set("state", std::move(state));
  out.set("param_groups", std::move(groups));
  return out;
}

PyValue scheduler_to_python(const StateDict& sd, const std::string& where) {
  const std::string type = sd.get<std::string>("type");
  if (type.starts_with("torch::optim::")) {
    throw Error(ErrorCode::Unsupported,
                fmt::format("{}: LibTorch's {} does not expose its options, so Python's "
                            "scheduler cannot be given them; use torchpoint's scheduler of the "
                            "same name",
                            where, type));
  }
  PyValue out = PyValue::dict();
  for (const auto& [key, value] : sd.entries()) {
    if (key == "type") continue;
    const std::string python = key == "step_count" ? "_step_count"
                               : key == "last_lrs" ? "_last_lr"
                                                   : key;
    PyValue v = entry_value(value);
    if (v.is(Kind::kTensor) && v.tensor.numel() == 1 && v.tensor.scalar_type() == at::kDouble) {
      v = PyValue::of(v.tensor.item<double>());  // a non-finite float (ReduceLROnPlateau's best)
    }
    if (key == "milestones" && v.is(Kind::kList)) {
      PyValue counter = PyValue::dict();
      counter.type = "Counter";
      for (const PyValue& m : v.items) {
        bool found = false;
        for (auto& [k, times] : counter.entries) {
          if (k.integer == m.integer) {
            ++times.integer;
            found = true;
          }
        }
        if (!found) counter.entries.push_back({m, PyValue::of(std::int64_t{1})});
      }
      v = std::move(counter);
    }
    out.set(python, std::move(v));
  }
  out.set("_is_initial", PyValue::of(false));
  out.set("_get_lr_called_within_step", PyValue::of(false));
  return out;
}

// MT19937 seeded as its authors' init_genrand(seed) does: the 624 words of its state.
std::vector<std::uint32_t> mt19937_words(std::uint32_t seed) {
  std::vector<std::uint32_t> mt(624);
  mt[0] = seed;
  for (std::uint32_t i = 1; i < 624; ++i) {
    mt[i] = 1812433253u * (mt[i - 1] ^ (mt[i - 1] >> 30)) + i;
  }
  return mt;
}

PyValue rng_to_python(const StateDict& sd, std::int64_t step, const std::string& where,
                      AccelerateExport& report) {
  const at::Tensor cpu = sd.tensor("cpu").contiguous();
  // The generator's state begins with its seed (a little-endian uint64).
  std::uint64_t seed = 0;
  std::memcpy(&seed, cpu.data_ptr(), std::min<std::size_t>(8, cpu.numel()));
  const std::vector<std::uint32_t> words = mt19937_words(static_cast<std::uint32_t>(seed));
  std::vector<PyValue> python_state;
  for (std::uint32_t w : words) python_state.push_back(PyValue::of(static_cast<std::int64_t>(w)));
  python_state.push_back(PyValue::of(std::int64_t{624}));
  PyValue array;
  array.kind = Kind::kArray;
  array.type = "<u4";
  array.shape = {624};
  array.text.assign(reinterpret_cast<const char*>(words.data()), words.size() * 4);
  PyValue out = PyValue::dict();
  out.set("step", PyValue::of(step));
  out.set("random_state", PyValue::tuple({PyValue::of(std::int64_t{3}),
                                          PyValue::tuple(std::move(python_state)),
                                          PyValue::none()}));
  out.set("numpy_random_seed",
          PyValue::tuple({PyValue::of(std::string("MT19937")), std::move(array),
                          PyValue::of(std::int64_t{624}), PyValue::of(std::int64_t{0}),
                          PyValue::of(0.0)}));
  out.set("torch_manual_seed", PyValue::of(cpu));
  report.notes.push_back(fmt::format(
      "{}: Python's random and NumPy's global generators have no C++ state; they get MT19937 "
      "states seeded with {} (the low 32 bits of torch's seed)",
      where, static_cast<std::uint32_t>(seed)));
  std::vector<PyValue> cuda;
  for (const auto& [key, value] : sd.entries()) {
    if (key == "cpu") continue;
    if (key.starts_with("cuda.")) {
      cuda.push_back(entry_value(value));
    } else {
      report.notes.push_back(fmt::format(
          "{}: random generator '{}' has no place in an Accelerate checkpoint: not exported",
          where, key));
    }
  }
  if (!cuda.empty()) out.set("torch_cuda_manual_seed", PyValue::list(std::move(cuda)));
  return out;
}

}  // namespace

}  // namespace detail

AccelerateExport export_accelerate_checkpoint(const std::string& checkpoint_dir,
                                              const std::string& output_dir, Env& env) {
  using detail::PyValue;
  DirectoryCheckpoint checkpoint = load_directory(checkpoint_dir, env);
  if (env.stat(output_dir).exists) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("{} exists; export into a new directory", output_dir));
  }
  AccelerateExport report;
  std::vector<double> initial_lrs;
  // Python's schedulers set each param group's initial_lr: from the first scheduler's base_lrs.
  for (const Component& c : checkpoint.components) {
    if (c.name != "scheduler" && !c.name.starts_with(detail::kCustomPrefix)) continue;
    StateDict s = StateDict::from_container(c.contents);
    if (detail::is_scheduler_state(s) && s.contains("base_lrs")) {
      initial_lrs = s.get<std::vector<double>>("base_lrs");
      break;
    }
  }
  PendingDir pending(env, output_dir);
  for (const Component& c : checkpoint.components) {
    const std::string kind = detail::component_kind(c.name);
    const std::string where = fmt::format("{}: {}", checkpoint_dir, c.name);
    StateDict sd = StateDict::from_container(c.contents);
    sd.set_description(where);
    std::string file;
    if (kind == "model") {
      StateDict tensors;
      for (const auto& [key, value] : sd.entries()) {
        if (const at::Tensor* t = std::get_if<at::Tensor>(&value)) tensors.set(key, *t);
      }
      file = c.name + ".safetensors";
      save_file(join_path(pending.temp_path(), file), tensors.to_container(), env);
    } else if (kind == "optimizer" || kind == "scheduler" || kind == "custom" ||
               kind == "random_states" || kind == "scaler") {
      PyValue value;
      if (kind == "scaler") {
        value = PyValue::dict();
        for (const auto& [key, v] : sd.entries()) {
          PyValue p = detail::entry_value(v);
          if (p.is(detail::Kind::kTensor)) p = PyValue::of(p.tensor.item<double>());
          value.set(key, std::move(p));
        }
        file = "scaler.pt";
      } else if (kind == "optimizer") {
        value = detail::optimizer_to_python(sd, initial_lrs, where);
        file = c.name + ".bin";
      } else if (kind == "scheduler") {
        value = detail::scheduler_to_python(sd, where);
        file = c.name + ".bin";
      } else if (kind == "custom" && detail::is_scheduler_state(sd)) {
        value = detail::scheduler_to_python(sd, where);
        file = c.name + ".pkl";
      } else if (kind == "custom") {
        value = PyValue::dict();
        for (const auto& [key, v] : sd.entries()) value.set(key, detail::entry_value(v));
        file = c.name + ".pkl";
      } else {
        value = detail::rng_to_python(sd, checkpoint.info.step, where, report);
        file = c.name + ".pkl";
      }
      detail::save_torch_value(join_path(pending.temp_path(), file), value, c.name, env);
    } else if (kind == "sampler") {
      report.notes.push_back(fmt::format(
          "{}: the data position has no place in an Accelerate checkpoint: not exported (the "
          "Python run skips the batches it has seen with skip_first_batches)",
          where));
      continue;
    } else {
      report.notes.push_back(fmt::format(
          "{}: not a component of Accelerate's layout (model, optimizer, scheduler, "
          "custom_checkpoint_<i>, random_states_<rank>): not exported",
          where));
      continue;
    }
    report.files.push_back(file);
  }
  if (std::none_of(report.files.begin(), report.files.end(),
                   [](const std::string& f) { return f.starts_with(detail::kRngPrefix); })) {
    report.notes.push_back(fmt::format(
        "{} has no random states: Python's accelerator.load_state will log that it could not "
        "load them, and the Python run continues from its own",
        checkpoint_dir));
  }
  pending.commit();
  return report;
}

// --- inspecting ---------------------------------------------------------------------------------

namespace detail {
namespace {

constexpr std::size_t kMaxValues = 500;

std::string torch_dtype_name(c10::ScalarType type) {
  static const std::map<c10::ScalarType, std::string> kNames = {
      {at::kFloat, "float32"}, {at::kDouble, "float64"}, {at::kHalf, "float16"},
      {at::kBFloat16, "bfloat16"}, {at::kLong, "int64"}, {at::kInt, "int32"},
      {at::kShort, "int16"}, {at::kChar, "int8"}, {at::kByte, "uint8"}, {at::kBool, "bool"}};
  auto it = kNames.find(type);
  return it != kNames.end() ? it->second : c10::toString(type);
}

std::string tensor_text(const at::Tensor& t) {
  return fmt::format("{} [{}]", torch_dtype_name(t.scalar_type()), fmt::join(t.sizes(), ", "));
}

bool is_scalar(const PyValue& v) {
  return v.is(Kind::kInt) || v.is(Kind::kFloat) || v.is(Kind::kBool) || v.is(Kind::kNone);
}

std::string scalar_text(const PyValue& v) {
  switch (v.kind) {
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return v.boolean ? "True" : "False";
    case Kind::kInt:
      return std::to_string(v.integer);
    default:
      return fmt::format("{}", v.number);
  }
}

// Every leaf of `v` under `path`, as (path, text).
void describe(const PyValue& v, const std::string& path, AccelerateFileView& out,
              std::size_t& more) {
  auto add = [&](std::string text) {
    if (out.values.size() < kMaxValues) {
      out.values.emplace_back(path.empty() ? "(value)" : path, std::move(text));
    } else {
      ++more;
    }
  };
  auto child = [&](const std::string& key) { return path.empty() ? key : path + "." + key; };
  switch (v.kind) {
    case Kind::kStr:
      return add(Json(v.text.size() > 80 ? v.text.substr(0, 77) + "..." : v.text).dump());
    case Kind::kBytes:
      return add(fmt::format("{} bytes", v.text.size()));
    case Kind::kTensor:
      return add(tensor_text(v.tensor));
    case Kind::kArray:
      return add(fmt::format("numpy {} [{}]", v.type, fmt::join(v.shape, ", ")));
    case Kind::kTuple:
    case Kind::kList: {
      const bool tuple = v.is(Kind::kTuple);
      if (v.items.empty()) return add(tuple ? "()" : "[]");
      const bool scalars = std::all_of(v.items.begin(), v.items.end(), is_scalar);
      if (scalars && v.items.size() <= 8) {
        std::vector<std::string> texts;
        for (const PyValue& item : v.items) texts.push_back(scalar_text(item));
        const std::string joined = fmt::format("{}", fmt::join(texts, ", "));
        return add(tuple ? "(" + joined + ")" : "[" + joined + "]");
      }
      if (scalars) {
        const bool ints = std::all_of(v.items.begin(), v.items.end(),
                                      [](const PyValue& i) { return i.is(Kind::kInt); });
        return add(fmt::format("{} {} {}", tuple ? "tuple of" : "list of", v.items.size(),
                               ints ? "ints" : "numbers"));
      }
      for (std::size_t i = 0; i < v.items.size(); ++i) {
        describe(v.items[i], child(std::to_string(i)), out, more);
      }
      return;
    }
    case Kind::kDict:
      if (v.entries.empty()) return add(v.type == "dict" ? "{}" : v.type_name() + "()");
      for (const auto& [key, value] : v.entries) {
        describe(value, child(key.is(Kind::kStr) ? key.text : scalar_text(key)), out, more);
      }
      return;
    default:
      return add(scalar_text(v));
  }
}

// The kind of an Accelerate file: its stem's kind, when it has that kind's extension.
std::string kind_of_file(const std::string& name) {
  const std::size_t dot = name.find('.');
  if (dot == std::string::npos) return "other";
  std::string_view stem = std::string_view(name).substr(0, dot);
  const std::string_view extension = std::string_view(name).substr(dot);
  const bool pickled_model = stem.starts_with("pytorch_");  // pytorch_model.bin
  if (pickled_model) stem.remove_prefix(std::string_view("pytorch_").size());
  const std::string kind = component_kind(stem);
  const std::string_view expected = kind == "model"  ? (pickled_model ? ".bin" : ".safetensors")
                                    : kind == "scaler" ? ".pt"
                                    : kind == "custom" || kind == "random_states" ? ".pkl"
                                                                                  : ".bin";
  return !kind.empty() && extension == expected && (!pickled_model || kind == "model") ? kind
                                                                                       : "other";
}

std::string summary_of(const std::string& kind, const PyValue& v) {
  if (kind == "optimizer") {
    const PyValue* groups = v.find("param_groups");
    const PyValue* state = v.find("state");
    if (groups == nullptr || !groups->is(Kind::kList) || groups->items.empty()) return "";
    std::string type = python_optimizer_type(groups->items[0]);
    return fmt::format("torch.optim.{}, {} param group{}, state for {} parameters",
                       type.empty() ? "(unknown type)" : type, groups->items.size(),
                       groups->items.size() == 1 ? "" : "s",
                       state != nullptr ? state->entries.size() : 0);
  }
  if (kind == "scheduler" || kind == "custom") {
    const PyValue* last = v.find("last_epoch");
    const PyValue* lr = v.find("_last_lr");
    if (last != nullptr && lr != nullptr && lr->is(Kind::kList) && !lr->items.empty()) {
      return fmt::format("an LR scheduler: last_epoch {}, last lr {}", scalar_text(*last),
                         scalar_text(lr->items[0]));
    }
    return v.is(Kind::kDict) ? fmt::format("{} of {} entries", v.type_name(), v.entries.size())
                             : v.type_name();
  }
  if (kind == "random_states") {
    std::vector<std::string> parts;
    if (const PyValue* step = v.find("step")) parts.push_back("step " + scalar_text(*step));
    for (const auto& [key, _] : v.entries) {
      if (!key.is(Kind::kStr) || key.text == "step") continue;
      parts.push_back(key.text == "torch_manual_seed"   ? "torch CPU generator (restored in C++)"
                      : key.text == "random_state"      ? "Python random (not applicable in C++)"
                      : key.text == "numpy_random_seed" ? "NumPy (not applicable in C++)"
                                                        : key.text + " (an accelerator's)");
    }
    return fmt::format("{}", fmt::join(parts, "; "));
  }
  return v.is(Kind::kDict) ? fmt::format("{} of {} entries", v.type_name(), v.entries.size())
                           : v.type_name();
}

}  // namespace
}  // namespace detail

AccelerateView inspect_accelerate_checkpoint(const std::string& dir, Env& env) {
  if (!is_accelerate_checkpoint(dir, env)) {
    throw Error(ErrorCode::NotFound,
                fmt::format("{} is not a checkpoint of Python Accelerate's save_state", dir));
  }
  AccelerateView view;
  view.path = dir;
  std::vector<std::string> names = env.list_dir(dir);
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    const std::string path = join_path(dir, name);
    FileInfo info = env.stat(path);
    if (!info.is_regular) continue;
    AccelerateFileView file;
    file.name = name;
    file.kind = detail::kind_of_file(name);
    file.size = info.size;
    std::size_t more = 0;
    try {
      if (file.kind == "model" && name.ends_with(".safetensors")) {
        ForeignContainer c = load_safetensors(path, env);
        StateDict sd = StateDict::from_container(c.contents);
        std::uint64_t bytes = 0;
        for (const auto& [key, value] : sd.entries()) {
          if (const at::Tensor* t = std::get_if<at::Tensor>(&value)) {
            bytes += t->numel() * t->element_size();
            if (file.values.size() < detail::kMaxValues) {
              file.values.emplace_back(key, detail::tensor_text(*t));
            } else {
              ++more;
            }
          }
        }
        file.summary = fmt::format("{} tensors, {} bytes (safetensors{})", sd.size(), bytes,
                                   c.verified ? ", checksummed" : "");
      } else if (file.kind != "other") {
        detail::PyValue value = detail::load_torch_value(path, env);
        detail::describe(value, "", file, more);
        file.summary = detail::summary_of(file.kind, value);
        if (file.kind == "random_states" && name == "random_states_0.pkl") {
          if (const detail::PyValue* step = value.find("step"); step && step->is(detail::Kind::kInt)) {
            view.step = step->integer;
          }
        }
      } else {
        file.summary = "not a file of Accelerate's save_state";
      }
    } catch (const Error& e) {
      file.problem = e.what();
      file.problem_code = e.code();
    }
    if (more > 0) file.values.emplace_back("...", fmt::format("{} more values", more));
    view.files.push_back(std::move(file));
  }
  return view;
}

bool is_accelerate_checkpoint(const std::string& dir, Env& env) {
  FileInfo info = env.stat(dir);
  if (!info.exists || !info.is_directory) return false;
  if (env.stat(join_path(dir, kManifestFileName)).exists) return false;
  // Accelerate's save_state always writes process 0's random states, as a pickle; torchpoint
  // never writes a .pkl (an uncommitted torchpoint checkpoint is not taken for one).
  return env.stat(join_path(dir, "random_states_0.pkl")).is_regular;
}

}  // namespace torchpoint
