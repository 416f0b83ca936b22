// Learner and fit: a managed training loop in the style of R's luz, whose every piece of state
// (model, optimizer, data position, RNG, metric records, callback state) can be checkpointed
// and restored exactly, mid-epoch included.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <concepts>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <iosfwd>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "torchpoint/async_save.h"
#include "torchpoint/data_position.h"
#include "torchpoint/env.h"
#include "torchpoint/error.h"
#include "torchpoint/process_group.h"
#include "torchpoint/state_dict.h"

namespace torchpoint {

class Learner;
struct FitOptions;

namespace detail {
at::Tensor stack_samples(const std::vector<at::Tensor>& samples);
struct FitRun;
}  // namespace detail

// Training or validation data: a pair of tensors whose first dimension indexes the samples (as
// luz's `list(x, y)`), or a map-style LibTorch dataset returning torch::data::Example<>.
//
// Example:
//   torchpoint::FitData data(torch::randn({1000, 10}), torch::randn({1000, 1}));
//   torchpoint::FitData mnist(torch::data::datasets::MNIST("data"));
class FitData {
 public:
  // Throws InvalidArgument when x and y do not have the same number of samples.
  FitData(at::Tensor x, at::Tensor y);
  FitData(std::pair<at::Tensor, at::Tensor> xy)  // NOLINT: implicit, as luz's list(x, y)
      : FitData(std::move(xy.first), std::move(xy.second)) {}

  template <typename Dataset>
  requires requires(Dataset& d, std::size_t i) {
    { d.get(i).data } -> std::convertible_to<at::Tensor>;
    { d.get(i).target } -> std::convertible_to<at::Tensor>;
    { d.size().value() } -> std::convertible_to<std::size_t>;
  }
  FitData(Dataset dataset) {  // NOLINT: implicit by design
    auto shared = std::make_shared<Dataset>(std::move(dataset));
    size_ = shared->size().value();
    get_ = [shared](const std::vector<std::size_t>& indices) {
      std::vector<at::Tensor> xs, ys;
      xs.reserve(indices.size());
      ys.reserve(indices.size());
      for (std::size_t i : indices) {
        auto example = shared->get(i);
        xs.push_back(example.data);
        ys.push_back(example.target);
      }
      return std::make_pair(detail::stack_samples(xs), detail::stack_samples(ys));
    };
  }

  std::size_t size() const { return size_; }
  // The samples at `indices`, stacked along a new first dimension (inputs, targets).
  std::pair<at::Tensor, at::Tensor> batch(const std::vector<std::size_t>& indices) const {
    return get_(indices);
  }

 private:
  std::size_t size_ = 0;
  std::function<std::pair<at::Tensor, at::Tensor>(const std::vector<std::size_t>&)> get_;
};

// A metric averaged over an epoch: `per_element(pred, target)` returns a tensor whose elements
// are averaged over every batch of the epoch (accumulated in float64, so a run resumed
// mid-epoch records the same value bit for bit). It is recorded as ("train", name) and
// ("valid", name), and monitored as "train_<name>" / "valid_<name>".
class Metric {
 public:
  using Fn = std::function<at::Tensor(const at::Tensor& pred, const at::Tensor& target)>;
  // Throws InvalidArgument for an empty name or one with characters other than letters, digits
  // and '_'.
  Metric(std::string name, Fn per_element);
  const std::string& name() const { return name_; }
  at::Tensor values(const at::Tensor& pred, const at::Tensor& target) const {
    return fn_(pred, target);
  }

