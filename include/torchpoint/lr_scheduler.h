// Learning-rate schedulers for LibTorch optimizers that compute the same learning rates as
// PyTorch 1.13's torch.optim.lr_scheduler, bit for bit, and save everything needed to continue
// a run exactly.
//
// Like PyTorch, a scheduler's state holds only the scheduler: load_state_dict() never touches
// the optimizer. The optimizer's own state (its param groups' lr, momentum and betas) restores
// those, so restore both, in either order, after constructing both.
#pragma once

#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "torchpoint/error.h"
#include "torchpoint/state_dict.h"

namespace torchpoint {

// Base of every scheduler: drives the learning rate of each param group of one optimizer.
//
// The scheduler keeps a reference to the optimizer, which must outlive it. It reads the base
// learning rates (PyTorch's `initial_lr`) from the param groups when it is built, so the
// optimizer must not gain or lose param groups afterwards. Not thread-safe; not copyable
// (it would share the optimizer).
//
// Its state:
//   type         the scheduler's class name, "StepLR", ...
//   last_epoch   the index of the last step (PyTorch's last_epoch), 0 after construction
//   step_count   calls to step(), counting the one made by the constructor (PyTorch's _step_count)
//   base_lrs     one per param group
//   last_lrs     the learning rates set by the last step, one per param group
//   <option>     every option of the scheduler, under its PyTorch name, and any counters
// Doubles are exact JSON numbers; a non-finite one is stored as a float64 tensor instead.
class LRScheduler {
 public:
  virtual ~LRScheduler() = default;
  LRScheduler(const LRScheduler&) = delete;
  LRScheduler& operator=(const LRScheduler&) = delete;

  // Advances the schedule by one epoch (or batch, for OneCycleLR) and sets the new learning
  // rate of every param group. Call it after optimizer.step(). If it throws, nothing changed.
  virtual void step() = 0;

  // The class name stored under "type" ("StepLR").
  virtual const char* type_name() const = 0;

  // The learning rates set by the last step, one per param group (before any step of
  // ReduceLROnPlateau: the learning rates the param groups had when it was built).
  const std::vector<double>& get_last_lr() const { return last_lrs_; }
  // The learning rates the schedule starts from, one per param group.
  const std::vector<double>& base_lrs() const { return base_lrs_; }
  // PyTorch's last_epoch: 0 after construction, then +1 per step().
  std::int64_t last_epoch() const { return last_epoch_; }
  // Calls to step(), counting the one the constructor makes (PyTorch's _step_count).
  std::int64_t step_count() const { return step_count_; }
  torch::optim::Optimizer& optimizer() const { return optimizer_; }

  // Everything needed to continue the schedule exactly (see the class comment).
  StateDict state_dict() const;

  // Restores a state made by state_dict() of the same scheduler type, for an optimizer with
  // as many param groups; the saved options replace the constructor's, as in PyTorch. Does not
  // change the optimizer. Throws Incompatible for a state of another scheduler type or another
  // number of param groups, NotFound for a missing key, Incompatible or InvalidArgument for a
  // bad value; everything is checked first, so after a failure the scheduler is unchanged.
  void load_state_dict(const StateDict& state);

 protected:
  // Reads the base learning rates from the param groups of `optimizer`, or takes `base_lrs`
  // when given (one per param group). Sets last_epoch to `last_epoch`.
  explicit LRScheduler(torch::optim::Optimizer& optimizer, std::int64_t last_epoch = -1,
                       std::vector<double> base_lrs = {});

  // The learning rates of the param groups now.
  std::vector<double> current_lrs() const;
  // Makes one step: +1 to last_epoch and step_count, `lrs` set on the param groups and
  // recorded as the last lrs. Does not throw for a vector of one lr per group.
  void take_step(const std::vector<double>& lrs);
  // Records the param groups' learning rates as the last lrs.
  void record_last_lrs() { last_lrs_ = current_lrs(); }

  // Adds the subclass's options and counters to `state`.
  virtual void save_own_state(StateDict& state) const = 0;
  // Reads and checks the subclass's options and counters from `state`, then takes them; must
  // throw before changing anything. `num_groups` is the optimizer's number of param groups.
  virtual void load_own_state(const StateDict& state, std::size_t num_groups) = 0;

