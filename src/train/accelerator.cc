#include "torchpoint/accelerator.h"

#include <fmt/format.h>
#include <torch/cuda.h>
#include <torch/nn/utils/clip_grad.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <exception>
#include <iostream>
#include <limits>
#include <map>
#include <unordered_set>

#include "checkpoint/committed.h"
#include "compat/torch_compat.h"
#include "dist/zero.h"
#include "format/directory_fill.h"
#include "format/directory_save.h"
#include "format/shards.h"
#include "io/atomic_commit.h"
#include "io/filename.h"
#include "python/accelerate_files.h"
#include "torchpoint/accelerate_interop.h"
#include "torchpoint/checkpoint_dir.h"
#include "torchpoint/checkpoint_manager.h"
#include "torchpoint/error.h"
#include "torchpoint/module_state.h"
#include "torchpoint/optimizer_state.h"
#include "torchpoint/retention.h"
#include "torchpoint/stateful_set.h"

namespace torchpoint {
namespace {

// Whether `param` has a gradient with a non-zero value among its first 4096 elements (a bounded
// look, whatever the parameter's size).
bool has_gradient(const at::Tensor& param) {
  const at::Tensor& g = param.grad();
  if (!g.defined() || g.numel() == 0) return false;
  return g.reshape({-1}).slice(0, 0, 4096).ne(0).any().item<bool>();
}

// Reads and writes LRScheduler::step_count_, which LibTorch declares protected: a pointer to
// that member may be formed in a class derived from LRScheduler, and then used on any one.
struct StepCountAccess : torch::optim::LRScheduler {
  static unsigned torch::optim::LRScheduler::*member() { return &StepCountAccess::step_count_; }
};

// LibTorch's StepLR keeps its options private. An explicit instantiation may name a private
// member ([temp.spec.general]), and a friend it defines hands the pointer out: the one standard
// way to read them, needed because Python's StepLR cannot continue without them.
template <auto kMember, typename Tag>
struct PrivateMember {
  friend constexpr auto member_pointer(Tag) { return kMember; }
};
struct StepSizeTag {
  friend constexpr auto member_pointer(StepSizeTag);
};
struct GammaTag {
  friend constexpr auto member_pointer(GammaTag);
};
template struct PrivateMember<&torch::optim::StepLR::step_size_, StepSizeTag>;
template struct PrivateMember<&torch::optim::StepLR::gamma_, GammaTag>;

}  // namespace

namespace detail {

StateDict libtorch_step_lr_state(const torch::optim::StepLR& scheduler) {
  StateDict s;
  s.set_description("torch::optim::StepLR");
  s.set("type", "torch::optim::StepLR");
  s.set("step_count", static_cast<std::uint64_t>(scheduler.*StepCountAccess::member()));
  s.set("step_size", static_cast<std::uint64_t>(scheduler.*member_pointer(StepSizeTag{})));
  s.set("gamma", scheduler.*member_pointer(GammaTag{}));
  return s;
}

void load_libtorch_step_lr_state(torch::optim::StepLR& scheduler, const StateDict& state) {
  if (!state.contains("type") || state.get<std::string>("type") != "torch::optim::StepLR") {
    throw Error(ErrorCode::Incompatible,
                fmt::format("{} is not the state of a torch::optim::StepLR: prepare the same "
                            "kind of scheduler as the run that saved it",
                            state.description()));
  }
  auto count = state.get<std::uint64_t>("step_count");
  if (count > std::numeric_limits<unsigned>::max()) {
    throw Error(ErrorCode::Corruption,
                fmt::format("{}: step_count {} is out of range", state.description(), count));
  }
  // LibTorch's options cannot be set after construction: a state of other options (absent
  // before torchpoint recorded them) would continue another schedule.
  const std::uint64_t step_size = scheduler.*member_pointer(StepSizeTag{});
  const double gamma = scheduler.*member_pointer(GammaTag{});
  if ((state.contains("step_size") && state.get<std::uint64_t>("step_size") != step_size) ||
      (state.contains("gamma") && state.get<double>("gamma") != gamma)) {
    throw Error(ErrorCode::Incompatible,
                fmt::format("{}: it was saved by a torch::optim::StepLR(step_size {}, gamma {}), "
                            "but this one has step_size {}, gamma {}, which LibTorch cannot "
                            "change: build the StepLR with the saved options",
                            state.description(), state.get<std::uint64_t>("step_size"),
                            state.get<double>("gamma"), step_size, gamma));
  }
  scheduler.*StepCountAccess::member() = static_cast<unsigned>(count);
}

}  // namespace detail

RemovableHandle detail::HookList::add(Hook hook, bool sees_models) {
  const std::uint64_t id = next_id++;
  hooks.push_back({id, std::move(hook), sees_models});
  // A weak reference: the handle may outlive the Accelerator.
  return RemovableHandle(weak_from_this(), id);
}

std::vector<detail::HookList::Hook> detail::HookList::snapshot() const {
  std::vector<Hook> out;
  out.reserve(hooks.size());
  for (const Entry& entry : hooks) out.push_back(entry.hook);
  return out;
}

bool detail::HookList::any_sees_models() const {
  return std::any_of(hooks.begin(), hooks.end(), [](const Entry& e) { return e.sees_models; });
}

void RemovableHandle::remove() {
  std::shared_ptr<detail::HookList> list = list_.lock();
  if (!list) return;
  std::erase_if(list->hooks, [&](const auto& entry) { return entry.id == id_; });
  list_.reset();
}

RemovableHandle Accelerator::register_save_state_pre_hook(
    std::function<void(const std::string&)> hook) {
  return save_hooks_->add(
      [hook = std::move(hook)](ModelList&, std::vector<StateDict>*, const std::string& dir) {
        hook(dir);
      },
      /*sees_models=*/false);
}

RemovableHandle Accelerator::register_save_state_pre_hook(
    std::function<void(ModelList&, std::vector<StateDict>&, const std::string&)> hook) {
  return save_hooks_->add(
      [hook = std::move(hook)](ModelList& models, std::vector<StateDict>* weights,
                               const std::string& dir) { hook(models, *weights, dir); },
      /*sees_models=*/true);
}

RemovableHandle Accelerator::register_load_state_pre_hook(
    std::function<void(const std::string&)> hook) {
  return load_hooks_->add(
      [hook = std::move(hook)](ModelList&, std::vector<StateDict>*, const std::string& dir) {
        hook(dir);
      },
      /*sees_models=*/false);
}

RemovableHandle Accelerator::register_load_state_pre_hook(
    std::function<void(ModelList&, const std::string&)> hook) {
  return load_hooks_->add([hook = std::move(hook)](ModelList& models, std::vector<StateDict>*,
                                                   const std::string& dir) { hook(models, dir); },
                          /*sees_models=*/true);
}

StateDict Accelerator::ModuleAdapter::state_dict() const { return module_state_dict(*module); }
void Accelerator::ModuleAdapter::load_state_dict(const StateDict& state) {
  load_module_state_dict(*module, state);
}
StateDict Accelerator::OptimizerAdapter::state_dict() const {
  return optimizer_state_dict(*optimizer);
}
void Accelerator::OptimizerAdapter::load_state_dict(const StateDict& state) {
  load_optimizer_state_dict(*optimizer, state);
}

Accelerator::Accelerator(ProjectConfiguration config, Env& env, std::shared_ptr<ProcessGroup> group)
    : config_(std::move(config)), env_(env), group_(std::move(group)) {
  if (config_.total_limit() && *config_.total_limit() < 1) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("total_limit must be at least 1, not {}", *config_.total_limit()));
  }
  if (config_.iteration() < 0) {
    throw Error(ErrorCode::InvalidArgument, "iteration must not be negative");
  }
}