 private:
  std::string name_;
  Fn fn_;
};

namespace metrics {
Metric mae();  // mean absolute error
Metric mse();  // mean squared error
// Share of predictions on the right side of `threshold` for 0/1 targets.
Metric binary_accuracy(double threshold = 0.5);
// Share of right classes for multiclass predictions [N, C] (scores or logits: the class is the
// largest), against targets [N] of class indices or one-hot [N, C].
Metric accuracy();
}  // namespace metrics

// The optimizers of a Learner, by name, in the order fit() steps them: luz's set_optimizers
// returning a named list (a GAN's generator and discriminator, or two parameter sets with two
// learning rates). A Learner given a single optimizer holds it under the name "opt", as luz
// does. Checkpoints hold each optimizer's state under its name, and restoring an optimizer
// state checks that the names are the same.
//
// Example:
//   torchpoint::NamedOptimizers optimizers{
//       {"generator", std::make_shared<torch::optim::Adam>(gan->generator->parameters(),
//                                                           torch::optim::AdamOptions(2e-4))},
//       {"discriminator", std::make_shared<torch::optim::SGD>(
//                             gan->discriminator->parameters(), torch::optim::SGDOptions(0.01))}};
class NamedOptimizers {
 public:
  using Entry = std::pair<std::string, std::shared_ptr<torch::optim::Optimizer>>;
  NamedOptimizers() = default;
  // Throws as add() does.
  NamedOptimizers(std::initializer_list<Entry> entries);
  // Appends `optimizer` under `name`. Throws InvalidArgument for a null optimizer, a repeated
  // name, or a name that is empty or has characters other than letters, digits and '_' (it
  // names the optimizer's state in checkpoints and its loss in the records).
  NamedOptimizers& add(std::string name, std::shared_ptr<torch::optim::Optimizer> optimizer);

  std::size_t size() const { return entries_.size(); }
  bool empty() const { return entries_.empty(); }
  bool contains(const std::string& name) const;
  std::vector<std::string> names() const;
  // The optimizer named `name`; throws InvalidArgument naming the ones there are.
  torch::optim::Optimizer& operator[](const std::string& name) const;
  std::vector<Entry>::const_iterator begin() const { return entries_.begin(); }
  std::vector<Entry>::const_iterator end() const { return entries_.end(); }

 private:
  std::vector<Entry> entries_;
};

// What callbacks see: the learner, the position in the run and the current batch. Fields are
// updated by fit() before each hook; `pred` and `loss` are set from the hooks after prediction
// and after the loss on.
struct Context {
  Learner* learner = nullptr;
  torch::nn::Module* model = nullptr;
  // The optimizer whose pass runs (luz's ctx$opt): with several, fit() runs each batch's
  // forward, loss, backward and step once per optimizer, in their order, and `opt_name` says
  // which (luz's ctx$opt_name). `optimizers` holds them all by name (luz's ctx$optimizers).
  torch::optim::Optimizer* optimizer = nullptr;
  std::string opt_name;
  const NamedOptimizers* optimizers = nullptr;
  const FitOptions* options = nullptr;
  MetricRecords* records = nullptr;
  Env* env = nullptr;
  // The processes of the fit (null: one process), and whether this is the main one, which alone
  // writes files other than checkpoints.
  ProcessGroup* process_group = nullptr;
  bool is_main_process() const { return process_group == nullptr || process_group->rank() == 0; }

  std::int64_t epoch = 0;  // the epoch running or just finished, from 1
  // The epoch fit() stops after: FitOptions::epochs, or, after resume_from_checkpoint with
  // restore_records, the restored epoch plus FitOptions::epochs (luz trains that many more).
  std::int64_t epochs = 0;
  std::int64_t step = 0;   // optimizer steps taken since the start of the fit
  std::int64_t batch = 0;  // the batch of the current epoch and set, from 1
  std::int64_t batches_per_epoch = 0;
  std::string set;  // "train" or "valid"

  at::Tensor input, target, pred, loss;
  // The current batch's loss of each optimizer that has had its pass, detached, by name (luz's
  // ctx$loss[[opt_name]]); `loss` is the current pass's.
  std::map<std::string, at::Tensor> losses;
  // This epoch's values so far, by monitor name ("train_loss", "valid_mae", ...).
  std::map<std::string, double> metrics;
  // Every monitor name this fit records, known from on_fit_begin on.
  std::vector<std::string> monitors;

  // Ends the fit after the current epoch (as early stopping does); counts as success.
  void stop_training() { stop_requested = true; }
  bool stop_requested = false;

  // Prints "torchpoint: warning: <message>" where the fit's progress goes
  // (FitOptions::output, std::cout when null), unless the fit is verbose(false).
  void warn(const std::string& message) const;

