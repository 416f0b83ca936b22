#include "torchpoint/learner.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tensor.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <exception>
#include <iostream>
#include <mutex>
#include <set>

#include "compat/torch_compat.h"
#include "torchpoint/error.h"
#include "train/fit_run.h"
#include "report/progress.h"

namespace torchpoint {
namespace detail {

at::Tensor stack_samples(const std::vector<at::Tensor>& samples) { return at::stack(samples); }

// What the default passes loop over with a custom step: nothing.
const NamedOptimizers kNoOptimizers{};

void FitRun::each(const char* name, void (Callback::*hook)(Context&)) {
  for (const CallbackPtr& callback : callbacks) {
    try {
      ((*callback).*hook)(ctx);
    } catch (const Error&) {
      throw;  // already says what, where and why
    } catch (const CallbackError&) {
      throw;
    } catch (const std::exception& e) {
      std::throw_with_nested(CallbackError(callback->name(), name, ctx.epoch, e.what()));
    }
  }
}

// Adds a batch's per-element values to a float64 running sum (the element order is fixed, so
// the sum is the same in every run).
void accumulate(Accumulator& acc, const at::Tensor& values) {
  at::Tensor v = values.detach().to(at::kDouble).reshape({-1});
  acc.sum += v.sum().item<double>();
  acc.count += v.numel();
}

void FitRun::add_batch(const std::string& set) {
  at::NoGradGuard no_grad;
  Accumulator& loss = progress[set + "_loss"];
  auto n = ctx.input.size(0);
  if (ctx.optimizers->size() == 1) {
    // A custom step may have set only ctx.losses.
    const at::Tensor& value =
        ctx.loss.defined() || ctx.losses.empty() ? ctx.loss : ctx.losses.begin()->second;
    if (!value.defined()) {
      throw Error(ErrorCode::InvalidArgument,
                  "fit: the custom step set no loss for this batch; set ctx.loss (or "
                  "ctx.losses[<optimizer name>])");
    }
    loss.sum += value.item<double>() * static_cast<double>(n);
  } else {
    // Several optimizers: each one's loss, and their sum as the loss (in the optimizers' order,
    // so that every run adds them alike).
    double total = 0;
    for (const auto& [name, opt] : *ctx.optimizers) {
      auto it = ctx.losses.find(name);
      if (it == ctx.losses.end() || !it->second.defined()) {
        throw Error(ErrorCode::InvalidArgument,
                    fmt::format("fit: no loss of optimizer '{}' in ctx.losses for this batch; a "
                                "custom step sets ctx.losses[name] for each optimizer ({})",
                                name, fmt::join(ctx.optimizers->names(), ", ")));
      }
      double value = it->second.item<double>();
      total += value;
      Accumulator& own = progress[set + "_loss_" + name];
      own.sum += value * static_cast<double>(n);
      own.count += n;
    }
    loss.sum += total * static_cast<double>(n);
  }
  loss.count += n;
  for (const Metric& m : metrics) {
    accumulate(progress[set + "_" + m.name()], m.values(ctx.pred, ctx.target));
  }
}

void FitRun::record_set(const std::string& set) {
  std::string prefix = set + "_";
  std::map<std::string, Accumulator> totals;
  for (const std::string& name : monitors) {
    if (name.rfind(prefix, 0) == 0) totals[name] = progress[name];
  }
  if (group) {
    // Every process's sums and counts (counts are exact in float64 up to 2^53).
    std::vector<double> flat;
    for (const auto& [name, a] : totals) {
      flat.push_back(a.sum);
      flat.push_back(static_cast<double>(a.count));
    }
    at::Tensor t = at::tensor(flat, at::kDouble);
    group->allreduce(t, ProcessGroup::ReduceOp::Sum, "fit(): the epoch's " + set + " metrics");
    std::size_t i = 0;
    for (auto& [name, a] : totals) {
      a.sum = t[static_cast<std::int64_t>(i++)].item<double>();
      a.count = static_cast<std::int64_t>(t[static_cast<std::int64_t>(i++)].item<double>());
    }
  }
  for (const std::string& name : monitors) {
    if (name.rfind(prefix, 0) != 0) continue;
    double value = totals[name].mean();
    ctx.metrics[name] = value;
    ctx.records->record(set, name.substr(prefix.size()), value);
  }
}

}  // namespace detail

namespace {

bool valid_name(const std::string& name) {
  if (name.empty()) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) != 0 || c == '_';
  });
}