struct Accelerator::BackwardCounts {
  std::atomic<bool> inside{false};       // backward() is running a backward pass
  std::atomic<std::int64_t> outside{0};  // passes through a watched parameter, not from it
};

Accelerator::~Accelerator() {
  async_.reset();  // waits for a save in flight, which uses this object's members
  for (Watched& w : hooked_) {
    try {
      w.param.remove_hook(w.hook);
    } catch (const std::exception&) {
      // The parameter's hooks were replaced meanwhile; nothing left to remove.
    }
  }
}

void Accelerator::watch(torch::optim::Optimizer& optimizer) {
  if (!backward_counts_) backward_counts_ = std::make_shared<BackwardCounts>();
  for (auto& group : optimizer.param_groups()) {
    for (const at::Tensor& p : group.params()) {
      if (!p.requires_grad()) continue;
      std::shared_ptr<BackwardCounts> counts = backward_counts_;
      at::Tensor param = p;
      unsigned id = param.register_hook([counts](const at::Tensor&) {
        if (!counts->inside.load()) counts->outside.fetch_add(1);
      });
      hooked_.push_back({param, id});
      return;
    }
  }
}

void Accelerator::check_no_step_on_scaled_gradients(bool saving) {
  if (!scaled_pending_) return;
  if (!saving) {
    bool cleared = false;
    for (const Watched& w : hooked_) {
      cleared = cleared || !w.param.grad().defined() || (w.had_gradient && !has_gradient(w.param));
    }
    if (!cleared) return;  // accumulating: more backward() before the step
  }
  // The parameters may hold a step taken on scaled gradients: every later save and backward()
  // refuses too.
  const char* where = saving ? "save_state()" : "backward()";
  throw Error(ErrorCode::InvalidArgument,
              fmt::format("{}: the gradients of the last backward() are multiplied by the "
                          "GradScaler's scale and no optimizer_step() consumed them{}. With a "
                          "GradScaler prepared, step with acc.optimizer_step(optimizer) (it "
                          "unscales, skips inf/NaN steps and updates the scale), not "
                          "optimizer.step(), and save at step boundaries; resume from the last "
                          "checkpoint, which no such step reached",
                          where, saving ? "" : " before they were cleared"));
}