  // The fit's background saver, made at first use: callbacks that save asynchronously share it,
  // so that their saves commit in the order they were made (a checkpoint never records a file
  // of another callback that is not committed yet). fit() waits for it after on_fit_end and
  // throws its error.
  AsyncCheckpointer& background_saver();
  std::unique_ptr<AsyncCheckpointer> async_saver;
};

// The callbacks of fit(), with luz's hooks, called in this order for each epoch:
//   on_epoch_begin, on_train_begin,
//     per batch: on_train_batch_begin, _after_pred, _after_loss, _before_backward,
//                _before_step, _after_step, on_train_batch_end,
//   on_train_end, [on_valid_begin, per batch: on_valid_batch_begin, _after_pred, _after_loss,
//   on_valid_batch_end, on_valid_end,] on_epoch_end;
// with on_fit_begin before the first and on_fit_end after the last. An exception from a hook
// ends the fit: a torchpoint::Error passes through unchanged, any other is rethrown as a
// CallbackError naming the callback, the hook and the epoch (the original is nested).
//
// State: a callback whose state_dict() is not empty has it saved in every learner checkpoint
// (under "callbacks.<name>") and given back by load_state_dict() on auto_resume (and on
// resume_from_checkpoint with restore_callbacks_state). A checkpoint holding the state of a
// callback that the fit does not have is refused rather than silently dropped.
//
// Example:
//   struct Interrupt : torchpoint::Callback {
//     Interrupt() : Callback("interrupt") {}
//     bool failed = false;
//     void on_epoch_end(torchpoint::Context& ctx) override {
//       if (ctx.epoch == 5 && !failed) { failed = true; throw std::runtime_error("Error on epoch
//       5"); }
//     }
//   };
class Callback {
 public:
  // `name` identifies the callback's state in checkpoints. When several callbacks of one fit
  // share a name (two model_checkpoint callbacks), fit() numbers the later ones in the order
  // given: "model_checkpoint", "model_checkpoint_1", ... (the same on every rerun).
  explicit Callback(std::string name) : name_(std::move(name)) {}
  virtual ~Callback() = default;
  const std::string& name() const { return name_; }

  virtual void on_fit_begin(Context&) {}
  virtual void on_epoch_begin(Context&) {}
  virtual void on_train_begin(Context&) {}
  virtual void on_train_batch_begin(Context&) {}
  virtual void on_train_batch_after_pred(Context&) {}
  virtual void on_train_batch_after_loss(Context&) {}
  virtual void on_train_batch_before_backward(Context&) {}
  virtual void on_train_batch_before_step(Context&) {}
  virtual void on_train_batch_after_step(Context&) {}
  virtual void on_train_batch_end(Context&) {}
  virtual void on_train_end(Context&) {}
  virtual void on_valid_begin(Context&) {}
  virtual void on_valid_batch_begin(Context&) {}
  virtual void on_valid_batch_after_pred(Context&) {}
  virtual void on_valid_batch_after_loss(Context&) {}
  virtual void on_valid_batch_end(Context&) {}
  virtual void on_valid_end(Context&) {}
  virtual void on_epoch_end(Context&) {}
  virtual void on_fit_end(Context&) {}

  virtual StateDict state_dict() const { return {}; }
  virtual void load_state_dict(const StateDict&) {}

  // Callbacks run in increasing order, then in the order given. Those that restore or save
  // the whole run (resume_from_checkpoint, auto_resume) run after the others, so that they
  // restore over what the others' on_fit_begin set up and save what the others' on_epoch_end
  // changed.
  virtual int order() const { return 0; }

 private:
  friend class Learner;  // numbers repeated names: model_checkpoint, model_checkpoint_1, ...
  std::string name_;
};
using CallbackPtr = std::shared_ptr<Callback>;

// An exception thrown by a callback that is not a torchpoint::Error, with where it happened.
// The original exception is nested (std::rethrow_if_nested gives it back).
class CallbackError : public std::runtime_error {
 public:
  CallbackError(std::string callback, std::string hook, std::int64_t epoch,
                const std::string& cause);
  const std::string& callback() const { return callback_; }
  const std::string& hook() const { return hook_; }
  std::int64_t epoch() const { return epoch_; }