std::uint64_t draw_seed() {
  at::Generator generator = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(generator.mutex());
  return generator.get<at::CPUGeneratorImpl>()->random64();
}

at::Tensor index_tensor(const std::vector<std::size_t>& indices) {
  std::vector<std::int64_t> values(indices.begin(), indices.end());
  return at::tensor(values, at::kLong);
}

std::vector<std::size_t> sequential(std::size_t begin, std::size_t end) {
  std::vector<std::size_t> out;
  out.reserve(end - begin);
  for (std::size_t i = begin; i < end; ++i) out.push_back(i);
  return out;
}

}  // namespace

FitData::FitData(at::Tensor x, at::Tensor y) {
  if (!x.defined() || !y.defined() || x.dim() == 0 || y.dim() == 0) {
    throw Error(ErrorCode::InvalidArgument,
                "FitData needs two defined tensors with at least one dimension, indexed by "
                "sample along the first");
  }
  if (x.size(0) != y.size(0)) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("FitData: x has {} samples but y has {}: both must have the same "
                            "first dimension",
                            x.size(0), y.size(0)));
  }
  size_ = static_cast<std::size_t>(x.size(0));
  get_ = [x, y](const std::vector<std::size_t>& indices) {
    at::Tensor index = index_tensor(indices);
    return std::make_pair(x.index_select(0, index), y.index_select(0, index));
  };
}

Metric::Metric(std::string name, Fn per_element)
    : name_(std::move(name)), fn_(std::move(per_element)) {
  if (!valid_name(name_) || name_ == "loss") {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("metric name '{}' is not usable: use letters, digits and '_', and "
                            "not 'loss' (the loss is always recorded)",
                            name_));
  }
  if (!fn_)
    throw Error(ErrorCode::InvalidArgument, fmt::format("metric '{}' has no function", name_));
}

namespace metrics {
Metric mae() {
  return Metric("mae", [](const at::Tensor& p, const at::Tensor& t) { return (p - t).abs(); });
}
Metric mse() {
  return Metric("mse", [](const at::Tensor& p, const at::Tensor& t) {
    at::Tensor d = p - t;
    return d * d;
  });
}
Metric accuracy() {
  return Metric("accuracy", [](const at::Tensor& p, const at::Tensor& t) {
    if (p.dim() != 2) {
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("accuracy needs predictions of shape [N, classes], got {}; for one "
                              "output per sample use binary_accuracy",
                              fmt::join(p.sizes(), "x")));
    }
    at::Tensor classes = t.dim() == 2 ? t.argmax(1) : t.reshape({-1});
    return p.argmax(1).eq(classes.to(at::kLong)).to(at::kDouble);
  });
}
Metric binary_accuracy(double threshold) {
  return Metric("binary_accuracy", [threshold](const at::Tensor& p, const at::Tensor& t) {
    return (p > threshold).eq(t > 0.5).to(at::kDouble);
  });
}
}  // namespace metrics

CallbackError::CallbackError(std::string callback, std::string hook, std::int64_t epoch,
                             const std::string& cause)
    : std::runtime_error(
          fmt::format("error in callback '{}' at {} (epoch {}): {}", callback, hook, epoch, cause)),
      callback_(std::move(callback)),
      hook_(std::move(hook)),
      epoch_(epoch) {}

void Context::warn(const std::string& message) const {
  if (options == nullptr || !options->verbose()) return;
  std::ostream& out = options->output() != nullptr ? *options->output() : std::cout;
  out << "torchpoint: warning: " << message << std::endl;
}

AsyncCheckpointer& Context::background_saver() {
  if (!async_saver) async_saver = std::make_unique<AsyncCheckpointer>(*env);
  return *async_saver;
}

NamedOptimizers::NamedOptimizers(std::initializer_list<Entry> entries) {
  for (const Entry& e : entries) add(e.first, e.second);
}

NamedOptimizers& NamedOptimizers::add(std::string name,
                                      std::shared_ptr<torch::optim::Optimizer> optimizer) {
  if (!valid_name(name)) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("optimizer name '{}' is not usable: use letters, digits and '_' (it "
                            "names the optimizer's state in checkpoints)",
                            name));
  }
  if (contains(name)) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("two optimizers are named '{}'; give each its own name", name));
  }
  if (!optimizer) {
    throw Error(ErrorCode::InvalidArgument, fmt::format("optimizer '{}' is null", name));
  }
  entries_.emplace_back(std::move(name), std::move(optimizer));
  return *this;
}