void Accelerator::warn_about_uncounted_backwards() {
  if (warned_uncounted_ || !backward_counts_ || backward_counts_->outside.load() == 0) return;
  warned_uncounted_ = true;
  std::fprintf(stderr,
               "torchpoint: warning: %lld backward pass(es) did not go through "
               "Accelerator::backward(loss): step() counts only those (it is %lld), so call "
               "acc.backward(loss) instead of loss.backward()\n",
               static_cast<long long>(backward_counts_->outside.load()),
               static_cast<long long>(step_));
}

void Accelerator::log(const std::map<std::string, double>& values) {
  for (const auto& [name, value] : values) {
    if (name.empty()) throw Error(ErrorCode::InvalidArgument, "log(): a metric needs a name");
  }
  for (const auto& [name, value] : values) {
    logged_metrics_[name] = std::isfinite(value) ? Json(value) : Json(nullptr);
  }
}

torch::Device Accelerator::device() const {
  return torch::cuda::is_available() ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU);
}

void Accelerator::set_zero_stage(int stage) {
  if (stage < 0 || stage > 2) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("set_zero_stage({}): the stages are 0 (nothing sharded), 1 (the "
                            "optimizer state partitioned) and 2 (the gradients too)",
                            stage));
  }
  if (!optimizers_.empty()) {
    throw Error(ErrorCode::InvalidArgument,
                "set_zero_stage() after prepare(optimizer): choose the stage before preparing "
                "the optimizers, which it partitions");
  }
  zero_stage_ = stage;
}

void Accelerator::shard(torch::optim::Optimizer& optimizer) {
  zero_.push_back(zero_stage_ == 0 ? nullptr
                                   : std::make_unique<detail::ZeroOptimizer>(
                                         optimizer, group_.get(), zero_stage_));
  // State the optimizer already holds (it stepped, or loaded a state, before prepare()): each
  // process keeps its part, and the user's optimizer none, as after every step under ZeRO, so
  // that no save writes a stale whole copy next to the parts.
  if (zero_.back() && !optimizer.state().empty()) zero_.back()->take_from_user();
}

detail::ZeroOptimizer* Accelerator::zero_of(const torch::optim::Optimizer& optimizer) const {
  for (std::size_t i = 0; i < optimizers_.size(); ++i) {
    if (optimizers_[i] == &optimizer) return zero_[i].get();
  }
  return nullptr;
}

std::int64_t Accelerator::optimizer_state_bytes() const {
  std::int64_t bytes = 0;
  for (std::size_t i = 0; i < optimizers_.size(); ++i) {
    if (zero_[i]) {
      bytes += zero_[i]->state_bytes();
      continue;
    }
    StateDict state = optimizer_state_dict(*optimizers_[i]);
    for (const auto& [name, t] : state.to_container().tensors) {
      if (name.rfind("state.", 0) == 0) bytes += static_cast<std::int64_t>(t.nbytes());
    }
  }
  return bytes;
}

GradScaler& Accelerator::prepare_one(GradScaler& scaler) {
  if (scaler_ != nullptr) {
    throw Error(ErrorCode::InvalidArgument, "a GradScaler is already prepared; prepare only one");
  }
  add_component("scaler", AnyStateful::ref(scaler));
  scaler_ = &scaler;
  return scaler;
}

void Accelerator::add_component(const std::string& kind, AnyStateful object) {
  components_.push_back({kind, std::move(object)});
}

void Accelerator::add_model(std::shared_ptr<torch::nn::Module> module) {
  add_component("model", AnyStateful::value(ModuleAdapter{module}));
  models_.push_back(module);
  if (!group_) return;
  // Every process starts from the main process's parameters and buffers (its random
  // initialisation, or what it loaded).
  std::vector<at::Tensor> tensors = module->parameters();
  for (const at::Tensor& b : module->buffers()) tensors.push_back(b);
  group_->broadcast_tensors(tensors, 0, "prepare(model): the main process's parameters");
}