 private:
  std::string callback_;
  std::string hook_;
  std::int64_t epoch_;
};

// Options of fit(), with luz's defaults where luz has one.
//
// Example:
//   learner.fit(data, torchpoint::FitOptions().epochs(10).batch_size(32).verbose(false));
struct FitOptions {
  using OutputStream = std::ostream*;
  using EnvPointer = Env*;
  TORCH_ARG(std::int64_t, epochs) = 10;
  TORCH_ARG(std::int64_t, batch_size) = 32;
  TORCH_ARG(bool, shuffle) = true;
  // The seed of the shuffling order; by default drawn from torch's default CPU generator at
  // the start of the fit (so torch::manual_seed makes runs repeatable). A resumed fit uses
  // the seed of the run it resumes.
  TORCH_ARG(std::optional<std::uint64_t>, seed);
  TORCH_ARG(std::vector<CallbackPtr>, callbacks);
  TORCH_ARG(std::vector<Metric>, metrics);
  // Progress bar (with ETA and current loss) on a terminal, one line per epoch otherwise.
  TORCH_ARG(bool, verbose) = true;
  // Where progress goes (std::cout when null).
  TORCH_ARG(OutputStream, output) = nullptr;
  // The Env checkpoints are written and read through (Env::posix() when null).
  TORCH_ARG(EnvPointer, env) = nullptr;
  // The processes the fit runs on, data-parallel; when null, torchrun's
  // (ProcessGroup::from_environment(): none for a program started as one process). Every process
  // runs the same fit: it starts from rank 0's parameters, trains on its part of every batch of
  // batch_size samples per process, averages the gradients, and records the epoch's metrics over
  // all processes, so callbacks decide alike everywhere. Checkpoints (auto_resume,
  // model_checkpoint, save_checkpoint) are written by the main process and hold every process's
  // RNG states and running sums; the other callbacks' files (csv_logger, tensorboard) and the
  // progress display are the main process's. Saving in the background is one process only.
  TORCH_ARG(std::shared_ptr<ProcessGroup>, process_group) = nullptr;

 public:
  FitOptions& valid_data(FitData data) {
    valid_data_ = std::move(data);
    return *this;
  }
  const std::optional<FitData>& valid_data() const { return valid_data_; }

 private:
  std::optional<FitData> valid_data_;
};

// What fit() returns: the records of every metric per epoch and set, and how the run went.
class FitResult {
 public:
  MetricRecords records;
  std::int64_t epochs_completed = 0;
  std::int64_t steps = 0;
  bool stopped_early = false;
  // Set when a callback restored a checkpoint at the start (the epochs completed before).
  std::optional<std::int64_t> resumed_after_epoch;
  // The model this fit trained (the Learner's; with a model_factory, this fit's own model, so
  // the results of two fits keep two models, as luz's fitted objects do).
  std::shared_ptr<torch::nn::Module> model;