bool NamedOptimizers::contains(const std::string& name) const {
  return std::any_of(entries_.begin(), entries_.end(),
                     [&](const Entry& e) { return e.first == name; });
}

std::vector<std::string> NamedOptimizers::names() const {
  std::vector<std::string> out;
  for (const Entry& e : entries_) out.push_back(e.first);
  return out;
}

torch::optim::Optimizer& NamedOptimizers::operator[](const std::string& name) const {
  for (const Entry& e : entries_) {
    if (e.first == name) return *e.second;
  }
  throw Error(ErrorCode::InvalidArgument,
              fmt::format("there is no optimizer named '{}' (there are: {})", name,
                          entries_.empty() ? "none" : fmt::format("{}", fmt::join(names(), ", "))));
}

void Learner::init(std::shared_ptr<torch::nn::Module> model, Forward forward,
                   NamedOptimizers optimizers, ContextLoss loss) {
  if (!model || optimizers.empty() || !forward || !loss) {
    throw Error(ErrorCode::InvalidArgument, "Learner needs a model, an optimizer and a loss");
  }
  model_ = std::move(model);
  forward_ = std::move(forward);
  optimizers_ = std::move(optimizers);
  loss_ = std::move(loss);
}

Learner::ContextLoss Learner::no_loss() {
  return [](const Context&, const at::Tensor&, const at::Tensor&) -> at::Tensor {
    throw Error(ErrorCode::InvalidArgument,
                "this Learner was made with a custom_step, which computes its losses: it has no "
                "loss function of its own");
  };
}

torch::optim::Optimizer& Learner::optimizer() {
  if (optimizers_.size() != 1) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("this Learner has {} optimizers ({}): say which with optimizer(name)",
                            optimizers_.size(), fmt::join(optimizers_.names(), ", ")));
  }
  return *optimizers_.begin()->second;
}

Learner::~Learner() = default;

at::Tensor Learner::predict(const at::Tensor& x) {
  bool was_training = model_->is_training();
  model_->eval();
  at::Tensor out;
  {
    at::NoGradGuard no_grad;
    out = forward_(x);
  }
  model_->train(was_training);
  return out;
}

std::map<std::string, double> Learner::evaluate(const FitData& data, std::int64_t batch_size,
                                                const std::vector<Metric>& metrics) {
  if (batch_size <= 0) {
    throw Error(ErrorCode::InvalidArgument, "evaluate: batch_size must be positive");
  }
  bool was_training = model_->is_training();
  model_->eval();
  at::NoGradGuard no_grad;
  std::map<std::string, detail::Accumulator> acc;
  auto step = static_cast<std::size_t>(batch_size);
  // What a loss that reads the context sees: the learner and which optimizer's loss this is.
  Context ctx;
  ctx.learner = this;
  ctx.model = model_.get();
  ctx.optimizers = &optimizers_;
  ctx.set = "valid";
  for (std::size_t begin = 0; begin < data.size(); begin += step) {
    auto [x, y] = data.batch(sequential(begin, std::min(data.size(), begin + step)));
    auto n = x.size(0);
    ctx.input = x;
    ctx.target = y;
    at::Tensor pred;
    double total = 0;
    if (step_) {
      ctx.losses.clear();
      ctx.loss = ctx.pred = at::Tensor();
      step_(ctx);
      pred = ctx.pred;
    }
    for (const auto& [name, opt] : optimizers_) {
      ctx.opt_name = name;
      ctx.optimizer = opt.get();
      double value = 0;
      if (step_) {
        auto it = ctx.losses.find(name);
        const at::Tensor& l = it != ctx.losses.end() ? it->second : ctx.loss;
        if (!l.defined()) {
          throw Error(ErrorCode::InvalidArgument,
                      fmt::format("evaluate: the custom step set no loss of optimizer '{}'; set "
                                  "ctx.losses[name] for each optimizer (or ctx.loss)",
                                  name));
        }
        value = l.item<double>();
      } else {
        pred = forward_(x);
        ctx.pred = pred;
        value = loss_(ctx, pred, y).item<double>();
      }
      total += value;
      if (optimizers_.size() > 1) {
        acc["valid_loss_" + name].sum += value * static_cast<double>(n);
        acc["valid_loss_" + name].count += n;
      }
    }
    acc["valid_loss"].sum += total * static_cast<double>(n);
    acc["valid_loss"].count += n;
    for (const Metric& m : metrics) {
      detail::accumulate(acc["valid_" + m.name()], m.values(pred, y));
    }
  }
  model_->train(was_training);
  std::map<std::string, double> out;
  for (const auto& [name, a] : acc) out[name] = a.mean();
  return out;
}