 private:
  torch::optim::Optimizer& optimizer_;
  std::vector<double> base_lrs_;
  std::vector<double> last_lrs_;
  std::int64_t last_epoch_;
  std::int64_t step_count_ = 0;
};

// ---------------------------------------------------------------------------------------------

// Options of StepLR.
struct StepLROptions {
  /* implicit */ StepLROptions(std::int64_t step_size) : step_size_(step_size) {}
  // Epochs between two decays; at least 1.
  TORCH_ARG(std::int64_t, step_size);
  // Factor applied at each decay.
  TORCH_ARG(double, gamma) = 0.1;
};

// Multiplies the learning rate by gamma every step_size epochs (PyTorch's StepLR).
// Throws InvalidArgument when step_size < 1.
//
// Example:
//   torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1));
//   torchpoint::StepLR scheduler(sgd, torchpoint::StepLROptions(30).gamma(0.1));
//   for (int epoch = 0; epoch < 100; ++epoch) { train(sgd); scheduler.step(); }
class StepLR final : public LRScheduler {
 public:
  StepLR(torch::optim::Optimizer& optimizer, StepLROptions options);
  void step() override;
  const char* type_name() const override { return "StepLR"; }
  const StepLROptions& options() const { return options_; }

 private:
  void save_own_state(StateDict& state) const override;
  void load_own_state(const StateDict& state, std::size_t num_groups) override;
  StepLROptions options_;
};

// Options of MultiStepLR.
struct MultiStepLROptions {
  /* implicit */ MultiStepLROptions(std::vector<std::int64_t> milestones)
      : milestones_(std::move(milestones)) {}
  // Epochs at which to decay; a milestone listed n times decays by gamma^n.
  TORCH_ARG(std::vector<std::int64_t>, milestones);
  TORCH_ARG(double, gamma) = 0.1;
};

// Multiplies the learning rate by gamma at each milestone epoch (PyTorch's MultiStepLR).
//
// Example:
//   torchpoint::MultiStepLR scheduler(sgd, torchpoint::MultiStepLROptions({30, 80}).gamma(0.1));
//   for (int epoch = 0; epoch < 100; ++epoch) { train(sgd); scheduler.step(); }
class MultiStepLR final : public LRScheduler {
 public:
  MultiStepLR(torch::optim::Optimizer& optimizer, MultiStepLROptions options);
  void step() override;
  const char* type_name() const override { return "MultiStepLR"; }
  const MultiStepLROptions& options() const { return options_; }

 private:
  void save_own_state(StateDict& state) const override;
  void load_own_state(const StateDict& state, std::size_t num_groups) override;
  MultiStepLROptions options_;
};

// Options of ExponentialLR.
struct ExponentialLROptions {
  /* implicit */ ExponentialLROptions(double gamma) : gamma_(gamma) {}
  // Factor applied every epoch.
  TORCH_ARG(double, gamma);
};

// Multiplies the learning rate by gamma every epoch (PyTorch's ExponentialLR).
//
// Example:
//   torchpoint::ExponentialLR scheduler(adam, torchpoint::ExponentialLROptions(0.95));
//   for (int epoch = 0; epoch < 100; ++epoch) { train(adam); scheduler.step(); }
class ExponentialLR final : public LRScheduler {
 public:
  ExponentialLR(torch::optim::Optimizer& optimizer, ExponentialLROptions options);
  void step() override;
  const char* type_name() const override { return "ExponentialLR"; }
  const ExponentialLROptions& options() const { return options_; }

 private:
  void save_own_state(StateDict& state) const override;
  void load_own_state(const StateDict& state, std::size_t num_groups) override;
  ExponentialLROptions options_;
};

// Options of CosineAnnealingLR.
struct CosineAnnealingLROptions {
  /* implicit */ CosineAnnealingLROptions(std::int64_t T_max) : T_max_(T_max) {}
  // Epochs of a half cosine period; at least 1.
  TORCH_ARG(std::int64_t, T_max);
  // The learning rate at the bottom of the cosine.
  TORCH_ARG(double, eta_min) = 0.0;
};

// Anneals the learning rate from its base value to eta_min along a cosine of period 2*T_max,
// in PyTorch's recursive form (PyTorch's CosineAnnealingLR). Throws InvalidArgument when
// T_max < 1.
//
// Example:
//   torchpoint::CosineAnnealingLR scheduler(sgd, torchpoint::CosineAnnealingLROptions(50));
//   for (int epoch = 0; epoch < 50; ++epoch) { train(sgd); scheduler.step(); }
class CosineAnnealingLR final : public LRScheduler {
 public:
  CosineAnnealingLR(torch::optim::Optimizer& optimizer, CosineAnnealingLROptions options);
  void step() override;
  const char* type_name() const override { return "CosineAnnealingLR"; }
  const CosineAnnealingLROptions& options() const { return options_; }