  // The records as a text table: one row per epoch, one column per (set, metric).
  std::string table() const;
  // Writes the metric curves (luz's plot(results), see render_records): PNG, SVG or PDF as
  // `path` ends in .png, .svg or .pdf. Atomic; throws InvalidArgument for another extension,
  // before writing anything.
  void plot(const std::string& path) const;
};

// Which parts of a learner checkpoint restore_checkpoint() gives back.
struct RestoreOptions {
  TORCH_ARG(bool, model) = true;
  TORCH_ARG(bool, optimizer) = true;
  // Metric records and the epoch and step counters: the fit continues after the checkpoint's
  // last finished epoch.
  TORCH_ARG(bool, records) = true;
  TORCH_ARG(bool, callbacks) = true;
  // With callbacks: a saved state that no callback of this fit takes is an error (auto_resume,
  // which resumes the same fit); when false it is reported as a warning and left (luz's
  // resume_from_checkpoint with restore_callbacks_state).
  TORCH_ARG(bool, strict_callbacks) = true;
  // The exact position: data order and position, mid-epoch accumulators, RNG state.
  TORCH_ARG(bool, position) = true;
};

// luz's module generator for a Learner: every fit() of a Learner made from a model_factory
// starts from a new model (`make()`, which returns a module holder such as torch::nn::Linear or
// a shared_ptr to a module) and a new optimizer over its parameters, as luz's fit() does. The
// first model is made when the Learner is.
//
// Example:
//   torchpoint::Learner learner(
//       torchpoint::model_factory([] { return torch::nn::Linear(10, 1); }),
//       torchpoint::make_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.01)),
//       torch::mse_loss);
template <typename Make>
struct ModelFactory {
  Make make;
};
template <typename Make>
ModelFactory<Make> model_factory(Make make) {
  return {std::move(make)};
}
namespace detail {
template <typename T>
struct is_model_factory : std::false_type {};
template <typename Make>
struct is_model_factory<ModelFactory<Make>> : std::true_type {};
}  // namespace detail

// luz's step method: the training and validation step written by the user, in place of the
// loss, for full control of the passes (a GAN's). fit() calls it once per batch, after
// on_train_batch_begin (on_valid_batch_begin), with ctx.input and ctx.target set and ctx.set
// "train" or "valid" (validation under no-grad). When training, it does the forward passes,
// the backward passes and the steps of the optimizers, which it finds by name in
// ctx.optimizers; it sets ctx.losses[name] for every optimizer (or ctx.loss when there is one)
// and ctx.pred for the metrics. As in luz, fit() calls no hook between the batch's begin and
// end around it (after_pred ... after_step). One process only.
//
// Example:
//   torchpoint::Learner learner(gan, set_optimizers, torchpoint::custom_step(
//       [gan](torchpoint::Context& ctx) mutable { ... }));
struct StepFunction {
  std::function<void(Context& ctx)> fn;
};
inline StepFunction custom_step(std::function<void(Context& ctx)> fn) { return {std::move(fn)}; }

// A model, its optimizer (or several, by name) and its loss, trained by fit().
//
// Calling fit() again on the same Learner goes on from the model's current weights and the
// optimizer's current state (a warm start), with records and counters starting empty. For
// luz's behaviour, where each fit trains a new model, make the Learner from a model_factory.
//
// Several optimizers (luz's set_optimizers): give a NamedOptimizers, or a function of the model
// returning one (needed with a model_factory, whose every fit makes new optimizers). For each
// batch, fit() then runs one pass per optimizer, in their order: zero that optimizer's
// gradients, forward, loss, backward, step that optimizer, with the hooks in between and
// Context::opt_name naming it. A loss callable as loss(ctx, pred, target) sees the context, so
// that each optimizer minimises its own loss (luz's loss method reading ctx$opt_name); the step
// counter counts batches. The records then hold each optimizer's loss as "loss_<name>" (luz
// records the loss per optimizer) and "loss" as their sum.
//
// Example:
//   auto model = torch::nn::Linear(10, 1);
//   torchpoint::Learner learner(model, torchpoint::make_optimizer<torch::optim::SGD>(
//                                          torch::optim::SGDOptions(0.01)), torch::mse_loss);
//   auto result = learner.fit({x, y}, torchpoint::FitOptions().epochs(10).callbacks({
//       torchpoint::callbacks::auto_resume("state.ckpt")}));
//
//   // Two optimizers: a GAN's two networks, each with its own loss.
//   torchpoint::Learner gan_learner(
//       gan, [](Gan& m) { return torchpoint::NamedOptimizers{
//                {"generator", std::make_shared<torch::optim::Adam>(m->generator->parameters())},
//                {"discriminator", std::make_shared<torch::optim::SGD>(
//                                      m->discriminator->parameters(),
//                                      torch::optim::SGDOptions(0.01))}}; },
//       [](const torchpoint::Context& ctx, const at::Tensor& pred, const at::Tensor& target) {
//         return ctx.opt_name == "generator" ? generator_loss(pred) : critic_loss(pred, target);
//       });
class Learner {
 public:
  using Forward = std::function<at::Tensor(const at::Tensor&)>;
  using Loss = std::function<at::Tensor(const at::Tensor& pred, const at::Tensor& target)>;
  // A loss that sees the fit's context (Context::opt_name: which optimizer's pass this is).
  using ContextLoss = std::function<at::Tensor(const Context& ctx, const at::Tensor& pred,
                                               const at::Tensor& target)>;
  using OptimizerFactory =
      std::function<std::shared_ptr<torch::optim::Optimizer>(std::vector<at::Tensor>)>;

