// LR schedulers between torchpoint and Python (torch 2.x's torch.optim.lr_scheduler, checked
// against 2.13), field by field. Where each value lives:
//
//   torchpoint                 Python scheduler.bin             Python optimizer.bin param group
//   last_epoch                 last_epoch
//   step_count                 _step_count (ReduceLROnPlateau: none; there = last_epoch)
//   base_lrs                   base_lrs                         initial_lr
//   last_lrs                   _last_lr
//   StepLR, MultiStepLR, ExponentialLR, CosineAnnealingLR, LinearLR: every option under its own
//   name (MultiStepLR's milestones as a Counter).
//   OneCycleLR:
//     total_steps              total_steps
//     pct_start, three_phase   _schedule_phases (end steps pct*total-1 [, 2*pct*total-2], total-1)
//     anneal_strategy          _anneal_func_type
//     cycle_momentum           cycle_momentum, use_beta1 (the optimizer has betas)
//     max_lr                                                    max_lr
//     min_lrs                                                   min_lr
//     max_momentum, base_momentum                               max_momentum, base_momentum
//     div_factor, final_div_factor: used by the constructor only; from Python they are the
//     ratios max_lr / initial_lr and initial_lr / min_lr of group 0
//   ReduceLROnPlateau:
//     min_lr                   min_lrs, default_min_lr (one value for every group, else None)
//     mode                     mode, mode_worse (inf for min, -inf for max)
//     factor, patience, threshold, threshold_mode, cooldown, eps, best, num_bad_epochs,
//     cooldown_counter: the same names
//     base_lrs: not in Python's state (unused by the schedule): the C++ scheduler keeps its own
//   torch::optim::StepLR (LibTorch): step_count = Python's last_epoch + 1, because LibTorch
//     decays when the count before the step is a multiple of step_size and Python when the
//     epoch after it is; step_size and gamma (read from LibTorch's private members) the same
//     names, and must equal the C++ scheduler's (LibTorch cannot change them); the learning
//     rates are the optimizer's; base_lrs and initial_lr, which LibTorch does not keep, are the
//     current learning rates (a note of the export says so).
//   torch::optim::ReduceLROnPlateauScheduler (LibTorch): refused when prepared (a compile-time
//     error): its state is private and its arithmetic is float (metric, factor, best), so it
//     cannot continue Python's double arithmetic; torchpoint::ReduceLROnPlateau does.
#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <map>
#include <optional>

#include "python/accelerate_files.h"
#include "torchpoint/error.h"