void Accelerator::add_sampler(AnyStateful sampler, ResumableSampler& shardable) {
  add_component("sampler", std::move(sampler));
  if (group_) shardable.shard(group_->rank(), group_->size());
  samplers_.push_back(&shardable);
}

void Accelerator::set_gradient_accumulation_steps(int steps) {
  if (steps < 1) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("set_gradient_accumulation_steps({}): the number of iterations whose "
                            "gradients make one optimizer step must be at least 1",
                            steps));
  }
  accumulation_steps_ = steps;
}

Accelerator::NoSync Accelerator::accumulate() {
  // In the body of an epoch's last batch (the loader counted it, its loop has not ended).
  bool last_batch = false;
  for (const ResumableSampler* sampler : samplers_) {
    last_batch = last_batch || sampler->consumed_but_unfinished();
  }
  if (last_batch) {
    accumulation_count_ = 0;
    sync_gradients_ = true;
  } else {
    ++accumulation_count_;
    sync_gradients_ = accumulation_count_ % accumulation_steps_ == 0;
  }
  return NoSync(*this, /*active=*/!sync_gradients_);
}

void Accelerator::average_gradients() {
  std::vector<at::Tensor> grads;
  std::unordered_set<const void*> seen;
  // Stage 2 reduce-scatters its optimizers' gradients instead (reduce_gradients()).
  for (std::size_t i = 0; i < optimizers_.size(); ++i) {
    if (!zero_[i] || zero_[i]->stage() != 2) continue;
    for (const auto& group : optimizers_[i]->param_groups()) {
      for (const at::Tensor& p : group.params()) seen.insert(p.unsafeGetTensorImpl());
    }
  }
  for (const auto& model : models_) {
    for (const at::Tensor& p : model->parameters()) {
      if (!p.requires_grad() || !p.grad().defined() ||
          !seen.insert(p.unsafeGetTensorImpl()).second) {
        continue;
      }
      grads.push_back(p.grad());
    }
  }
  group_->average_tensors(grads, "backward(): averaging the gradients");
}

void Accelerator::wait_for_everyone() {
  if (group_) group_->barrier("wait_for_everyone()");
}

at::Tensor Accelerator::gather(const at::Tensor& tensor) {
  if (!group_) return tensor;
  at::Tensor t = tensor.dim() == 0 ? tensor.reshape({1}) : tensor;
  return at::cat(group_->allgather(t.contiguous(), "gather()"), 0);
}

at::Tensor Accelerator::reduce(const at::Tensor& tensor, const std::string& op) {
  if (op != "sum" && op != "mean") {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("reduce(): unknown reduction '{}'; use \"sum\" or \"mean\"", op));
  }
  at::Tensor out = tensor.contiguous().clone();
  if (group_) group_->allreduce(out, ProcessGroup::ReduceOp::Sum, "reduce()");
  return op == "mean" ? out.div(num_processes()) : out;
}

void Accelerator::print(const std::string& text) const {
  if (is_main_process()) std::cout << text << std::endl;
}

std::vector<std::string> Accelerator::component_names() const {
  std::map<std::string, int> seen;
  std::vector<std::string> names;
  for (const Component& c : components_) {
    int n = seen[c.kind]++;
    if (c.kind == "custom") {
      names.push_back(fmt::format("{}{}", detail::kCustomPrefix, n));
    } else {
      names.push_back(n == 0 ? c.kind : fmt::format("{}_{}", c.kind, n));
    }
  }
  return names;
}

void Accelerator::backward(const at::Tensor& loss) {
  check_no_step_on_scaled_gradients(/*saving=*/false);
  warn_about_uncounted_backwards();
  struct Inside {  // marks the pass as ours for the counting hooks, also when it throws
    BackwardCounts* counts;
    explicit Inside(BackwardCounts* c) : counts(c) {
      if (counts) counts->inside = true;
    }
    ~Inside() {
      if (counts) counts->inside = false;
    }
  } inside(backward_counts_.get());
  // Accelerate's mean over the accumulated iterations.
  const at::Tensor scaled = accumulation_steps_ > 1 ? loss / accumulation_steps_ : loss;
  if (scaler_ != nullptr) {
    scaler_->scale(scaled).backward();
  } else {
    scaled.backward();
  }
  if (group_ && !no_sync_) average_gradients();
  if (!no_sync_) {
    for (auto& z : zero_) {
      if (z) z->reduce_gradients();
    }
  }
  unsynced_backward_ = no_sync_;
  if (scaler_ != nullptr) {
    scaled_pending_ = true;  // until optimizer_step() consumes these gradients
    for (Watched& w : hooked_) w.had_gradient = has_gradient(w.param);
  }
  ++step_;
}

