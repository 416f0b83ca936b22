// Python Accelerate's checkpoint files, read into torchpoint's component states (written by
// accelerate_export.cc, described by accelerate_inspect.cc). Python keys an optimizer's state by
// the parameter's index over all its param groups and names no optimizer type; torchpoint keys it
// by (group, position) and records the type. The type is recognised from the param groups'
// option names, and must be the one of the optimizer the C++ program prepared.
#include "python/accelerate_files.h"

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
#include "python/torch_value.h"
#include "torchpoint/accelerate_interop.h"
#include "torchpoint/checkpoint_dir.h"
#include "torchpoint/error.h"
#include "torchpoint/interop.h"
#include "torchpoint/tensor_file.h"

namespace torchpoint {
namespace detail {

[[noreturn]] void incompatible(const std::string& where, const std::string& what) {
  throw Error(ErrorCode::Incompatible, fmt::format("{}: {}", where, what));
}

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

namespace {


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

// A scheduler's state (torchpoint's or torch::optim::StepLR's): what Accelerate's guide
// registers with register_for_checkpointing, saved as a custom object.
bool is_scheduler_state(const StateDict& s) {
  if (!s.contains("type") || s.is_tensor("type")) return false;
  return (s.contains("last_epoch") && s.contains("base_lrs")) ||
         s.get<std::string>("type") == "torch::optim::StepLR";
}


AccelerateRead read_accelerate_directory(const std::string& dir,
                                         const std::vector<WantedComponent>& wanted,
                                         const std::string& rng_name, const StateDict& rng_current,
                                         int rank, Env& env) {
  AccelerateRead read;
  std::set<std::string> claimed;
  std::vector<std::string> optimizers;
  for (const WantedComponent& c : wanted) {
    if (c.kind == "optimizer") optimizers.push_back(c.name);
  }
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
        PairedOptimizer optimizer;
        const std::string paired = paired_optimizer_name(c.name, optimizers);
        if (!paired.empty()) {
          optimizer.path = join_path(dir, paired + ".bin");
          optimizer.read = [&env, file = optimizer.path] { return load_torch_value(file, env); };
        }
        state = scheduler_from_python(value, c.current, path, optimizer);
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

}  // namespace detail
}  // namespace torchpoint