 private:
  void save_own_state(StateDict& state) const override;
  void load_own_state(const StateDict& state, std::size_t num_groups) override;
  CosineAnnealingLROptions options_;
};

// Options of LinearLR.
struct LinearLROptions {
  // Factor of the first epoch, in (0, 1].
  TORCH_ARG(double, start_factor) = 1.0 / 3;
  // Factor reached after total_iters epochs, in [0, 1].
  TORCH_ARG(double, end_factor) = 1.0;
  TORCH_ARG(std::int64_t, total_iters) = 5;
};

// Scales the learning rate by a factor going linearly from start_factor to end_factor over
// total_iters epochs (PyTorch's LinearLR). Throws InvalidArgument for a factor out of range
// (PyTorch 1.13 accepts start_factor 0 and then fails with ZeroDivisionError at the first step).
//
// Example:
//   torchpoint::LinearLR warmup(sgd, torchpoint::LinearLROptions().start_factor(0.1));
//   for (int epoch = 0; epoch < 10; ++epoch) { train(sgd); warmup.step(); }
class LinearLR final : public LRScheduler {
 public:
  LinearLR(torch::optim::Optimizer& optimizer, LinearLROptions options = {});
  void step() override;
  const char* type_name() const override { return "LinearLR"; }
  const LinearLROptions& options() const { return options_; }

 private:
  void save_own_state(StateDict& state) const override;
  void load_own_state(const StateDict& state, std::size_t num_groups) override;
  LinearLROptions options_;
};

// How OneCycleLR moves between two values within a phase.
enum class AnnealStrategy { kCos, kLinear };

// Options of OneCycleLR. max_lr, base_momentum and max_momentum take one value for every param
// group or one per param group.
struct OneCycleLROptions {
  OneCycleLROptions(double max_lr, std::int64_t total_steps)
      : max_lr_({max_lr}), total_steps_(total_steps) {}
  OneCycleLROptions(std::vector<double> max_lr, std::int64_t total_steps)
      : max_lr_(std::move(max_lr)), total_steps_(total_steps) {}

  // The peak learning rate.
  TORCH_ARG(std::vector<double>, max_lr);
  // Steps in the whole cycle; step() may be called this many times.
  TORCH_ARG(std::int64_t, total_steps);
  // Fraction of the cycle spent increasing the learning rate, in [0, 1].
  TORCH_ARG(double, pct_start) = 0.3;
  TORCH_ARG(AnnealStrategy, anneal_strategy) = AnnealStrategy::kCos;
  // Cycles SGD's or RMSprop's momentum, or Adam's and AdamW's beta1, inversely to the lr.
  TORCH_ARG(bool, cycle_momentum) = true;
  // The initial learning rate is max_lr / div_factor.
  TORCH_ARG(double, div_factor) = 25.0;
  // The final learning rate is the initial one / final_div_factor.
  TORCH_ARG(double, final_div_factor) = 1e4;
  // Three phases (up, down to the initial lr, down to the final lr) instead of two.
  TORCH_ARG(bool, three_phase) = false;

 public:
  // The momentum at the peak of the learning rate.
  OneCycleLROptions& base_momentum(double value) { return base_momentum(std::vector{value}); }
  OneCycleLROptions& base_momentum(std::vector<double> values) {
    base_momentum_ = std::move(values);
    return *this;
  }
  const std::vector<double>& base_momentum() const { return base_momentum_; }
  // The momentum at the start and the end of the cycle.
  OneCycleLROptions& max_momentum(double value) { return max_momentum(std::vector{value}); }
  OneCycleLROptions& max_momentum(std::vector<double> values) {
    max_momentum_ = std::move(values);
    return *this;
  }
  const std::vector<double>& max_momentum() const { return max_momentum_; }

 private:
  std::vector<double> base_momentum_ = {0.85};
  std::vector<double> max_momentum_ = {0.95};
};

// The 1cycle policy (PyTorch's OneCycleLR): the learning rate rises from max_lr / div_factor to
// max_lr, then falls to max_lr / div_factor / final_div_factor, stepped once per batch; the
// momentum moves the other way. The constructor sets each param group's lr (and momentum) to
// the start of the cycle. Throws InvalidArgument for a bad option, a list of values whose
// length is neither 1 nor the number of param groups, or cycle_momentum with an optimizer
// without momentum or betas (Adagrad, LBFGS). step() throws InvalidArgument, changing nothing,
// when called more than total_steps times, as PyTorch does.
//
// Example:
//   torch::optim::SGD sgd(model->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
//   torchpoint::OneCycleLR scheduler(sgd, torchpoint::OneCycleLROptions(0.01, 1000));
//   for (int batch = 0; batch < 1000; ++batch) { train_batch(sgd); scheduler.step(); }
class OneCycleLR final : public LRScheduler {
 public:
  OneCycleLR(torch::optim::Optimizer& optimizer, OneCycleLROptions options);
  void step() override;
  const char* type_name() const override { return "OneCycleLR"; }
  // The options with max_lr, base_momentum and max_momentum expanded to one per param group.
  const OneCycleLROptions& options() const { return options_; }

