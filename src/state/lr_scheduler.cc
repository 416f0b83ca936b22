#include "torchpoint/lr_scheduler.h"

#include <ATen/ops/empty.h>
#include <fmt/format.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numbers>
#include <tuple>

#include "torchpoint/error.h"

// The arithmetic below follows PyTorch 1.13's torch/optim/lr_scheduler.py operation by
// operation, in the same order, with the same libm calls, so that the doubles are identical:
// reorder nothing (a * b / c is not a * (b / c)). This relies on -ffp-contract=off, the default
// of GCC and Clang in ISO C++ mode (-std=c++20, not gnu++20).

namespace torchpoint {
namespace {

constexpr double kPi = std::numbers::pi;  // == Python's math.pi

[[noreturn]] void invalid(const std::string& message) {
  throw Error(ErrorCode::InvalidArgument, message);
}

// Doubles go to JSON when finite (exact there) and to a float64 tensor otherwise.
void put_double(StateDict& state, const std::string& key, double value) {
  if (std::isfinite(value)) {
    state.set(key, Json(value));
  } else {
    state.set_double(key, value);
  }
}

double take_double(const StateDict& state, const std::string& key) {
  return state.is_tensor(key) ? state.get_double(key) : state.get<double>(key);
}

void put_doubles(StateDict& state, const std::string& key, const std::vector<double>& values) {
  if (std::all_of(values.begin(), values.end(), [](double v) { return std::isfinite(v); })) {
    state.set(key, Json(values));
    return;
  }
  at::Tensor t =
      at::empty({static_cast<std::int64_t>(values.size())}, at::TensorOptions().dtype(at::kDouble));
  std::copy(values.begin(), values.end(), t.data_ptr<double>());
  state.set(key, std::move(t));
}

// One value per param group.
std::vector<double> take_doubles(const StateDict& state, const std::string& key,
                                 std::size_t num_groups, const char* type) {
  std::vector<double> out;
  if (state.is_tensor(key)) {
    at::Tensor t = state.tensor(key);
    if (t.dim() != 1 || t.scalar_type() != at::kDouble) {
      throw Error(ErrorCode::Incompatible,
                  fmt::format("{}: '{}' should be a list of float64 values, found a {} tensor of "
                              "shape [{}]",
                              state.description(), key, c10::toString(t.scalar_type()),
                              fmt::join(t.sizes(), ", ")));
    }
    t = t.to(at::kCPU).contiguous();
    out.assign(t.data_ptr<double>(), t.data_ptr<double>() + t.numel());
  } else {
    out = state.get<std::vector<double>>(key);
  }
  if (out.size() != num_groups) {
    throw Error(ErrorCode::Incompatible,
                fmt::format("{}: the saved {} is for {} param groups ('{}' has {} values), but "
                            "this optimizer has {}: build the optimizer with the same param "
                            "groups as the saved run",
                            state.description(), type, out.size(), key, out.size(), num_groups));
  }
  return out;
}

// One value for every group, or one per group.
std::vector<double> per_group(std::vector<double> values, std::size_t num_groups,
                              const char* scheduler, const char* name) {
  if (values.size() == 1) return std::vector<double>(num_groups, values[0]);
  if (values.size() != num_groups) {
    invalid(
        fmt::format("{}: {} has {} values, but the optimizer has {} param groups: give one "
                    "value, or one per param group",
                    scheduler, name, values.size(), num_groups));
  }
  return values;
}

template <typename Enum>
struct EnumNames {
  Enum value;
  const char* name;
};

template <typename Enum, std::size_t N>
const char* enum_name(const EnumNames<Enum> (&names)[N], Enum value) {
  for (const auto& n : names) {
    if (n.value == value) return n.name;
  }
  return "?";
}

template <typename Enum, std::size_t N>
Enum parse_enum(const EnumNames<Enum> (&names)[N], const StateDict& state, const std::string& key) {
  std::string text = state.get<std::string>(key);
  for (const auto& n : names) {
    if (text == n.name) return n.value;
  }
  throw Error(ErrorCode::Incompatible,
              fmt::format("{}: '{}' is \"{}\", which is not one of the values this version knows",
                          state.description(), key, text));
}

constexpr EnumNames<AnnealStrategy> kAnnealNames[] = {{AnnealStrategy::kCos, "cos"},
                                                      {AnnealStrategy::kLinear, "linear"}};
constexpr EnumNames<PlateauMode> kModeNames[] = {{PlateauMode::kMin, "min"},
                                                 {PlateauMode::kMax, "max"}};
constexpr EnumNames<ThresholdMode> kThresholdNames[] = {{ThresholdMode::kRel, "rel"},
                                                        {ThresholdMode::kAbs, "abs"}};

// Where OneCycleLR cycles the momentum: PyTorch cycles group['momentum'] when the optimizer's
// defaults have it (SGD, RMSprop) and beta1 when they have betas (Adam, AdamW).
double* momentum_slot(torch::optim::OptimizerOptions& options) {
  namespace optim = torch::optim;
  if (auto* sgd = dynamic_cast<optim::SGDOptions*>(&options)) return &sgd->momentum();
  if (auto* rms = dynamic_cast<optim::RMSpropOptions*>(&options)) return &rms->momentum();
  if (auto* adam = dynamic_cast<optim::AdamOptions*>(&options)) {
    return &std::get<0>(adam->betas());
  }
  if (auto* adamw = dynamic_cast<optim::AdamWOptions*>(&options)) {
    return &std::get<0>(adamw->betas());
  }
  return nullptr;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// LRScheduler

LRScheduler::LRScheduler(torch::optim::Optimizer& optimizer, std::int64_t last_epoch,
                         std::vector<double> base_lrs)
    : optimizer_(optimizer), base_lrs_(std::move(base_lrs)), last_epoch_(last_epoch) {
  if (base_lrs_.empty()) base_lrs_ = current_lrs();
  last_lrs_ = current_lrs();
}

std::vector<double> LRScheduler::current_lrs() const {
  std::vector<double> lrs;
  lrs.reserve(optimizer_.param_groups().size());
  for (const auto& group : optimizer_.param_groups()) lrs.push_back(group.options().get_lr());
  return lrs;
}

void LRScheduler::take_step(const std::vector<double>& lrs) {
  ++last_epoch_;
  ++step_count_;
  auto& groups = optimizer_.param_groups();
  for (std::size_t i = 0; i < groups.size(); ++i) groups[i].options().set_lr(lrs[i]);
  record_last_lrs();
}

StateDict LRScheduler::state_dict() const {
  StateDict state;
  state.set("type", type_name());
  state.set("last_epoch", last_epoch_);
  state.set("step_count", step_count_);
  put_doubles(state, "base_lrs", base_lrs_);
  put_doubles(state, "last_lrs", last_lrs_);
  save_own_state(state);
  return state;
}

void LRScheduler::load_state_dict(const StateDict& state) {
  std::string type = state.get<std::string>("type");
  if (type != type_name()) {
    throw Error(ErrorCode::Incompatible,
                fmt::format("{}: the saved scheduler is a {}, but this one is a {}: build the "
                            "same scheduler type as the saved run",
                            state.description(), type, type_name()));
  }
  const std::size_t groups = optimizer_.param_groups().size();
  std::vector<double> base_lrs = take_doubles(state, "base_lrs", groups, type_name());
  std::vector<double> last_lrs = take_doubles(state, "last_lrs", groups, type_name());
  auto last_epoch = state.get<std::int64_t>("last_epoch");
  auto step_count = state.get<std::int64_t>("step_count");
  // The subclass takes its part only when all of it checked out; ours cannot fail after it.
  load_own_state(state, groups);
  base_lrs_ = std::move(base_lrs);
  last_lrs_ = std::move(last_lrs);
  last_epoch_ = last_epoch;
  step_count_ = step_count;
}

// ---------------------------------------------------------------------------------------------
// StepLR

StepLR::StepLR(torch::optim::Optimizer& optimizer, StepLROptions options)
    : LRScheduler(optimizer), options_(std::move(options)) {
  if (options_.step_size() < 1) {
    invalid(fmt::format("StepLR: step_size is {}; it must be at least 1", options_.step_size()));
  }
  step();  // PyTorch's _initial_step
}

void StepLR::step() {
  const std::int64_t epoch = last_epoch() + 1;
  std::vector<double> lrs = current_lrs();
  if (epoch != 0 && epoch % options_.step_size() == 0) {
    for (double& lr : lrs) lr = lr * options_.gamma();
  }
  take_step(lrs);
}

void StepLR::save_own_state(StateDict& state) const {
  state.set("step_size", options_.step_size());
  put_double(state, "gamma", options_.gamma());
}

void StepLR::load_own_state(const StateDict& state, std::size_t) {
  StepLROptions options(state.get<std::int64_t>("step_size"));
  options.gamma(take_double(state, "gamma"));
  if (options.step_size() < 1) {
    throw Error(ErrorCode::Incompatible, fmt::format("{}: step_size is {}; it must be at least 1",
                                                     state.description(), options.step_size()));
  }
  options_ = std::move(options);
}

// ---------------------------------------------------------------------------------------------
// MultiStepLR

MultiStepLR::MultiStepLR(torch::optim::Optimizer& optimizer, MultiStepLROptions options)
    : LRScheduler(optimizer), options_(std::move(options)) {
  step();  // PyTorch's _initial_step
}

void MultiStepLR::step() {
  const std::int64_t epoch = last_epoch() + 1;
  const auto& milestones = options_.milestones();
  const auto hits = std::count(milestones.begin(), milestones.end(), epoch);
  std::vector<double> lrs = current_lrs();
  if (hits > 0) {
    const double factor = std::pow(options_.gamma(), static_cast<double>(hits));
    for (double& lr : lrs) lr = lr * factor;
  }
  take_step(lrs);
}

void MultiStepLR::save_own_state(StateDict& state) const {
  state.set("milestones", options_.milestones());
  put_double(state, "gamma", options_.gamma());
}

void MultiStepLR::load_own_state(const StateDict& state, std::size_t) {
  MultiStepLROptions options(state.get<std::vector<std::int64_t>>("milestones"));
  options.gamma(take_double(state, "gamma"));
  options_ = std::move(options);
}

// ---------------------------------------------------------------------------------------------
// ExponentialLR

ExponentialLR::ExponentialLR(torch::optim::Optimizer& optimizer, ExponentialLROptions options)
    : LRScheduler(optimizer), options_(std::move(options)) {
  step();  // PyTorch's _initial_step
}

void ExponentialLR::step() {
  std::vector<double> lrs = current_lrs();
  if (last_epoch() + 1 != 0) {
    for (double& lr : lrs) lr = lr * options_.gamma();
  }
  take_step(lrs);
}

void ExponentialLR::save_own_state(StateDict& state) const {
  put_double(state, "gamma", options_.gamma());
}

void ExponentialLR::load_own_state(const StateDict& state, std::size_t) {
  options_ = ExponentialLROptions(take_double(state, "gamma"));
}

// ---------------------------------------------------------------------------------------------
// CosineAnnealingLR

CosineAnnealingLR::CosineAnnealingLR(torch::optim::Optimizer& optimizer,
                                     CosineAnnealingLROptions options)
    : LRScheduler(optimizer), options_(std::move(options)) {
  if (options_.T_max() < 1) {
    invalid(fmt::format("CosineAnnealingLR: T_max is {}; it must be at least 1", options_.T_max()));
  }
  step();  // PyTorch's _initial_step
}

void CosineAnnealingLR::step() {
  // PyTorch's third case (_step_count == 1 and last_epoch > 0) needs a scheduler constructed
  // with last_epoch > 0, which this API does not offer: resuming goes through load_state_dict.
  const std::int64_t epoch = last_epoch() + 1;
  const double t_max = static_cast<double>(options_.T_max());
  const double eta_min = options_.eta_min();
  std::vector<double> lrs = current_lrs();
  if (epoch == 0) {
    // unchanged
  } else if ((epoch - 1 - options_.T_max()) % (2 * options_.T_max()) == 0) {
    // Python's % floors and C++'s truncates, but both are 0 for the same operands.
    for (std::size_t i = 0; i < lrs.size(); ++i) {
      lrs[i] = lrs[i] + (base_lrs()[i] - eta_min) * (1 - std::cos(kPi / t_max)) / 2;
    }
  } else {
    const double e = static_cast<double>(epoch);
    for (double& lr : lrs) {
      lr =
          (1 + std::cos(kPi * e / t_max)) / (1 + std::cos(kPi * (e - 1) / t_max)) * (lr - eta_min) +
          eta_min;
    }
  }
  take_step(lrs);
}

void CosineAnnealingLR::save_own_state(StateDict& state) const {
  state.set("T_max", options_.T_max());
  put_double(state, "eta_min", options_.eta_min());
}

void CosineAnnealingLR::load_own_state(const StateDict& state, std::size_t) {
  CosineAnnealingLROptions options(state.get<std::int64_t>("T_max"));
  options.eta_min(take_double(state, "eta_min"));
  if (options.T_max() < 1) {
    throw Error(ErrorCode::Incompatible, fmt::format("{}: T_max is {}; it must be at least 1",
                                                     state.description(), options.T_max()));
  }
  options_ = std::move(options);
}

// ---------------------------------------------------------------------------------------------
// LinearLR

namespace {
void check_linear(const LinearLROptions& o, ErrorCode code, const std::string& where) {
  if (!(o.start_factor() > 0 && o.start_factor() <= 1)) {
    throw Error(
        code, fmt::format("{}: start_factor is {}; it must be in (0, 1]", where, o.start_factor()));
  }
  if (!(o.end_factor() >= 0 && o.end_factor() <= 1)) {
    throw Error(code,
                fmt::format("{}: end_factor is {}; it must be in [0, 1]", where, o.end_factor()));
  }
}
}  // namespace

LinearLR::LinearLR(torch::optim::Optimizer& optimizer, LinearLROptions options)
    : LRScheduler(optimizer), options_(std::move(options)) {
  check_linear(options_, ErrorCode::InvalidArgument, "LinearLR");
  step();  // PyTorch's _initial_step
}

void LinearLR::step() {
  const std::int64_t epoch = last_epoch() + 1;
  const double start = options_.start_factor();
  const double end = options_.end_factor();
  std::vector<double> lrs = current_lrs();
  if (epoch == 0) {
    for (double& lr : lrs) lr = lr * start;
  } else if (epoch <= options_.total_iters()) {
    const double factor =
        1. + (end - start) / (static_cast<double>(options_.total_iters()) * start +
                              static_cast<double>(epoch - 1) * (end - start));
    for (double& lr : lrs) lr = lr * factor;
  }
  take_step(lrs);
}

void LinearLR::save_own_state(StateDict& state) const {
  put_double(state, "start_factor", options_.start_factor());
  put_double(state, "end_factor", options_.end_factor());
  state.set("total_iters", options_.total_iters());
}

void LinearLR::load_own_state(const StateDict& state, std::size_t) {
  LinearLROptions options;
  options.start_factor(take_double(state, "start_factor"));
  options.end_factor(take_double(state, "end_factor"));
  options.total_iters(state.get<std::int64_t>("total_iters"));
  check_linear(options, ErrorCode::Incompatible, state.description());
  options_ = std::move(options);
}

// ---------------------------------------------------------------------------------------------
// OneCycleLR

namespace {

std::vector<double> one_cycle_initial_lrs(const torch::optim::Optimizer& optimizer,
                                          const OneCycleLROptions& options) {
  std::vector<double> max_lrs =
      per_group(options.max_lr(), optimizer.param_groups().size(), "OneCycleLR", "max_lr");
  for (double& lr : max_lrs) lr = lr / options.div_factor();
  return max_lrs;
}

void check_one_cycle(const OneCycleLROptions& o, ErrorCode code, const std::string& where) {
  if (o.total_steps() < 1) {
    throw Error(
        code, fmt::format("{}: total_steps is {}; it must be at least 1", where, o.total_steps()));
  }
  if (!(o.pct_start() >= 0 && o.pct_start() <= 1)) {
    throw Error(code,
                fmt::format("{}: pct_start is {}; it must be in [0, 1]", where, o.pct_start()));
  }
}

double anneal(AnnealStrategy strategy, double start, double end, double pct) {
  if (strategy == AnnealStrategy::kCos) {
    const double cos_out = std::cos(kPi * pct) + 1;
    return end + (start - end) / 2.0 * cos_out;
  }
  return (end - start) * pct + start;
}

}  // namespace

OneCycleLR::OneCycleLR(torch::optim::Optimizer& optimizer, OneCycleLROptions options)
    : LRScheduler(optimizer, -1, one_cycle_initial_lrs(optimizer, options)),
      options_(std::move(options)) {
  const std::size_t groups = optimizer.param_groups().size();
  check_one_cycle(options_, ErrorCode::InvalidArgument, "OneCycleLR");
  options_.max_lr(per_group(options_.max_lr(), groups, "OneCycleLR", "max_lr"));
  options_.base_momentum(
      per_group(options_.base_momentum(), groups, "OneCycleLR", "base_momentum"));
  options_.max_momentum(per_group(options_.max_momentum(), groups, "OneCycleLR", "max_momentum"));
  if (options_.cycle_momentum()) {
    for (auto& group : optimizer.param_groups()) {
      if (momentum_slot(group.options()) == nullptr) {
        invalid(
            "OneCycleLR: cycle_momentum needs an optimizer with momentum (SGD, RMSprop) or betas "
            "(Adam, AdamW), and this one has neither: pass cycle_momentum(false)");
      }
    }
  }
  for (double lr : base_lrs()) min_lrs_.push_back(lr / options_.final_div_factor());
  // PyTorch first sets each group's momentum to max_momentum; the initial step below
  // overwrites it, so that write is skipped.
  step();  // PyTorch's _initial_step
}

std::vector<OneCycleLR::Phase> OneCycleLR::phases() const {
  // Indices: lr 0 = initial, 1 = max, 2 = min; momentum 0 = max, 1 = base.
  const double pct = options_.pct_start();
  const double total = static_cast<double>(options_.total_steps());
  const double last = static_cast<double>(options_.total_steps() - 1);
  if (options_.three_phase()) {
    return {{pct * total - 1, 0, 1, 0, 1}, {2 * pct * total - 2, 1, 0, 1, 0}, {last, 0, 2, 0, 0}};
  }
  return {{pct * total - 1, 0, 1, 0, 1}, {last, 1, 2, 1, 0}};
}

std::pair<double, double> OneCycleLR::at(std::size_t group, std::int64_t step_num) const {
  const double lr_values[] = {base_lrs()[group], options_.max_lr()[group], min_lrs_[group]};
  const std::vector<Phase> all = phases();
  const double step = static_cast<double>(step_num);
  double start_step = 0;
  for (std::size_t i = 0; i < all.size(); ++i) {
    const Phase& phase = all[i];
    if (step <= phase.end_step || i + 1 == all.size()) {
      const double span = phase.end_step - start_step;
      if (span == 0) {
        // PyTorch raises ZeroDivisionError here.
        invalid(
            fmt::format("OneCycleLR: phase {} of the cycle has no steps (total_steps {}, "
                        "pct_start {}): use more total_steps or another pct_start",
                        i + 1, options_.total_steps(), options_.pct_start()));
      }
      const double pct = (step - start_step) / span;
      const double lr = anneal(options_.anneal_strategy(), lr_values[phase.start_lr],
                               lr_values[phase.end_lr], pct);
      double momentum = 0;
      if (options_.cycle_momentum()) {
        const double m_values[] = {options_.max_momentum()[group], options_.base_momentum()[group]};
        momentum = anneal(options_.anneal_strategy(), m_values[phase.start_momentum],
                          m_values[phase.end_momentum], pct);
      }
      return {lr, momentum};
    }
    start_step = phase.end_step;
  }
  return {0, 0};  // not reached: the last phase always matches
}

void OneCycleLR::step() {
  const std::int64_t step_num = last_epoch() + 1;
  if (step_num > options_.total_steps()) {
    invalid(
        fmt::format("OneCycleLR: step() called {} times, more than total_steps ({}): the "
                    "cycle is over",
                    step_num, options_.total_steps()));
  }
  auto& groups = optimizer().param_groups();
  std::vector<double> lrs, momenta;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    auto [lr, momentum] = at(g, step_num);
    lrs.push_back(lr);
    momenta.push_back(momentum);
  }
  take_step(lrs);
  if (options_.cycle_momentum()) {
    for (std::size_t g = 0; g < groups.size(); ++g)
      *momentum_slot(groups[g].options()) = momenta[g];
  }
}

void OneCycleLR::save_own_state(StateDict& state) const {
  put_doubles(state, "max_lr", options_.max_lr());
  state.set("total_steps", options_.total_steps());
  put_double(state, "pct_start", options_.pct_start());
  state.set("anneal_strategy", enum_name(kAnnealNames, options_.anneal_strategy()));
  state.set("cycle_momentum", options_.cycle_momentum());
  put_doubles(state, "base_momentum", options_.base_momentum());
  put_doubles(state, "max_momentum", options_.max_momentum());
  put_double(state, "div_factor", options_.div_factor());
  put_double(state, "final_div_factor", options_.final_div_factor());
  state.set("three_phase", options_.three_phase());
  put_doubles(state, "min_lrs", min_lrs_);
}

void OneCycleLR::load_own_state(const StateDict& state, std::size_t num_groups) {
  OneCycleLROptions options(take_doubles(state, "max_lr", num_groups, type_name()),
                            state.get<std::int64_t>("total_steps"));
  options.pct_start(take_double(state, "pct_start"));
  options.anneal_strategy(parse_enum(kAnnealNames, state, "anneal_strategy"));
  options.cycle_momentum(state.get<bool>("cycle_momentum"));
  options.base_momentum(take_doubles(state, "base_momentum", num_groups, type_name()));
  options.max_momentum(take_doubles(state, "max_momentum", num_groups, type_name()));
  options.div_factor(take_double(state, "div_factor"));
  options.final_div_factor(take_double(state, "final_div_factor"));
  options.three_phase(state.get<bool>("three_phase"));
  std::vector<double> min_lrs = take_doubles(state, "min_lrs", num_groups, type_name());
  check_one_cycle(options, ErrorCode::Incompatible, state.description());
  if (options.cycle_momentum()) {
    for (auto& group : optimizer().param_groups()) {
      if (momentum_slot(group.options()) == nullptr) {
        throw Error(ErrorCode::Incompatible,
                    fmt::format("{}: the saved OneCycleLR cycles the momentum, but this optimizer "
                                "has no momentum or betas: build the same optimizer as the saved "
                                "run",
                                state.description()));
      }
    }
  }
  options_ = std::move(options);
  min_lrs_ = std::move(min_lrs);
}

// ---------------------------------------------------------------------------------------------
// ReduceLROnPlateau

namespace {
double worst(PlateauMode mode) {
  return mode == PlateauMode::kMin ? std::numeric_limits<double>::infinity()
                                   : -std::numeric_limits<double>::infinity();
}
}  // namespace

ReduceLROnPlateau::ReduceLROnPlateau(torch::optim::Optimizer& optimizer,
                                     ReduceLROnPlateauOptions options)
    : LRScheduler(optimizer, /*last_epoch=*/0), options_(std::move(options)) {
  if (!(options_.factor() < 1.0)) {
    invalid(fmt::format("ReduceLROnPlateau: factor is {}; it must be below 1", options_.factor()));
  }
  options_.min_lr(
      per_group(options_.min_lr(), optimizer.param_groups().size(), "ReduceLROnPlateau", "min_lr"));
  best_ = worst(options_.mode());
}

void ReduceLROnPlateau::step() {
  invalid(
      "ReduceLROnPlateau::step() needs the monitored metric: call step(metric), e.g. "
      "scheduler.step(validation_loss)");
}

bool ReduceLROnPlateau::is_better(double a, double best) const {
  const double threshold = options_.threshold();
  if (options_.mode() == PlateauMode::kMin) {
    if (options_.threshold_mode() == ThresholdMode::kRel) {
      const double rel_epsilon = 1. - threshold;
      return a < best * rel_epsilon;
    }
    return a < best - threshold;
  }
  if (options_.threshold_mode() == ThresholdMode::kRel) {
    const double rel_epsilon = threshold + 1.;
    return a > best * rel_epsilon;
  }
  return a > best + threshold;
}

void ReduceLROnPlateau::step(double metric) {
  if (is_better(metric, best_)) {
    best_ = metric;
    num_bad_epochs_ = 0;
  } else {
    ++num_bad_epochs_;
  }
  if (in_cooldown()) {
    --cooldown_counter_;
    num_bad_epochs_ = 0;  // bad epochs in cooldown do not count
  }
  std::vector<double> lrs = current_lrs();
  if (num_bad_epochs_ > options_.patience()) {
    for (std::size_t i = 0; i < lrs.size(); ++i) {
      const double old_lr = lrs[i];
      const double new_lr = std::max(old_lr * options_.factor(), options_.min_lr()[i]);
      if (old_lr - new_lr > options_.eps()) lrs[i] = new_lr;
    }
    cooldown_counter_ = options_.cooldown();
    num_bad_epochs_ = 0;
  }
  take_step(lrs);
}

void ReduceLROnPlateau::save_own_state(StateDict& state) const {
  state.set("mode", enum_name(kModeNames, options_.mode()));
  put_double(state, "factor", options_.factor());
  state.set("patience", options_.patience());
  put_double(state, "threshold", options_.threshold());
  state.set("threshold_mode", enum_name(kThresholdNames, options_.threshold_mode()));
  state.set("cooldown", options_.cooldown());
  put_doubles(state, "min_lr", options_.min_lr());
  put_double(state, "eps", options_.eps());
  // best starts at +-infinity, which JSON cannot hold.
  state.set_double("best", best_);
  state.set("num_bad_epochs", num_bad_epochs_);
  state.set("cooldown_counter", cooldown_counter_);
}

void ReduceLROnPlateau::load_own_state(const StateDict& state, std::size_t num_groups) {
  ReduceLROnPlateauOptions options;
  options.mode(parse_enum(kModeNames, state, "mode"));
  options.factor(take_double(state, "factor"));
  options.patience(state.get<std::int64_t>("patience"));
  options.threshold(take_double(state, "threshold"));
  options.threshold_mode(parse_enum(kThresholdNames, state, "threshold_mode"));
  options.cooldown(state.get<std::int64_t>("cooldown"));
  options.min_lr(take_doubles(state, "min_lr", num_groups, type_name()));
  options.eps(take_double(state, "eps"));
  const double best = state.get_double("best");
  const auto num_bad_epochs = state.get<std::int64_t>("num_bad_epochs");
  const auto cooldown_counter = state.get<std::int64_t>("cooldown_counter");
  if (!(options.factor() < 1.0)) {
    throw Error(ErrorCode::Incompatible, fmt::format("{}: factor is {}; it must be below 1",
                                                     state.description(), options.factor()));
  }
  options_ = std::move(options);
  best_ = best;
  num_bad_epochs_ = num_bad_epochs;
  cooldown_counter_ = cooldown_counter;
}

}  // namespace torchpoint