  // `model`: a LibTorch module holder (torch::nn::Linear, a TORCH_MODULE) or a shared_ptr to a
  // module with forward(Tensor). `optimizer`: a shared_ptr to an optimizer over the model's
  // parameters, or a factory (make_optimizer) called with them; or several by name: a
  // NamedOptimizers, or a function called with the model (what `model` or the model_factory
  // gives) returning one. `loss`: callable as loss(pred, target), such as torch::mse_loss, or
  // a loss module such as torch::nn::CrossEntropyLoss(), or as loss(ctx, pred, target); or a
  // custom_step, which computes the losses itself.
  template <typename Model, typename Optimizer, typename LossFn>
  Learner(Model model, Optimizer optimizer, LossFn loss) {
    if constexpr (detail::is_model_factory<Model>::value) {
      using Made = decltype(model.make());
      if constexpr (std::is_invocable_r_v<NamedOptimizers, Optimizer&, Made&>) {
        remake_ = [this, make = model.make, set_optimizers = optimizer]() mutable {
          auto fresh = make();
          auto module = as_module(fresh);
          model_ = module;
          forward_ = [module](const at::Tensor& x) -> at::Tensor { return module->forward(x); };
          optimizers_ = set_optimizers(fresh);
        };
      } else {
        static_assert(std::is_convertible_v<Optimizer, OptimizerFactory>,
                      "torchpoint: a Learner made from a model_factory needs an optimizer factory "
                      "(make_optimizer) or a function of the model returning NamedOptimizers, "
                      "since every fit makes new optimizers");
        OptimizerFactory make_optimizer = optimizer;
        remake_ = [this, make = model.make, make_optimizer] {
          auto fresh = make();
          auto module = as_module(fresh);
          model_ = module;
          forward_ = [module](const at::Tensor& x) -> at::Tensor { return module->forward(x); };
          optimizers_ = single(make_optimizer(module->parameters()));
        };
      }
      take_loss(std::move(loss));
      remake_();
      init(model_, forward_, optimizers_, loss_);
    } else {
      auto module = as_module(model);
      Forward forward = [module](const at::Tensor& x) -> at::Tensor { return module->forward(x); };
      NamedOptimizers optimizers;
      if constexpr (std::is_convertible_v<Optimizer, std::shared_ptr<torch::optim::Optimizer>>) {
        optimizers = single(optimizer);
      } else if constexpr (std::is_convertible_v<Optimizer, NamedOptimizers>) {
        optimizers = optimizer;
      } else if constexpr (std::is_invocable_r_v<NamedOptimizers, Optimizer&, Model&>) {
        optimizers = optimizer(model);
      } else {
        optimizers = single(OptimizerFactory(optimizer)(module->parameters()));
      }
      take_loss(std::move(loss));
      init(module, std::move(forward), std::move(optimizers), loss_);
    }
  }
  ~Learner();
  Learner(const Learner&) = delete;
  Learner& operator=(const Learner&) = delete;

  // Trains for options.epochs() epochs (or until a callback stops it), running the callbacks'
  // hooks. Records (one value per epoch of the loss and each metric, per set) start empty
  // unless a callback restores them. If a hook throws, the fit stops there and the exception
  // propagates; the model keeps the weights it had at that point.
  FitResult fit(const FitData& data, const FitOptions& options = FitOptions());

  // The model's output for `x`, in eval mode without gradients (the mode is put back).
  at::Tensor predict(const at::Tensor& x);
  // The loss and metrics over `data`, by monitor name ("valid_loss", ...), in eval mode.
  std::map<std::string, double> evaluate(const FitData& data, std::int64_t batch_size = 32,
                                         const std::vector<Metric>& metrics = {});

  // Writes a checkpoint of the whole learner — model, optimizer, records and counters, and
  // during a fit also the data position, the running epoch's accumulators, every callback's
  // state and the RNG state — atomically to `path` (a single file; see docs/format.md).
  void save_checkpoint(const std::string& path, Env* env = nullptr) const;
  // The same checkpoint, written in the background by `saver` (see AsyncCheckpointer): returns
  // once the state is copied; training may go on at once.
  SaveHandle save_checkpoint(const std::string& path, AsyncCheckpointer& saver) const;
  // Restores the parts of a checkpoint that `what` selects. Everything is read, verified and
  // matched (keys, shapes, callback names) before anything changes; if a part still refuses its
  // state, the parts already restored are put back. Throws NotFound, Corruption or
  // Incompatible. Restoring the position or callbacks needs a running fit (a callback's
  // on_fit_begin); outside a fit those parts must be turned off.
  void restore_checkpoint(const std::string& path, const RestoreOptions& what, Env* env = nullptr);

  torch::nn::Module& model() { return *model_; }
  const std::shared_ptr<torch::nn::Module>& model_ptr() const { return model_; }
  // The Learner's only optimizer; with several, throws InvalidArgument naming them (use
  // optimizer(name)).
  torch::optim::Optimizer& optimizer();
  // The optimizer named `name`; throws InvalidArgument naming the ones there are.
  torch::optim::Optimizer& optimizer(const std::string& name) { return optimizers_[name]; }
  const NamedOptimizers& optimizers() const { return optimizers_; }
  const MetricRecords& records() const { return records_; }
  const TrainingCounters& counters() const { return counters_; }