std::vector<bool> Accelerator::optimizer_step(
    std::initializer_list<std::reference_wrapper<torch::optim::Optimizer>> optimizers) {
  std::vector<bool> stepped;
  if (!sync_gradients_) return std::vector<bool>(optimizers.size(), false);  // accumulating
  unsynced_backward_ = false;
  for (torch::optim::Optimizer& optimizer : optimizers) stepped.push_back(step_one(optimizer));
  if (scaler_ != nullptr && !stepped.empty()) {
    scaler_->update();
    scaled_pending_ = false;
  }
  return stepped;
}

void Accelerator::unscale_gradients() {
  if (scaler_ == nullptr || !sync_gradients_) return;
  for (std::size_t i = 0; i < optimizers_.size(); ++i) {
    // Stage 2 holds only this process's part of the gradients, in its local optimizer.
    torch::optim::Optimizer& holder =
        zero_[i] && zero_[i]->stage() == 2 ? zero_[i]->local() : *optimizers_[i];
    scaler_->unscale_(holder);
  }
}

bool Accelerator::step_one(torch::optim::Optimizer& optimizer) {
  detail::ZeroOptimizer* zero = zero_of(optimizer);
  if (zero == nullptr) {
    if (scaler_ == nullptr) {
      optimizer.step();
      return true;
    }
    return scaler_->step(optimizer);
  }
  if (scaler_ == nullptr || !scaler_->is_enabled()) {
    zero->step();
    return true;
  }
  // The scaler checks the gradients this process holds (stage 1: the whole ones, the same on
  // every process; stage 2: its part) and the processes agree, so all skip or all step.
  torch::optim::Optimizer& holder = zero->stage() == 2 ? zero->local() : optimizer;
  if (!scaler_->unscaled(holder)) scaler_->unscale_(holder);
  const bool inf = zero->found_inf_anywhere(scaler_->found_inf(holder));
  if (!inf) zero->step();
  return !inf;
}

namespace {

void check_clipping_allowed(const GradScaler* scaler, bool sync_gradients, const char* what) {
  if (scaler == nullptr || !scaler->is_enabled() || sync_gradients) return;
  throw Error(ErrorCode::InvalidArgument,
              fmt::format("{}() on an iteration that accumulates (inside accumulate(), "
                          "sync_gradients() is false): the gradients are still multiplied by the "
                          "GradScaler's scale and hold only part of the step. Clip when "
                          "acc.sync_gradients() is true, before the optimizer steps",
                          what));
}

}  // namespace

double Accelerator::clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                                    double norm_type) {
  check_clipping_allowed(scaler_, sync_gradients_, "clip_grad_norm_");
  unscale_gradients();
  for (auto& z : zero_) {
    // Stage 2: the norm over every process's part of the gradients, each part clipped.
    if (z && z->stage() == 2) return z->clip_grad_norm(max_norm, norm_type);
  }
  return torch::nn::utils::clip_grad_norm_(parameters, max_norm, norm_type);
}

void Accelerator::clip_grad_value_(const std::vector<at::Tensor>& parameters, double clip_value) {
  check_clipping_allowed(scaler_, sync_gradients_, "clip_grad_value_");
  unscale_gradients();
  for (auto& z : zero_) {
    if (!z || z->stage() != 2) continue;
    at::NoGradGuard no_grad;
    for (const auto& piece : z->pieces()) {
      if (piece.view.grad().defined()) piece.view.grad().clamp_(-clip_value, clip_value);
    }
    return;
  }
  torch::nn::utils::clip_grad_value_(parameters, clip_value);
}

bool AcceleratedOptimizerBase::step() {
  const bool synchronizing = accelerator_->sync_gradients();
  const bool stepped = accelerator_->optimizer_step(*optimizer_);
  step_was_skipped_ = synchronizing && !stepped;
  return stepped;
}

void AcceleratedOptimizerBase::zero_grad() {
  if (accelerator_->sync_gradients()) optimizer_->zero_grad();
}

bool Accelerator::optimizer_step(torch::optim::Optimizer& optimizer) {
  if (!sync_gradients_) return false;  // accumulating: a later iteration steps
  unsynced_backward_ = false;
  if (scaler_ == nullptr) return step_one(optimizer);
  bool stepped = step_one(optimizer);
  scaler_->update();
  scaled_pending_ = false;
  return stepped;
}

}  // namespace torchpoint