namespace torchpoint::detail {
namespace {

std::string keys_of(const PyValue& dict) {
  std::vector<std::string> keys;
  for (const auto& [k, _] : dict.entries) {
    if (k.is(Kind::kStr)) keys.push_back(k.text);
  }
  return fmt::format("{}", fmt::join(keys, ", "));
}

// What each key of a Python scheduler's state_dict() means, for messages.
const char* meaning_of(std::string_view key) {
  static const std::map<std::string_view, const char*> kMeaning = {
      {"last_epoch", "the index of the last step"},
      {"_step_count", "the number of step() calls, the constructor's included"},
      {"base_lrs", "the learning rates the schedule starts from"},
      {"_last_lr", "the learning rates the last step set"},
      {"step_size", "the epochs between two decays"},
      {"gamma", "the decay factor"},
      {"milestones", "the epochs of the decays"},
      {"T_max", "the half period of the cosine"},
      {"eta_min", "the bottom of the cosine"},
      {"start_factor", "the factor of the first epoch"},
      {"end_factor", "the factor after total_iters epochs"},
      {"total_iters", "the epochs of the linear change"},
      {"total_steps", "the length of the cycle"},
      {"_schedule_phases", "the phases of the cycle and the step each ends at"},
      {"_anneal_func_type", "'cos' or 'linear', how each phase moves"},
      {"cycle_momentum", "whether the momentum cycles"},
      {"use_beta1", "whether the momentum cycled is the optimizer's beta1"},
      {"factor", "the factor of a reduction"},
      {"min_lrs", "the floor of each param group's learning rate"},
      {"patience", "the epochs without improvement tolerated"},
      {"threshold", "the least change counted as an improvement"},
      {"threshold_mode", "'rel' or 'abs'"},
      {"cooldown", "the epochs without counting after a reduction"},
      {"eps", "the smallest reduction applied"},
      {"mode", "'min' or 'max'"},
      {"best", "the best metric so far"},
      {"num_bad_epochs", "the epochs without improvement so far"},
      {"cooldown_counter", "the epochs of cooldown left"},
  };
  auto it = kMeaning.find(key);
  return it == kMeaning.end() ? "a field of the scheduler" : it->second;
}

// The Python scheduler class whose state_dict() `s` is, by the keys only that class has; "" when
// none matches.
std::string python_scheduler_class(const PyValue& s) {
  auto has = [&](const char* key) { return s.find(key) != nullptr; };
  if (has("_schedule_phases")) return "OneCycleLR";
  if (has("min_lrs") && has("num_bad_epochs")) return "ReduceLROnPlateau";
  if (has("T_0")) return "CosineAnnealingWarmRestarts";
  if (has("T_max") && has("eta_min")) return "CosineAnnealingLR";
  if (has("lr_lambdas")) return "LambdaLR or MultiplicativeLR";
  if (has("_schedulers")) return "SequentialLR or ChainedScheduler";
  if (has("max_lrs") && has("step_ratio")) return "CyclicLR";
  if (has("start_factor") && has("end_factor")) return "LinearLR";
  if (has("power") && has("total_iters")) return "PolynomialLR";
  if (has("factor") && has("total_iters")) return "ConstantLR";
  if (has("milestones")) return "MultiStepLR";
  if (has("step_size")) return "StepLR";
  if (has("gamma") && has("base_lrs")) return "ExponentialLR";
  return "";
}

// `saved`[key], or an error naming the key, its meaning and the file.
const PyValue& need(const PyValue& saved, std::string_view key, const std::string& python_class,
                    const std::string& where) {
  const PyValue* v = saved.find(key);
  if (v == nullptr) {
    incompatible(where, fmt::format("it has no '{}' ({}), which torch 2.x's {} keeps in its "
                                    "state_dict() and the schedule needs to continue; the keys "
                                    "it has: {}",
                                    key, meaning_of(key), python_class, keys_of(saved)));
  }
  return *v;
}

double number(const PyValue& v, const std::string& where, std::string_view key) {
  if (v.is(Kind::kFloat)) return v.number;
  if (v.is(Kind::kInt)) return static_cast<double>(v.integer);
  if (v.is(Kind::kTensor) && v.tensor.numel() == 1) return v.tensor.item<double>();
  incompatible(where, fmt::format("'{}' is a {}, not a number", key, v.type_name()));
}

std::int64_t integer(const PyValue& v, const std::string& where, std::string_view key) {
  if (!v.is(Kind::kInt)) {
    incompatible(where, fmt::format("'{}' is a {}, not an int", key, v.type_name()));
  }
  return v.integer;
}

bool boolean(const PyValue& v, const std::string& where, std::string_view key) {
  if (!v.is(Kind::kBool)) {
    incompatible(where, fmt::format("'{}' is a {}, not a bool", key, v.type_name()));
  }
  return v.boolean;
}

std::string text(const PyValue& v, const std::string& where, std::string_view key) {
  if (!v.is(Kind::kStr)) {
    incompatible(where, fmt::format("'{}' is a {}, not a str", key, v.type_name()));
  }
  return v.text;
}

std::vector<double> numbers(const PyValue& v, const std::string& where, std::string_view key,
                            std::size_t groups) {
  if (!v.is(Kind::kList) && !v.is(Kind::kTuple)) {
    incompatible(where, fmt::format("'{}' is a {}, not a list", key, v.type_name()));
  }
  if (v.items.size() != groups) {
    incompatible(where, fmt::format("'{}' has {} values, one per param group, but the prepared "
                                    "optimizer has {} param groups: build the same param groups "
                                    "as the Python run",
                                    key, v.items.size(), groups));
  }
  std::vector<double> out;
  for (const PyValue& item : v.items) out.push_back(number(item, where, key));
  return out;
}

// Doubles as exact JSON, or as float64 tensors when not finite (as torchpoint's schedulers do).
void put_double(StateDict& s, const std::string& key, double value) {
  if (std::isfinite(value)) {
    s.set(key, Json(value));
  } else {
    s.set_double(key, value);
  }
}

void put_doubles(StateDict& s, const std::string& key, const std::vector<double>& values) {
  for (double v : values) {
    if (!std::isfinite(v)) {
      at::Tensor t = at::empty({static_cast<std::int64_t>(values.size())},
                               at::TensorOptions().dtype(at::kDouble));
      std::copy(values.begin(), values.end(), t.data_ptr<double>());
      s.set(key, std::move(t));
      return;
    }
  }
  s.set(key, Json(values));
}

// The values of `key` of torchpoint's state `s` (a JSON list or a float64 tensor).
std::vector<double> doubles_of(const StateDict& s, const std::string& key) {
  if (s.is_tensor(key)) {
    at::Tensor t = s.tensor(key).to(at::kDouble).contiguous();
    return {t.data_ptr<double>(), t.data_ptr<double>() + t.numel()};
  }
  return s.get<std::vector<double>>(key);
}

double double_of(const StateDict& s, const std::string& key) {
  return s.is_tensor(key) ? s.tensor(key).item<double>() : s.get<double>(key);
}

// The three or four values of OneCycleLR's phases, by the names Python gives them.
struct PhaseNames {
  const char *start_lr, *end_lr, *start_momentum, *end_momentum;
};
constexpr PhaseNames kTwoPhases[] = {{"initial_lr", "max_lr", "max_momentum", "base_momentum"},
                                     {"max_lr", "min_lr", "base_momentum", "max_momentum"}};
constexpr PhaseNames kThreePhases[] = {{"initial_lr", "max_lr", "max_momentum", "base_momentum"},
                                       {"max_lr", "initial_lr", "base_momentum", "max_momentum"},
                                       {"initial_lr", "min_lr", "max_momentum", "max_momentum"}};

// The pct_start whose phases end where Python's do: Python stores only the end steps
// (pct_start * total_steps - 1, and for three phases 2 * pct_start * total_steps - 2). The
// quotient is the value or next to it; each candidate is checked by the same arithmetic.
std::optional<double> pct_start_of(double end1, std::optional<double> end2, std::int64_t total) {
  const double t = static_cast<double>(total);
  const double guess = (end1 + 1) / t;
  auto fits = [&](double pct) {
    return pct >= 0 && pct <= 1 && pct * t - 1 == end1 && (!end2 || 2 * pct * t - 2 == *end2);
  };
  double up = guess, down = guess;
  for (int i = 0; i < 64; ++i) {
    if (fits(up)) return up;
    if (fits(down)) return down;
    up = std::nextafter(up, 2.0);
    down = std::nextafter(down, -1.0);
  }
  return std::nullopt;
}

StateDict one_cycle_from_python(const PyValue& saved, const StateDict& current,
                                const std::string& where, const PairedOptimizer& optimizer) {
  const std::string cls = "OneCycleLR";
  const std::size_t groups = doubles_of(current, "max_lr").size();
  const std::int64_t total = integer(need(saved, "total_steps", cls, where), where, "total_steps");
  if (total < 1) {
    incompatible(where, fmt::format("total_steps is {}; it must be at least 1", total));
  }
  const PyValue& phases = need(saved, "_schedule_phases", cls, where);
  const bool three = phases.items.size() == 3;
  if (!phases.is(Kind::kList) || (phases.items.size() != 2 && !three)) {
    incompatible(where, "'_schedule_phases' is not a list of two or three phases");
  }
  std::vector<double> ends;
  for (std::size_t i = 0; i < phases.items.size(); ++i) {
    const PyValue& phase = phases.items[i];
    const PhaseNames& want = three ? kThreePhases[i] : kTwoPhases[i];
    const std::string pw = fmt::format("{} '_schedule_phases'[{}]", where, i);
    if (!phase.is(Kind::kDict)) incompatible(pw, "it is not a dict");
    for (auto [key, name] : {std::pair{"start_lr", want.start_lr}, {"end_lr", want.end_lr},
                             {"start_momentum", want.start_momentum},
                             {"end_momentum", want.end_momentum}}) {
      const PyValue* v = phase.find(key);
      if (v == nullptr || !v->is(Kind::kStr) || v->text != name) {
        throw Error(ErrorCode::Unsupported,
                    fmt::format("{}: '{}' is not '{}': these phases are not the {}-phase cycle of "
                                "torch 2.x's OneCycleLR, which torchpoint::OneCycleLR computes",
                                pw, key, name, three ? "three" : "two"));
      }
    }
    ends.push_back(number(need(phase, "end_step", cls, pw), pw, "end_step"));
  }
  if (ends.back() != static_cast<double>(total - 1)) {
    incompatible(where, fmt::format("the last phase ends at step {}, not at total_steps - 1 = {}",
                                    ends.back(), total - 1));
  }
  std::optional<double> pct =
      pct_start_of(ends[0], three ? std::optional<double>(ends[1]) : std::nullopt, total);
  if (!pct) {
    throw Error(ErrorCode::Unsupported,
                fmt::format("{}: the phases end at steps {}, which no pct_start in [0, 1] gives "
                            "for total_steps {} (pct_start * total_steps - 1): torchpoint's "
                            "OneCycleLR computes its phases from pct_start",
                            where, fmt::join(ends, ", "), total));
  }
  const std::string anneal = text(need(saved, "_anneal_func_type", cls, where), where,
                                  "_anneal_func_type");
  if (anneal != "cos" && anneal != "linear") {
    incompatible(where, fmt::format("'_anneal_func_type' is '{}', not 'cos' or 'linear'", anneal));
  }
  const bool cycle = boolean(need(saved, "cycle_momentum", cls, where), where, "cycle_momentum");

  // torch 2.x keeps the cycle's learning rates and momenta in the optimizer's param groups.
  if (optimizer.path.empty()) {
    incompatible(where, "it is a OneCycleLR's state, whose learning rates and momenta torch 2.x "
                        "keeps in its optimizer's param groups, but no optimizer is prepared "
                        "beside it (a registered scheduler needs exactly one prepared "
                        "optimizer; scheduler_<i> goes with optimizer_<i>)");
  }
  const PyValue opt = optimizer.read();
  const PyValue* pg = opt.find("param_groups");
  if (pg == nullptr || !pg->is(Kind::kList) || pg->items.size() != groups) {
    incompatible(optimizer.path,
                 fmt::format("it has no list of {} param groups for the OneCycleLR of {}", groups,
                             where));
  }
  std::map<std::string, std::vector<double>> group_values;
  std::vector<const char*> keys = {"initial_lr", "max_lr", "min_lr"};
  if (cycle) {
    keys.push_back("max_momentum");
    keys.push_back("base_momentum");
  }
  for (std::size_t g = 0; g < groups; ++g) {
    const PyValue& group = pg->items[g];
    const std::string gw = fmt::format("{} param group {}", optimizer.path, g);
    for (const char* key : keys) {
      const PyValue* v = group.is(Kind::kDict) ? group.find(key) : nullptr;
      if (v == nullptr) {
        incompatible(gw, fmt::format(
                             "it has no '{}', where torch 2.x's OneCycleLR (whose state is {}) "
                             "keeps its group's {}: the optimizer's state_dict() was saved "
                             "without the scheduler's values (before the OneCycleLR was built, "
                             "or by a writer that drops them)",
                             key, where,
                             std::string_view(key) == "initial_lr" ? "starting learning rate"
                             : std::string_view(key) == "max_lr"   ? "peak learning rate"
                             : std::string_view(key) == "min_lr"   ? "final learning rate"
                                                                   : std::string(key) + " bound"));
      }
      group_values[key].push_back(number(*v, gw, key));
    }
  }
  if (cycle) {
    const bool beta1 = boolean(need(saved, "use_beta1", cls, where), where, "use_beta1");
    const bool has_betas = pg->items[0].find("betas") != nullptr;
    if (beta1 != has_betas) {
      incompatible(where, fmt::format("use_beta1 is {}, but the optimizer of {} {} betas",
                                      beta1 ? "True" : "False", optimizer.path,
                                      has_betas ? "has" : "has no"));
    }
  }

  StateDict out;
  out.set("type", "OneCycleLR");
  out.set("last_epoch", integer(need(saved, "last_epoch", cls, where), where, "last_epoch"));
  out.set("step_count", integer(need(saved, "_step_count", cls, where), where, "_step_count"));
  // Python's arithmetic starts from the groups' initial_lr (equal to base_lrs).
  put_doubles(out, "base_lrs", group_values["initial_lr"]);
  put_doubles(out, "last_lrs",
              numbers(need(saved, "_last_lr", cls, where), where, "_last_lr", groups));
  put_doubles(out, "max_lr", group_values["max_lr"]);
  out.set("total_steps", total);
  put_double(out, "pct_start", *pct);
  out.set("anneal_strategy", anneal);
  out.set("cycle_momentum", cycle);
  put_doubles(out, "base_momentum",
              cycle ? group_values["base_momentum"] : doubles_of(current, "base_momentum"));
  put_doubles(out, "max_momentum",
              cycle ? group_values["max_momentum"] : doubles_of(current, "max_momentum"));
  put_double(out, "div_factor", group_values["max_lr"][0] / group_values["initial_lr"][0]);
  put_double(out, "final_div_factor", group_values["initial_lr"][0] / group_values["min_lr"][0]);
  out.set("three_phase", three);
  put_doubles(out, "min_lrs", group_values["min_lr"]);
  return out;
}

StateDict plateau_from_python(const PyValue& saved, const StateDict& current,
                              const std::string& where) {
  const std::string cls = "ReduceLROnPlateau";
  const std::size_t groups = doubles_of(current, "min_lr").size();
  auto num = [&](const char* key) { return number(need(saved, key, cls, where), where, key); };
  auto count = [&](const char* key) { return integer(need(saved, key, cls, where), where, key); };
  auto word = [&](const char* key) { return text(need(saved, key, cls, where), where, key); };
  StateDict out;
  out.set("type", "ReduceLROnPlateau");
  const std::int64_t last_epoch = count("last_epoch");
  out.set("last_epoch", last_epoch);
  // Python's ReduceLROnPlateau makes no initial step, so its steps are its last_epoch.
  out.set("step_count", last_epoch);
  put_doubles(out, "base_lrs", doubles_of(current, "base_lrs"));
  put_doubles(out, "last_lrs",
              numbers(need(saved, "_last_lr", cls, where), where, "_last_lr", groups));
  out.set("mode", word("mode"));
  put_double(out, "factor", num("factor"));
  out.set("patience", count("patience"));
  put_double(out, "threshold", num("threshold"));
  out.set("threshold_mode", word("threshold_mode"));
  out.set("cooldown", count("cooldown"));
  // Python widens min_lrs to a new number of param groups only from one default value.
  const PyValue& min_lrs = need(saved, "min_lrs", cls, where);
  const PyValue* fallback = saved.find("default_min_lr");
  if (min_lrs.is(Kind::kList) && min_lrs.items.size() != groups && fallback != nullptr &&
      !fallback->is(Kind::kNone)) {
    put_doubles(out, "min_lr",
                std::vector<double>(groups, number(*fallback, where, "default_min_lr")));
  } else {
    put_doubles(out, "min_lr", numbers(min_lrs, where, "min_lrs", groups));
  }
  put_double(out, "eps", num("eps"));
  out.set_double("best", num("best"));
  out.set("num_bad_epochs", count("num_bad_epochs"));
  out.set("cooldown_counter", count("cooldown_counter"));
  return out;
}

// StepLR, MultiStepLR, ExponentialLR, CosineAnnealingLR and LinearLR: torchpoint's keys are
// Python's, but for the step count and the last learning rates.
StateDict same_names_from_python(const PyValue& saved, const StateDict& current,
                                 const std::string& where, const std::string& cls) {
  static const std::map<std::string, std::string> kPythonName = {
      {"step_count", "_step_count"}, {"last_lrs", "_last_lr"}};
  StateDict out;
  for (const auto& [key, now] : current.entries()) {
    if (key == "type") {
      out.set(key, cls);
      continue;
    }
    auto renamed = kPythonName.find(key);
    const std::string python = renamed == kPythonName.end() ? key : renamed->second;
    const PyValue& v = need(saved, python, cls, where);
    if (std::holds_alternative<at::Tensor>(now)) {
      const at::Tensor& t = std::get<at::Tensor>(now);
      if (t.dim() == 1) {
        put_doubles(out, key, numbers(v, where, python, static_cast<std::size_t>(t.numel())));
      } else {
        out.set_double(key, number(v, where, python));
      }
    } else if (v.is(Kind::kDict) && v.type == "Counter") {
      // MultiStepLR's milestones: a Counter of milestone -> times.
      std::vector<std::int64_t> milestones;
      for (const auto& [m, times] : v.entries) {
        if (!m.is(Kind::kInt) || !times.is(Kind::kInt)) incompatible(where, "bad milestones");
        for (std::int64_t t = 0; t < times.integer && t < 1000000; ++t) {
          milestones.push_back(m.integer);
        }
      }
      std::sort(milestones.begin(), milestones.end());
      out.set(key, Json(milestones));
    } else {
      out.set(key, to_json(v, fmt::format("{} '{}'", where, python)));
    }
  }
  return out;
}

// LibTorch's StepLR as Python's: the count is last_epoch + 1 (see the table above); the learning
// rates are the optimizer's.
PythonScheduler libtorch_step_lr_to_python(const StateDict& sd, const std::string& where,
                                           const StateDict* optimizer) {
  if (!sd.contains("step_size") || !sd.contains("gamma")) {
    throw Error(ErrorCode::Unsupported,
                fmt::format("{}: this torch::optim::StepLR state has no step_size and gamma "
                            "(saved before torchpoint recorded them), which Python's StepLR "
                            "needs: save the run again with this version",
                            where));
  }
  if (optimizer == nullptr) {
    throw Error(ErrorCode::Unsupported,
                fmt::format("{}: a torch::optim::StepLR keeps no learning rates; they are its "
                            "optimizer's, and no optimizer goes with it in this checkpoint "
                            "(scheduler_<i> goes with optimizer_<i>; a registered scheduler with "
                            "the only optimizer)",
                            where));
  }
  std::vector<PyValue> lrs;
  for (std::int64_t g = 0; g < optimizer->get<std::int64_t>("param_groups.count"); ++g) {
    lrs.push_back(PyValue::of(optimizer->get<double>(fmt::format("param_groups.{}.lr", g))));
  }
  const auto count = static_cast<std::int64_t>(sd.get<std::uint64_t>("step_count"));
  PythonScheduler py;
  py.state = PyValue::dict();
  const auto step_size = static_cast<std::int64_t>(sd.get<std::uint64_t>("step_size"));
  py.state.set("step_size", PyValue::of(step_size));
  py.state.set("gamma", PyValue::of(sd.get<double>("gamma")));
  py.state.set("base_lrs", PyValue::list(lrs));
  py.state.set("last_epoch", PyValue::of(count - 1));
  py.state.set("_step_count", PyValue::of(count));
  py.state.set("_is_initial", PyValue::of(false));
  py.state.set("_get_lr_called_within_step", PyValue::of(false));
  py.state.set("_last_lr", PyValue::list(lrs));
  py.group_keys.resize(lrs.size());
  for (std::size_t g = 0; g < lrs.size(); ++g) py.group_keys[g].push_back({"initial_lr", lrs[g]});
  py.notes.push_back(fmt::format(
      "{}: LibTorch's StepLR does not record the learning rates it started from: Python's "
      "base_lrs (and the param groups' initial_lr) are the current ones (Python's StepLR steps "
      "from the param groups' lr and reads base_lrs only in the deprecated step(epoch))",
      where));
  return py;
}

const char* libtorch_or_torchpoint(const std::string& type) {
  return type.starts_with("torch::") ? "" : "torchpoint::";
}

}  // namespace

std::string paired_optimizer_name(std::string_view scheduler,
                                  const std::vector<std::string>& optimizers) {
  if (scheduler.starts_with("scheduler")) {
    const std::string name =
        "optimizer" + std::string(scheduler.substr(std::string_view("scheduler").size()));
    return std::find(optimizers.begin(), optimizers.end(), name) != optimizers.end() ? name : "";
  }
  return optimizers.size() == 1 ? optimizers[0] : "";
}

StateDict scheduler_from_python(const PyValue& saved, const StateDict& current,
                                const std::string& where, const PairedOptimizer& optimizer) {
  if (!saved.is(Kind::kDict)) {
    incompatible(where, fmt::format("it holds a {}, not a scheduler's state_dict()",
                                    saved.type_name()));
  }
  const std::string type = current.get<std::string>("type");
  const std::string cls = type == "torch::optim::StepLR" ? "StepLR" : type;
  const std::string found = python_scheduler_class(saved);
  if (!found.empty() && found != cls) {
    incompatible(where, fmt::format("it holds the state of Python's "
                                    "torch.optim.lr_scheduler.{}, but the scheduler prepared "
                                    "here is a {}{}: prepare the same class as the Python run",
                                    found, libtorch_or_torchpoint(type), type));
  }
  StateDict out;
  if (type == "torch::optim::StepLR") {
    const std::int64_t last = integer(need(saved, "last_epoch", cls, where), where, "last_epoch");
    if (last < -1) incompatible(where, fmt::format("last_epoch is {}", last));
    if (current.contains("step_size")) {
      const std::int64_t step_size =
          integer(need(saved, "step_size", cls, where), where, "step_size");
      const double gamma = number(need(saved, "gamma", cls, where), where, "gamma");
      if (step_size != static_cast<std::int64_t>(current.get<std::uint64_t>("step_size")) ||
          gamma != current.get<double>("gamma")) {
        incompatible(where, fmt::format("Python's StepLR has step_size {}, gamma {}, but the "
                                        "prepared torch::optim::StepLR has step_size {}, gamma "
                                        "{}, which LibTorch cannot change: build it with "
                                        "Python's options",
                                        step_size, gamma, current.get<std::uint64_t>("step_size"),
                                        current.get<double>("gamma")));
      }
    }
    // LibTorch's StepLR decays when its count before a step is a multiple of step_size, Python's
    // when last_epoch after the step is: LibTorch's count is Python's last_epoch + 1.
    out.set("type", type);
    out.set("step_count", static_cast<std::uint64_t>(last) + 1);
  } else if (type == "OneCycleLR") {
    out = one_cycle_from_python(saved, current, where, optimizer);
  } else if (type == "ReduceLROnPlateau") {
    out = plateau_from_python(saved, current, where);
  } else {
    out = same_names_from_python(saved, current, where, cls);
  }
  out.set_description(where);
  return out;
}

PythonScheduler scheduler_to_python(const StateDict& sd, const std::string& where,
                                    const StateDict* optimizer) {
  const std::string type = sd.get<std::string>("type");
  const std::string optimizer_type = optimizer ? optimizer->get<std::string>("type") : "";
  if (type == "torch::optim::StepLR") return libtorch_step_lr_to_python(sd, where, optimizer);
  PythonScheduler py;
  PyValue& out = py.state;
  out = PyValue::dict();
  const std::vector<double> base_lrs = doubles_of(sd, "base_lrs");
  const std::vector<double> last_lrs = doubles_of(sd, "last_lrs");
  auto floats = [](const std::vector<double>& values) {
    std::vector<PyValue> items;
    for (double v : values) items.push_back(PyValue::of(v));
    return PyValue::list(std::move(items));
  };
  auto common = [&](bool with_step_count) {
    out.set("last_epoch", PyValue::of(sd.get<std::int64_t>("last_epoch")));
    if (with_step_count) out.set("_step_count", PyValue::of(sd.get<std::int64_t>("step_count")));
    out.set("_last_lr", floats(last_lrs));
  };
  py.group_keys.resize(base_lrs.size());
  if (type == "ReduceLROnPlateau") {
    // Python's keys, in its order; no _step_count, no base_lrs, and no initial_lr in the groups.
    const std::vector<double> min_lr = doubles_of(sd, "min_lr");
    const bool one_floor =
        std::all_of(min_lr.begin(), min_lr.end(), [&](double v) { return v == min_lr[0]; });
    const std::string mode = sd.get<std::string>("mode");
    out.set("factor", PyValue::of(double_of(sd, "factor")));
    out.set("default_min_lr",
            one_floor && !min_lr.empty() ? PyValue::of(min_lr[0]) : PyValue::none());
    out.set("min_lrs", floats(min_lr));
    out.set("patience", PyValue::of(sd.get<std::int64_t>("patience")));
    out.set("cooldown", PyValue::of(sd.get<std::int64_t>("cooldown")));
    out.set("eps", PyValue::of(double_of(sd, "eps")));
    common(false);
    out.set("mode_worse", PyValue::of(mode == "min" ? std::numeric_limits<double>::infinity()
                                                    : -std::numeric_limits<double>::infinity()));
    out.set("mode", PyValue::of(mode));
    out.set("threshold", PyValue::of(double_of(sd, "threshold")));
    out.set("threshold_mode", PyValue::of(sd.get<std::string>("threshold_mode")));
    out.set("best", PyValue::of(sd.get_double("best")));
    out.set("cooldown_counter", PyValue::of(sd.get<std::int64_t>("cooldown_counter")));
    out.set("num_bad_epochs", PyValue::of(sd.get<std::int64_t>("num_bad_epochs")));
    return py;
  }
  for (std::size_t g = 0; g < base_lrs.size(); ++g) {
    py.group_keys[g].push_back({"initial_lr", PyValue::of(base_lrs[g])});
  }
  if (type == "OneCycleLR") {
    const std::int64_t total = sd.get<std::int64_t>("total_steps");
    const double pct = double_of(sd, "pct_start");
    const bool three = sd.get<bool>("three_phase");
    const bool cycle = sd.get<bool>("cycle_momentum");
    // Python's end steps: float(pct_start * total_steps) - 1, ..., and the int total_steps - 1.
    const double t = static_cast<double>(total);
    std::vector<PyValue> ends = {PyValue::of(pct * t - 1)};
    if (three) ends.push_back(PyValue::of(2 * pct * t - 2));
    ends.push_back(PyValue::of(total - 1));
    std::vector<PyValue> phases;
    for (std::size_t i = 0; i < ends.size(); ++i) {
      const PhaseNames& n = three ? kThreePhases[i] : kTwoPhases[i];
      PyValue phase = PyValue::dict();
      phase.set("end_step", ends[i]);
      phase.set("start_lr", PyValue::of(std::string(n.start_lr)));
      phase.set("end_lr", PyValue::of(std::string(n.end_lr)));
      phase.set("start_momentum", PyValue::of(std::string(n.start_momentum)));
      phase.set("end_momentum", PyValue::of(std::string(n.end_momentum)));
      phases.push_back(std::move(phase));
    }
    out.set("total_steps", PyValue::of(total));
    out.set("_schedule_phases", PyValue::list(std::move(phases)));
    out.set("_anneal_func_type", PyValue::of(sd.get<std::string>("anneal_strategy")));
    out.set("cycle_momentum", PyValue::of(cycle));
    if (cycle) {
      if (optimizer_type.empty()) {
        incompatible(where, "a OneCycleLR that cycles the momentum, but no optimizer goes with "
                            "it in this checkpoint (scheduler_<i> goes with optimizer_<i>; a "
                            "registered scheduler with the only optimizer): Python needs to "
                            "know whether it cycles beta1");
      }
      out.set("use_beta1", PyValue::of(optimizer_type == "Adam" || optimizer_type == "AdamW"));
    }
    out.set("base_lrs", floats(base_lrs));
    common(true);
    const std::vector<double> max_lr = doubles_of(sd, "max_lr");
    const std::vector<double> min_lrs = doubles_of(sd, "min_lrs");
    const std::vector<double> max_m = doubles_of(sd, "max_momentum");
    const std::vector<double> base_m = doubles_of(sd, "base_momentum");
    for (std::size_t g = 0; g < base_lrs.size(); ++g) {
      py.group_keys[g].push_back({"max_lr", PyValue::of(max_lr.at(g))});
      py.group_keys[g].push_back({"min_lr", PyValue::of(min_lrs.at(g))});
      if (cycle) {
        py.group_keys[g].push_back({"max_momentum", PyValue::of(max_m.at(g))});
        py.group_keys[g].push_back({"base_momentum", PyValue::of(base_m.at(g))});
      }
    }
  } else {
    for (const auto& [key, value] : sd.entries()) {
      if (key == "type") continue;
      const std::string python = key == "step_count" ? "_step_count"
                                 : key == "last_lrs" ? "_last_lr"
                                                     : key;
      PyValue v = entry_value(value);
      if (v.is(Kind::kTensor) && v.tensor.scalar_type() == at::kDouble) {
        v = v.tensor.dim() == 0 ? PyValue::of(v.tensor.item<double>())
                                : floats(doubles_of(sd, key));  // non-finite floats
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
  }
  out.set("_is_initial", PyValue::of(false));
  out.set("_get_lr_called_within_step", PyValue::of(false));
  return py;
}

}  // namespace torchpoint::detail