FitResult Learner::fit(const FitData& data, const FitOptions& options) {
  if (run_ != nullptr) {
    throw Error(ErrorCode::InvalidArgument, "fit() was called from inside a running fit()");
  }
  if (options.epochs() < 0 || options.batch_size() <= 0) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("fit: epochs must be >= 0 and batch_size > 0 (got {} and {})",
                            options.epochs(), options.batch_size()));
  }
  if (data.size() == 0) throw Error(ErrorCode::InvalidArgument, "fit: the training data is empty");

  std::shared_ptr<ProcessGroup> group =
      options.process_group() ? options.process_group() : ProcessGroup::from_environment();
  if (group && step_) {
    throw Error(ErrorCode::Unsupported,
                "fit: a Learner with a custom_step trains on one process only for now (the step "
                "would have to average the gradients itself)");
  }
  std::uint64_t seed = options.seed() ? *options.seed() : draw_seed();
  if (group && !options.seed()) {
    // Each process drew from its own generator: the order is rank 0's.
    seed = std::stoull(group->broadcast_string(std::to_string(seed), 0, "fit(): the data order"));
  }
  detail::FitRun run(data.size(), options.shuffle(), seed);
  run.group = group;
  if (group) run.sampler.shard(group->rank(), group->size());
  run.learner = this;
  run.data = &data;
  run.options = &options;
  run.env = options.env() != nullptr ? options.env() : &Env::posix();

  std::set<std::string> names;
  std::set<const Callback*> objects;
  for (const CallbackPtr& callback : options.callbacks()) {
    if (!callback) throw Error(ErrorCode::InvalidArgument, "fit: a callback is null");
    if (!objects.insert(callback.get()).second) {
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("fit: callback '{}' is given twice; give each callback once",
                              callback->name()));
    }
    // Names identify the callbacks' state in checkpoints: a repeated one is numbered, in the
    // order given, so that a rerun of the same fit names them the same way.
    if (!names.insert(callback->name()).second) {
      std::string base = callback->name();
      for (int i = 1;; ++i) {
        std::string numbered = fmt::format("{}_{}", base, i);
        if (names.insert(numbered).second) {
          callback->name_ = numbered;
          break;
        }
      }
    }
    run.callbacks.push_back(callback);
  }
  std::stable_sort(
      run.callbacks.begin(), run.callbacks.end(),
      [](const CallbackPtr& a, const CallbackPtr& b) { return a->order() < b->order(); });

  run.metrics = options.metrics();
  const FitData* valid = options.valid_data() ? &*options.valid_data() : nullptr;
  for (const char* set : {"train", "valid"}) {
    if (std::string(set) == "valid" && valid == nullptr) continue;
    std::set<std::string> seen;
    run.monitors.push_back(std::string(set) + "_loss");
    if (optimizers_.size() > 1) {
      for (const std::string& name : optimizers_.names()) {
        seen.insert("loss_" + name);
        run.monitors.push_back(std::string(set) + "_loss_" + name);
      }
    }
    for (const Metric& m : run.metrics) {
      if (!seen.insert(m.name()).second) {
        throw Error(ErrorCode::InvalidArgument,
                    fmt::format("fit: two metrics are named '{}'{}", m.name(),
                                m.name().rfind("loss_", 0) == 0
                                    ? " (each optimizer's loss is recorded as loss_<name>)"
                                    : ""));
      }
      run.monitors.push_back(std::string(set) + "_" + m.name());
    }
  }

  // luz's fit trains a new model each time: so does a Learner made from a model_factory.
  if (remake_ && fitted_) remake_();
  fitted_ = true;
  records_ = MetricRecords();
  counters_ = TrainingCounters();
  run_ = &run;
  struct Reset {
    Learner* self;
    ~Reset() { self->run_ = nullptr; }
  } reset{this};

  auto batch_size = static_cast<std::size_t>(options.batch_size());
  Context& ctx = run.ctx;
  ctx.learner = this;
  ctx.model = model_.get();
  ctx.optimizers = &optimizers_;
  ctx.opt_name = optimizers_.begin()->first;
  ctx.optimizer = optimizers_.begin()->second.get();
  ctx.options = &options;
  ctx.records = &records_;
  ctx.env = run.env;
  ctx.epochs = options.epochs();
  ctx.monitors = run.monitors;
  ctx.process_group = group.get();
  const std::size_t processes = group ? static_cast<std::size_t>(group->size()) : 1;
  const std::size_t global_batch = batch_size * processes;
  ctx.batches_per_epoch =
      static_cast<std::int64_t>((data.size() + global_batch - 1) / global_batch);
  if (group) {
    // Every process starts from rank 0's parameters and buffers.
    std::vector<at::Tensor> tensors = model_->parameters();
    for (const at::Tensor& b : model_->buffers()) tensors.push_back(b);
    group->broadcast_tensors(tensors, 0, "fit(): rank 0's parameters");
  }

  std::ostream* out = nullptr;
  bool terminal = false;
  if (options.verbose()) {
    out = options.output() != nullptr ? options.output() : &std::cout;
    terminal = out == &std::cout && ::isatty(STDOUT_FILENO) == 1;
  }
  if (group && group->rank() != 0) out = nullptr;  // the main process shows the progress
  detail::Progress progress(out, terminal, terminal ? detail::terminal_width(STDOUT_FILENO) : 80);

  run.each("on_fit_begin", &Callback::on_fit_begin);
  if (run.resumed_after_epoch) {
    progress.message(fmt::format(
        "Resuming after epoch {} (step {}{})", *run.resumed_after_epoch, counters_.step,
        run.mid_epoch
            ? fmt::format(", batch {} of epoch {}", counters_.batch_in_epoch, counters_.epoch + 1)
            : ""));
  }

  while (!ctx.stop_requested && counters_.epoch < ctx.epochs) {
    ctx.epoch = counters_.epoch + 1;
    ctx.step = counters_.step;
    bool continuing = run.mid_epoch;
    run.mid_epoch = false;
    ctx.set = "train";
    if (!continuing) {
      run.progress.clear();
      counters_.batch_in_epoch = 0;
      ctx.metrics.clear();
      run.sampler.set_epoch(ctx.epoch - 1);
      run.each("on_epoch_begin", &Callback::on_epoch_begin);
      run.each("on_train_begin", &Callback::on_train_begin);
    }
    progress.epoch_begin(ctx.epoch, ctx.epochs, ctx.batches_per_epoch, counters_.batch_in_epoch);
    model_->train();
    run.sampler.reset();
    while (auto indices = run.sampler.next(batch_size)) {
      auto [x, y] = data.batch(*indices);
      ctx.batch = counters_.batch_in_epoch + 1;
      ctx.input = x;
      ctx.target = y;
      ctx.pred = at::Tensor();
      ctx.loss = at::Tensor();
      ctx.losses.clear();
      run.each("on_train_batch_begin", &Callback::on_train_batch_begin);
      if (step_) {
        step_(ctx);
        ++counters_.step;
        ctx.step = counters_.step;
      }
      // fit()'s own passes, one per optimizer (none with a custom step, which made them).
      std::size_t pass = 0;
      for (const auto& [name, optimizer] : step_ ? detail::kNoOptimizers : optimizers_) {
        ctx.opt_name = name;
        ctx.optimizer = optimizer.get();
        // Only this optimizer's gradients: an earlier pass's backward may have left gradients
        // on its parameters, which must not add to this pass's.
        compat::zero_grad(*optimizer);
        ctx.pred = forward_(ctx.input);
        run.each("on_train_batch_after_pred", &Callback::on_train_batch_after_pred);
        ctx.loss = loss_(ctx, ctx.pred, ctx.target);
        ctx.losses[name] = ctx.loss.detach();
        run.each("on_train_batch_after_loss", &Callback::on_train_batch_after_loss);
        run.each("on_train_batch_before_backward", &Callback::on_train_batch_before_backward);
        ctx.loss.backward();
        if (group) {
          std::vector<at::Tensor> grads;
          for (const at::Tensor& p : model_->parameters()) {
            if (p.requires_grad() && p.grad().defined()) grads.push_back(p.grad());
          }
          group->average_tensors(grads, "fit(): averaging the gradients");
        }
        run.each("on_train_batch_before_step", &Callback::on_train_batch_before_step);
        optimizer->step();
        if (++pass == optimizers_.size()) {
          // One step per batch, whatever the number of optimizers.
          ++counters_.step;
          ctx.step = counters_.step;
        }
        run.each("on_train_batch_after_step", &Callback::on_train_batch_after_step);
      }
      run.add_batch("train");
      // The batch counts as consumed before on_train_batch_end, where a checkpoint may be
      // taken: a run resumed from it must continue with the next batch.
      run.sampler.consume(indices->size());
      ++counters_.batch_in_epoch;
      counters_.samples_seen += static_cast<std::int64_t>(indices->size());
      progress.batch(counters_.batch_in_epoch, run.progress["train_loss"].mean());
      run.each("on_train_batch_end", &Callback::on_train_batch_end);
    }
    run.record_set("train");
    run.each("on_train_end", &Callback::on_train_end);

    if (valid != nullptr) {
      ctx.set = "valid";
      model_->eval();
      at::NoGradGuard no_grad;
      run.each("on_valid_begin", &Callback::on_valid_begin);
      progress.valid_begin(
          static_cast<std::int64_t>((valid->size() + global_batch - 1) / global_batch));
      std::int64_t batch = 0;
      // Each process evaluates its part; record_set() sums them.
      const std::size_t first = group ? batch_size * static_cast<std::size_t>(group->rank()) : 0;
      for (std::size_t begin = first; begin < valid->size(); begin += global_batch) {
        auto [x, y] = valid->batch(sequential(begin, std::min(valid->size(), begin + batch_size)));
        ctx.batch = ++batch;
        ctx.input = x;
        ctx.target = y;
        ctx.losses.clear();
        run.each("on_valid_batch_begin", &Callback::on_valid_batch_begin);
        if (step_) {
          ctx.loss = ctx.pred = at::Tensor();
          step_(ctx);
        }
        // As luz: each optimizer's loss, in their order.
        for (const auto& [name, optimizer] : step_ ? detail::kNoOptimizers : optimizers_) {
          ctx.opt_name = name;
          ctx.optimizer = optimizer.get();
          ctx.pred = forward_(ctx.input);
          run.each("on_valid_batch_after_pred", &Callback::on_valid_batch_after_pred);
          ctx.loss = loss_(ctx, ctx.pred, ctx.target);
          ctx.losses[name] = ctx.loss;
          run.each("on_valid_batch_after_loss", &Callback::on_valid_batch_after_loss);
        }
        run.add_batch("valid");
        progress.valid_batch(batch, run.progress["valid_loss"].mean());
        run.each("on_valid_batch_end", &Callback::on_valid_batch_end);
      }
      run.record_set("valid");
      run.each("on_valid_end", &Callback::on_valid_end);
      model_->train();
    }

    // The epoch is finished before on_epoch_end: a checkpoint taken there resumes with the
    // next epoch.
    ++counters_.epoch;
    counters_.batch_in_epoch = 0;
    ctx.set.clear();
    ctx.batch = 0;
    run.each("on_epoch_end", &Callback::on_epoch_end);
    progress.epoch_end(ctx.metrics);
  }
  run.each("on_fit_end", &Callback::on_fit_end);
  if (ctx.async_saver) ctx.async_saver->wait();  // the last background save, committed

  FitResult result;
  result.records = records_;
  result.epochs_completed = counters_.epoch;
  result.steps = counters_.step;
  result.stopped_early = ctx.stop_requested && counters_.epoch < ctx.epochs;
  result.resumed_after_epoch = run.resumed_after_epoch;
  result.model = model_;
  return result;
}

std::string FitResult::table() const {
  auto series = records.series();
  std::size_t rows = 0;
  std::vector<std::string> headers = {"epoch"};
  for (const auto& [set, metric] : series) {
    headers.push_back(set + "_" + metric);
    rows = std::max(rows, records.values(set, metric).size());
  }
  std::vector<std::size_t> widths;
  for (const std::string& h : headers) widths.push_back(std::max<std::size_t>(h.size(), 10));
  std::string out;
  for (std::size_t c = 0; c < headers.size(); ++c) {
    out += fmt::format("{}{:>{}}", c == 0 ? "" : "  ", headers[c], widths[c]);
  }
  out += '\n';
  for (std::size_t r = 0; r < rows; ++r) {
    out += fmt::format("{:>{}}", r + 1, widths[0]);
    for (std::size_t c = 0; c < series.size(); ++c) {
      const auto& values = records.values(series[c].first, series[c].second);
      std::string cell = r < values.size() ? fmt::format("{:.6f}", values[r]) : "";
      out += fmt::format("  {:>{}}", cell, widths[c + 1]);
    }
    out += '\n';
  }
  return out;
}

}  // namespace torchpoint