 private:
  Container checkpoint_contents() const;
  // With several processes: checkpoint_contents() and every process's part (packed, by rank).
  Container contents_with_parts(const std::vector<std::string>& parts) const;
  template <typename M>
  static auto as_module(M& model) {
    if constexpr (requires { model.ptr(); }) {
      return model.ptr();
    } else {
      return model;
    }
  }
  static NamedOptimizers single(std::shared_ptr<torch::optim::Optimizer> optimizer) {
    NamedOptimizers one;
    one.add("opt", std::move(optimizer));  // luz's name for a lone optimizer
    return one;
  }
  template <typename F>
  static ContextLoss as_loss(F f) {
    if constexpr (std::is_invocable_r_v<at::Tensor, F, const at::Tensor&, const at::Tensor&>) {
      // mutable: a loss module (torch::nn::CrossEntropyLoss(), ...) is called through a
      // non-const operator().
      return [f](const Context&, const at::Tensor& p, const at::Tensor& t) mutable -> at::Tensor {
        return f(p, t);
      };
    } else if constexpr (std::is_invocable_r_v<at::Tensor, F, const Context&, const at::Tensor&,
                                               const at::Tensor&>) {
      return [f](const Context& ctx, const at::Tensor& p, const at::Tensor& t) mutable
                 -> at::Tensor { return f(ctx, p, t); };
    } else {
      static_assert(
          std::is_invocable_r_v<at::Tensor, F, const at::Tensor&, const at::Tensor&, std::int64_t>,
          "torchpoint: the loss must be callable as loss(pred, target) or loss(ctx, pred, "
          "target)");
      // A function pointer such as torch::mse_loss loses its default reduction argument.
      return [f](const Context&, const at::Tensor& p, const at::Tensor& t) -> at::Tensor {
        return f(p, t, /*reduction=mean*/ 1);
      };
    }
  }
  // Sets the loss, or with a custom_step the step (and a loss that says it has none).
  template <typename F>
  void take_loss(F f) {
    if constexpr (std::is_same_v<F, StepFunction>) {
      if (!f.fn) throw Error(ErrorCode::InvalidArgument, "custom_step was given no function");
      step_ = std::move(f.fn);
      loss_ = no_loss();
    } else {
      loss_ = as_loss(std::move(f));
    }
  }
  static ContextLoss no_loss();
  void init(std::shared_ptr<torch::nn::Module> model, Forward forward, NamedOptimizers optimizers,
            ContextLoss loss);
  // With a model_factory: replaces the model, forward and optimizer with new ones.
  std::function<void()> remake_;
  bool fitted_ = false;  // a fit has started: the next one remakes the model, if it can

  friend struct detail::FitRun;
  std::shared_ptr<torch::nn::Module> model_;
  Forward forward_;
  NamedOptimizers optimizers_;
  ContextLoss loss_;
  std::function<void(Context&)> step_;  // a custom_step, if any
  MetricRecords records_;
  TrainingCounters counters_;
  detail::FitRun* run_ = nullptr;  // the fit in progress, if any
};

// An optimizer factory for Learner: the optimizer type and its options (luz's
// setup(optimizer = optim_sgd) %>% set_opt_hparams(lr = 0.01)).
//
// Example:
//   torchpoint::make_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(1e-3))
template <typename O, typename Options>
Learner::OptimizerFactory make_optimizer(Options options) {
  return [options](std::vector<at::Tensor> params) -> std::shared_ptr<torch::optim::Optimizer> {
    return std::make_shared<O>(std::move(params), options);
  };
}

// luz_load_checkpoint: loads the model weights of a learner checkpoint (written by
// model_checkpoint, auto_resume or save_checkpoint) into `learner`, replacing the weights in
// memory. On error (NotFound, Corruption, Incompatible with the key and shapes) the model is
// unchanged.
void load_checkpoint(Learner& learner, const std::string& path, Env* env = nullptr);

// luz_load_checkpoint(fitted, path): the same, into the model a fit trained
// (FitResult::model). Throws InvalidArgument if the result holds no model.
void load_checkpoint(FitResult& result, const std::string& path, Env* env = nullptr);

}  // namespace torchpoint
