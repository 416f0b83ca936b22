// Python Accelerate's checkpoint files written from a torchpoint checkpoint (export), as
// Python's save_state() lays them out, for torch.load in Python.
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

// `group_keys`: what the optimizer's scheduler keeps in each param group (none without one).
PyValue optimizer_to_python(
    const StateDict& sd,
    const std::vector<std::vector<std::pair<std::string, PyValue>>>& group_keys,
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
    if (static_cast<std::size_t>(g) < group_keys.size()) {
      for (const auto& [key, value] : group_keys[g]) group.set(key, value);
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

PyValue entry_value(const StateDict::Value& v) {
  if (const at::Tensor* t = std::get_if<at::Tensor>(&v)) return PyValue::of(*t);
  return from_json(std::get<Json>(v));
}

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
  // Each scheduler goes with an optimizer (scheduler_<i> with optimizer_<i>, a registered one
  // with the only optimizer): Python keeps some of its values in that optimizer's param groups.
  std::vector<std::string> optimizers;
  std::map<std::string, StateDict> optimizer_states;
  for (const Component& c : checkpoint.components) {
    if (detail::component_kind(c.name) != "optimizer") continue;
    optimizers.push_back(c.name);
    optimizer_states[c.name] = StateDict::from_container(c.contents);
  }
  std::map<std::string, detail::PyValue> scheduler_files;  // by the scheduler's name
  using GroupKeys = std::vector<std::vector<std::pair<std::string, PyValue>>>;
  std::map<std::string, GroupKeys> group_keys;  // by the optimizer's name
  for (const Component& c : checkpoint.components) {
    const std::string kind = detail::component_kind(c.name);
    if (kind != "scheduler" && kind != "custom") continue;
    StateDict s = StateDict::from_container(c.contents);
    if (kind == "custom" && !detail::is_scheduler_state(s)) continue;
    s.set_description(fmt::format("{}: {}", checkpoint_dir, c.name));
    const std::string optimizer = detail::paired_optimizer_name(c.name, optimizers);
    detail::PythonScheduler py = detail::scheduler_to_python(
        s, s.description(), optimizer.empty() ? nullptr : &optimizer_states[optimizer]);
    report.notes.insert(report.notes.end(), py.notes.begin(), py.notes.end());
    if (!optimizer.empty() && !group_keys.contains(optimizer)) {
      group_keys[optimizer] = py.group_keys;
    }
    scheduler_files[c.name] = std::move(py.state);
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
        value = detail::optimizer_to_python(sd, group_keys[c.name], where);
        file = c.name + ".bin";
      } else if (kind == "scheduler") {
        value = scheduler_files.at(c.name);
        file = c.name + ".bin";
      } else if (kind == "custom" && detail::is_scheduler_state(sd)) {
        value = scheduler_files.at(c.name);
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

}  // namespace torchpoint