 private:
  struct Phase {
    double end_step;
    int start_lr, end_lr, start_momentum, end_momentum;  // indices into the values of a group
  };
  std::vector<Phase> phases() const;
  // The lr and momentum of group `group` at step `step_num`.
  std::pair<double, double> at(std::size_t group, std::int64_t step_num) const;
  void save_own_state(StateDict& state) const override;
  void load_own_state(const StateDict& state, std::size_t num_groups) override;

  OneCycleLROptions options_;
  std::vector<double> min_lrs_;
};

// What ReduceLROnPlateau watches for: a metric that stops decreasing or increasing.
enum class PlateauMode { kMin, kMax };
// Whether an improvement is measured relative to the best value or in absolute terms.
enum class ThresholdMode { kRel, kAbs };

// Options of ReduceLROnPlateau. min_lr takes one value for every param group or one per group.
struct ReduceLROnPlateauOptions {
  TORCH_ARG(PlateauMode, mode) = PlateauMode::kMin;
  // new_lr = lr * factor; below 1.
  TORCH_ARG(double, factor) = 0.1;
  // Epochs without improvement tolerated before a reduction.
  TORCH_ARG(std::int64_t, patience) = 10;
  // The least change counted as an improvement.
  TORCH_ARG(double, threshold) = 1e-4;
  TORCH_ARG(ThresholdMode, threshold_mode) = ThresholdMode::kRel;
  // Epochs after a reduction during which bad epochs are not counted.
  TORCH_ARG(std::int64_t, cooldown) = 0;
  // A reduction smaller than eps is skipped.
  TORCH_ARG(double, eps) = 1e-8;

 public:
  // The lower bound of the learning rate.
  ReduceLROnPlateauOptions& min_lr(double value) { return min_lr(std::vector{value}); }
  ReduceLROnPlateauOptions& min_lr(std::vector<double> values) {
    min_lr_ = std::move(values);
    return *this;
  }
  const std::vector<double>& min_lr() const { return min_lr_; }

 private:
  std::vector<double> min_lr_ = {0.0};
};

// Reduces the learning rate by `factor` when a metric has not improved for `patience` epochs
// (PyTorch's ReduceLROnPlateau). It is stepped with the metric: step(metric); the plain step()
// throws InvalidArgument. Its state also holds best (possibly infinite), num_bad_epochs and
// cooldown_counter. Throws InvalidArgument when factor >= 1 or min_lr has a wrong length.
//
// Example:
//   torchpoint::ReduceLROnPlateau scheduler(sgd,
//   torchpoint::ReduceLROnPlateauOptions().cooldown(2)); for (int epoch = 0; epoch < 100; ++epoch)
//   { train(sgd); scheduler.step(validate()); }
class ReduceLROnPlateau final : public LRScheduler {
 public:
  explicit ReduceLROnPlateau(torch::optim::Optimizer& optimizer,
                             ReduceLROnPlateauOptions options = {});
  // Counts one epoch with `metric` and reduces the learning rates if it is time to.
  void step(double metric);
  // Throws InvalidArgument: this scheduler needs the metric.
  void step() override;
  const char* type_name() const override { return "ReduceLROnPlateau"; }
  // The options with min_lr expanded to one per param group.
  const ReduceLROnPlateauOptions& options() const { return options_; }

  // The best metric so far (+inf in min mode, -inf in max mode before any step).
  double best() const { return best_; }
  std::int64_t num_bad_epochs() const { return num_bad_epochs_; }
  std::int64_t cooldown_counter() const { return cooldown_counter_; }
  bool in_cooldown() const { return cooldown_counter_ > 0; }

 private:
  bool is_better(double a, double best) const;
  void save_own_state(StateDict& state) const override;
  void load_own_state(const StateDict& state, std::size_t num_groups) override;

  ReduceLROnPlateauOptions options_;
  double best_;
  std::int64_t num_bad_epochs_ = 0;
  std::int64_t cooldown_counter_ = 0;
};

}  // namespace torchpoint
