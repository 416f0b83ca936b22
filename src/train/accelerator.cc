#include "torchpoint/accelerator.h"

#include <fmt/format.h>
#include <torch/cuda.h>

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
#include "format/directory_fill.h"
#include "format/directory_save.h"
#include "format/shards.h"
#include "io/atomic_commit.h"
#include "io/filename.h"
#include "train/accelerate_files.h"
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

constexpr const char* kRandomStatesPrefix = "random_states_";
constexpr const char* kCustomPrefix = "custom_checkpoint_";
// The RNG file of process `rank`.
std::string random_states_name(int rank) { return fmt::format("{}{}", kRandomStatesPrefix, rank); }

std::string join_names(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

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

}  // namespace

namespace detail {

StateDict libtorch_step_lr_state(const torch::optim::StepLR& scheduler) {
  StateDict s;
  s.set_description("torch::optim::StepLR");
  s.set("type", "torch::optim::StepLR");
  s.set("step_count", static_cast<std::uint64_t>(scheduler.*StepCountAccess::member()));
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
  scheduler.*StepCountAccess::member() = static_cast<unsigned>(count);
}

}  // namespace detail

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
      names.push_back(fmt::format("{}{}", kCustomPrefix, n));
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
  for (torch::optim::Optimizer& optimizer : optimizers) {
    if (scaler_ == nullptr) {
      optimizer.step();
      stepped.push_back(true);
    } else {
      stepped.push_back(scaler_->step(optimizer));
    }
  }
  if (scaler_ != nullptr && !stepped.empty()) {
    scaler_->update();
    scaled_pending_ = false;
  }
  return stepped;
}

bool Accelerator::optimizer_step(torch::optim::Optimizer& optimizer) {
  if (!sync_gradients_) return false;  // accumulating: a later iteration steps
  unsynced_backward_ = false;
  if (scaler_ == nullptr) {
    optimizer.step();
    return true;
  }
  bool stepped = scaler_->step(optimizer);
  scaler_->update();
  scaled_pending_ = false;
  return stepped;
}

std::string Accelerator::checkpoints_dir() const {
  if (config_.project_dir().empty()) {
    throw Error(ErrorCode::InvalidArgument,
                "automatic checkpoint naming needs a project directory: "
                "ProjectConfiguration().project_dir(\"runs/exp1\")");
  }
  return join_path(config_.project_dir(), "checkpoints");
}

std::vector<std::pair<std::int64_t, std::string>> Accelerator::list_checkpoints() const {
  std::vector<std::pair<std::int64_t, std::string>> out;
  for (auto& [number, path] : detail::committed_checkpoints(checkpoints_dir(), env_)) {
    out.emplace_back(static_cast<std::int64_t>(number), std::move(path));
  }
  return out;
}

std::string Accelerator::save_state(const std::string& output_dir, bool overwrite) {
  wait_for_checkpoint();
  if (group_) return save_state_distributed(output_dir, overwrite);
  return save_state_with(output_dir, overwrite, nullptr, nullptr);
}

SaveHandle Accelerator::save_state_async(const std::string& output_dir, bool overwrite) {
  if (group_) {
    throw Error(ErrorCode::Unsupported,
                "save_state_async() runs on one process only for now: with several processes, "
                "call save_state()");
  }
  if (!async_) async_ = std::make_unique<AsyncCheckpointer>(env_);
  SaveHandle handle;
  save_state_with(output_dir, overwrite, async_.get(), &handle);
  return handle;
}

void Accelerator::wait_for_checkpoint() {
  if (async_) async_->wait();
}

std::string Accelerator::begin_save(const std::string& output_dir) {
  if (output_dir.empty() && !config_.automatic_checkpoint_naming()) {
    throw Error(ErrorCode::InvalidArgument,
                "save_state() needs an output directory: pass one, or use "
                "ProjectConfiguration().project_dir(...).automatic_checkpoint_naming(true)");
  }
  if (!sync_gradients_ || unsynced_backward_) {
    throw Error(
        ErrorCode::InvalidArgument,
        !sync_gradients_
            ? fmt::format("save_state() on iteration {} of a gradient accumulation over {}, "
                          "which does not step: the gradients accumulated since the last "
                          "optimizer step are not part of a checkpoint, so a run resumed from "
                          "it would lose them; save when acc.sync_gradients() is true",
                          accumulation_count_ % accumulation_steps_, accumulation_steps_)
            : std::string("save_state() after a backward() under no_sync() that no "
                          "synchronized backward() or optimizer step followed: those "
                          "gradients are not part of a checkpoint, so a run resumed from it "
                          "would lose them; save after the optimizer step"));
  }
  check_no_step_on_scaled_gradients(/*saving=*/true);
  warn_about_uncounted_backwards();
  return output_dir.empty() ? join_path(checkpoints_dir(), checkpoint_name(config_.iteration()))
                            : output_dir;
}

SaveDirectoryOptions Accelerator::directory_options(bool overwrite) const {
  SaveDirectoryOptions options;
  options.overwrite = overwrite;
  if (!save_hooks_.empty()) {
    // A copy: an asynchronous save runs them while the loop may register more.
    options.before_components = [hooks = save_hooks_](const std::string& dir) {
      for (const auto& hook : hooks) hook(dir);
    };
  }
  options.shard_size = config_.shard_size();
  if (config_.incremental()) options.link_from = last_checkpoint_;
  // The tensors no optimizer step changes: frozen parameters and buffers (Accelerate's and
  // Hugging Face's sharding keeps none apart; here they fill shards that can be shared).
  std::vector<std::string> names = component_names();
  std::size_t model = 0;
  for (std::size_t i = 0; i < components_.size(); ++i) {
    if (components_[i].kind != "model" || model >= models_.size()) continue;
    const torch::nn::Module& module = *models_[model++];
    for (const auto& item : module.named_parameters(/*recurse=*/true)) {
      if (!item.value().requires_grad()) options.frozen.insert(names[i] + "/" + item.key());
    }
    for (const auto& item : module.named_buffers(/*recurse=*/true)) {
      options.frozen.insert(names[i] + "/" + item.key());
    }
  }
  return options;
}

std::string Accelerator::save_state_with(const std::string& output_dir, bool overwrite,
                                         AsyncCheckpointer* saver, SaveHandle* handle) {
  if (saver != nullptr) saver->wait();  // the previous save's error first, if nobody took it
  const bool automatic = output_dir.empty();
  const std::string path = begin_save(output_dir);

  std::vector<std::string> names = component_names();
  std::vector<torchpoint::Component> files;
  files.reserve(components_.size() + 1);
  for (std::size_t i = 0; i < components_.size(); ++i) {
    files.push_back({names[i], components_[i].object.state_dict().to_container()});
  }
  files.push_back({random_states_name(0), rng_.state_dict().to_container()});
  CheckpointInfo info;
  info.step = step_;
  info.iteration = config_.iteration();
  info.metadata = {{"accelerator", {{"step", step_}, {"components", names}}}};
  if (!logged_metrics_.empty()) info.metadata["metrics"] = logged_metrics_;
  SaveDirectoryOptions options = directory_options(overwrite);
  if (saver != nullptr) {
    std::function<void()> after_commit;
    if (automatic) after_commit = [this, path] { apply_total_limit(path); };
    *handle = saver->save_directory(path, files, info, options, std::move(after_commit));
    if (automatic) config_.iteration(config_.iteration() + 1);
    // The next save waits for this one first; if it failed, the next finds nothing to link.
    last_checkpoint_ = path;
    return path;
  }
  save_directory(path, files, info, env_, options);
  last_checkpoint_ = path;

  if (automatic) {
    config_.iteration(config_.iteration() + 1);
    apply_total_limit(path);
  }
  return path;
}

std::string Accelerator::save_state_distributed(const std::string& output_dir, bool overwrite) {
  const bool automatic = output_dir.empty();
  const std::string path = begin_save(output_dir);
  const int rank = group_->rank(), world = group_->size();
  const std::vector<std::string> names = component_names();
  const SaveDirectoryOptions options = directory_options(overwrite);

  // 1. The main process opens the checkpoint: the lock, a temporary directory, the save hooks.
  std::unique_ptr<DirectorySave> save;
  Json opened = Json::parse(group_->decided_by_main(
      [&] {
        std::vector<std::string> all = names;
        for (int r = 0; r < world; ++r) all.push_back(random_states_name(r));
        save = std::make_unique<DirectorySave>(env_, path, all, options);
        return Json{{"dir", save->temp_path()}, {"path", path}}.dump();
      },
      "save_state(): opening the checkpoint directory"));
  // From here a number is used up, as by an asynchronous save: one that fails leaves it unused.
  if (automatic) config_.iteration(config_.iteration() + 1);

  // 2. Every process writes and fsyncs its own files there: the main process the components,
  // each process its RNG states. All succeed, or every process throws (and the main process's
  // DirectorySave removes the temporary directory).
  Json files = Json::array();
  std::exception_ptr failure;
  try {
    const std::string dir = opened.at("dir").get<std::string>();
    std::vector<torchpoint::Component> mine;
    if (rank == 0) {
      for (std::size_t i = 0; i < components_.size(); ++i) {
        mine.push_back({names[i], components_[i].object.state_dict().to_container()});
      }
    }
    mine.push_back({random_states_name(rank), rng_.state_dict().to_container()});
    // Only the main process writes the shardable components.
    LinkSource link_source(env_, rank == 0 ? options.link_from : std::string());
    for (const WrittenComponent& f : write_components(env_, dir, mine, options, &link_source)) {
      files.push_back(f.to_json());
    }
  } catch (const std::exception&) {
    failure = std::current_exception();
  }
  group_->agree(failure, fmt::format("save_state() of {} (nothing was committed)", path));

  // 3. The main process, holding every process's report of what it wrote (sizes and checksums),
  // writes the manifest listing them all and commits.
  std::vector<std::string> reports =
      group_->gather_strings(files.dump(), 0, "save_state(): sending the files written");
  group_->decided_by_main(
      [&]() -> std::string {
        std::vector<WrittenComponent> written;
        for (int r = 0; r < world; ++r) {
          for (const Json& f : Json::parse(reports[static_cast<std::size_t>(r)])) {
            written.push_back(WrittenComponent::from_json(f, fmt::format("rank {}", r)));
          }
        }
        CheckpointInfo info;
        info.step = step_;
        info.iteration = config_.iteration() - (automatic ? 1 : 0);
        info.metadata = {
            {"accelerator", {{"step", step_}, {"components", names}, {"world_size", world}}}};
        if (!logged_metrics_.empty()) info.metadata["metrics"] = logged_metrics_;
        save->commit(written, info);
        save.reset();  // releases the lock before retention takes it
        if (automatic) apply_total_limit(path);
        return "";
      },
      "save_state(): committing the checkpoint");
  last_checkpoint_ = opened.at("path").get<std::string>();
  return last_checkpoint_;
}

void Accelerator::apply_total_limit(const std::string& just_written) {
  if (!config_.total_limit()) return;
  std::string dir = checkpoints_dir();
  ProjectLock lock(env_, dir);
  auto all = list_checkpoints();
  const auto limit = static_cast<std::size_t>(*config_.total_limit());
  if (all.size() <= limit) return;
  std::optional<std::uint64_t> resumed_number;
  if (!resumed_from_.empty()) resumed_number = parse_checkpoint_name(base_name(resumed_from_));
  // The library's retention policy with keep_last = total_limit. Committed checkpoints count
  // as valid without being read (verifying every one at each save would read them all), except
  // those that were there, newer than the one this run resumed from (after load_state() of an
  // older one): they hold progress this run lacks, so they are pinned, unless their own
  // checksums prove them corrupt, in which case they go. The checkpoint resumed from is not
  // pinned: total_limit is a maximum.
  std::vector<RetentionEntry> entries;
  for (const auto& [number, path] : all) {
    RetentionEntry e;
    e.name = path;
    const bool newer_than_resumed = resumed_number &&
                                    static_cast<std::uint64_t>(number) > *resumed_number &&
                                    number < first_own_number_ && path != just_written;
    if (newer_than_resumed) {
      if (verify(path, env_).proven_corrupt()) {
        e.status = CheckpointStatus::Corrupt;
      } else {
        e.pinned = "newer than the checkpoint this run resumed from";
      }
    }
    entries.push_back(std::move(e));
  }
  std::vector<RetentionDecision> decisions =
      plan_retention(entries, RetentionPolicy().keep_last(limit).delete_corrupt(true));
  for (std::size_t i = 0; i < entries.size(); ++i) {
    if (decisions[i].keep) continue;
    ListedCheckpoint doomed;
    doomed.name = base_name(entries[i].name);
    doomed.path = entries[i].name;
    doomed.is_directory = true;
    remove_checkpoint(dir, doomed, env_);
  }
}

std::optional<LoadStateReport> Accelerator::try_load_state() {
  wait_for_checkpoint();
  if (list_checkpoints().empty()) return std::nullopt;
  return load_state();
}

LoadStateReport Accelerator::load_state(const std::string& input_dir) {
  wait_for_checkpoint();
  LoadStateReport report;
  auto choose = [&]() -> std::string {
    if (!input_dir.empty()) return input_dir;
    std::string newest =
        detail::newest_valid(detail::committed_checkpoints(checkpoints_dir(), env_), env_,
                             &report.skipped)
            .value_or("");
    if (newest.empty()) {
      throw Error(ErrorCode::NotFound,
                  fmt::format("no valid checkpoint under {}{}; save one with save_state() first",
                              checkpoints_dir(),
                              report.skipped.empty() ? ""
                                                     : fmt::format(" ({} invalid ones skipped)",
                                                                   report.skipped.size())));
    }
    return newest;
  };
  // With several processes the main process chooses, so that all load the same one.
  const std::string path =
      group_ ? group_->decided_by_main(choose, "load_state(): choosing the checkpoint") : choose();
  for (const auto& hook : load_hooks_) hook(path);
  if (is_accelerate_checkpoint(path, env_)) return load_accelerate_state(path, std::move(report));

  // The models' parameters and buffers are read straight into their memory, after everything
  // else is restored: no copy of a model is made or held (see load_directory_filling).
  std::vector<std::string> names = component_names();
  std::map<std::string, NamedTensors> fill;
  for (std::size_t i = 0, model = 0; i < components_.size(); ++i) {
    if (components_[i].kind != "model" || model >= models_.size()) continue;
    const torch::nn::Module& module = *models_[model++];
    NamedTensors& tensors = fill[names[i]];
    for (const auto& item : module.named_parameters(/*recurse=*/true)) {
      tensors.emplace_back(item.key(), item.value());
    }
    for (const auto& item : module.named_buffers(/*recurse=*/true)) {
      tensors.emplace_back(item.key(), item.value());
    }
  }
  DirectoryFill loaded;
  DirectoryCheckpoint& checkpoint = loaded.checkpoint;
  std::exception_ptr failure;
  try {
    loaded = load_directory_filling(path, env_, fill);
  } catch (const std::exception&) {
    if (!group_) throw;
    failure = std::current_exception();
  }
  // Nothing changes on any process unless every process could read and verify it.
  if (group_) group_->agree(failure, fmt::format("load_state(): reading {}", path));
  const int rank = process_index();
  int saved_world = 1;
  {
    const Json& meta = checkpoint.info.metadata;
    if (meta.contains("accelerator") && meta["accelerator"].contains("world_size")) {
      saved_world = meta["accelerator"]["world_size"].get<int>();
    }
  }
  std::size_t saved_custom = 0, registered_custom = 0;
  for (const auto& c : checkpoint.components) {
    if (c.name.starts_with(kCustomPrefix)) ++saved_custom;
  }
  for (const Component& c : components_) {
    if (c.kind == "custom") ++registered_custom;
  }
  if (saved_custom != registered_custom) {
    throw Error(ErrorCode::Incompatible,
                fmt::format("{} holds {} objects saved with register_for_checkpointing but {} are "
                            "registered now; register the same objects in the same order",
                            path, saved_custom, registered_custom));
  }

  // This process's RNG file; a process the checkpoint has none for (more processes now) takes
  // rank 0's and reseeds its CPU generator below.
  const bool own_rng = rank < saved_world;
  const std::string rng_file = random_states_name(own_rng ? rank : 0);
  StatefulSet set;
  for (std::size_t i = 0; i < components_.size(); ++i) set.add(names[i], components_[i].object);
  for (const std::string& name : loaded.filled) set.allow_missing(name);
  // Everything else may draw random numbers while loading; the restored streams must not move.
  set.add(rng_file, AnyStateful::ref(rng_), /*restore_last=*/true);
  StateDict all;
  std::vector<std::string> orphans;
  for (const auto& c : checkpoint.components) {
    if (c.name.starts_with(kRandomStatesPrefix) && c.name != rng_file) {
      // Another process's: restored there, or (when it no longer exists) reported below.
      std::string digits = c.name.substr(std::string(kRandomStatesPrefix).size());
      bool number = !digits.empty() && digits.size() < 10 &&
                    digits.find_first_not_of("0123456789") == std::string::npos;
      if (number && std::stoi(digits) >= num_processes()) orphans.push_back(c.name);
      continue;
    }
    all.set_child(c.name, StateDict::from_container(c.contents));
  }
  RestoreReport restored = set.restore(all);
  // Last, when nothing else can fail: only an I/O error, or the files changing since they were
  // verified, can stop it, and its error says the model may hold part of the checkpoint.
  loaded.copy();
  if (!own_rng) {
    std::uint64_t seed =
        at::detail::getDefaultCPUGenerator().current_seed() + static_cast<std::uint64_t>(rank);
    torch::manual_seed(seed);
    report.notes.push_back(fmt::format(
        "{} was saved by {} process(es) and has no RNG states for rank {}: it restored rank 0's "
        "and seeded its CPU generator with rank 0's seed + {} = {}",
        path, saved_world, rank, rank, seed));
  }
  if (saved_world != num_processes()) {
    std::string note = fmt::format(
        "{} was saved by {} process(es) and is loaded by {}: the data position (samples of the "
        "epoch consumed by all processes) continues the epoch with no sample repeated or "
        "skipped, but the batches differ from the saved run's from here on{}",
        path, saved_world, num_processes(),
        orphans.empty() ? std::string()
                        : "; the RNG states of ranks that no longer exist are not restored "
                          "anywhere: " +
                              join_names(orphans));
    if (is_main_process()) std::fprintf(stderr, "torchpoint: warning: %s\n", note.c_str());
    report.notes.push_back(std::move(note));
  }
  report.saved_world_size = saved_world;
  reset_after_load();

  step_ = checkpoint.info.step;
  continue_numbering_after(path);
  resumed_from_ = path;
  report.path = path;
  last_checkpoint_ = path;
  for (const std::string& name : names) {
    if (std::find(loaded.filled.begin(), loaded.filled.end(), name) != loaded.filled.end() ||
        std::find(restored.restored.begin(), restored.restored.end(), name) !=
            restored.restored.end()) {
      report.components.push_back(name);
    }
  }
  report.components.push_back(rng_file);
  report.step = step_;
  report.libtorch_version = checkpoint.libtorch_version;
  if (!checkpoint.libtorch_version.empty() &&
      checkpoint.libtorch_version != compat::torch_version()) {
    report.notes.push_back(fmt::format(
        "{} was written by LibTorch {} and is loaded by LibTorch {}: every value was restored "
        "bit for bit, but the two versions' kernels may compute the following steps "
        "differently",
        path, checkpoint.libtorch_version, compat::torch_version()));
  }
  return report;
}

void Accelerator::reset_after_load() {
  scaled_pending_ = false;  // the parameters were just replaced; no gradient is pending
  // Every save is at a step boundary, where the accumulation count starts again.
  accumulation_count_ = 0;
  sync_gradients_ = true;
  unsynced_backward_ = false;
}

void Accelerator::continue_numbering_after(const std::string& path) {
  if (config_.automatic_checkpoint_naming()) {
    // The next save continues the numbering instead of starting again at checkpoint_0; after
    // resuming from an older checkpoint, it goes after the newest one rather than collide.
    std::int64_t next = config_.iteration();
    if (auto n = parse_checkpoint_name(base_name(path))) next = static_cast<std::int64_t>(*n) + 1;
    for (const auto& [number, p] : list_checkpoints()) next = std::max(next, number + 1);
    config_.iteration(next);
    first_own_number_ = next;
  }
}

LoadStateReport Accelerator::load_accelerate_state(const std::string& path,
                                                   LoadStateReport report) {
  const std::vector<std::string> names = component_names();
  std::vector<detail::WantedComponent> wanted;
  for (std::size_t i = 0; i < components_.size(); ++i) {
    const Component& c = components_[i];
    // The state now shows the layout the translation must produce; a model's and a sampler's
    // are not needed.
    const bool needs_current = c.kind != "model" && c.kind != "sampler";
    wanted.push_back({names[i], c.kind, needs_current ? c.object.state_dict() : StateDict()});
  }
  const std::string rng_name = random_states_name(process_index());
  detail::AccelerateRead read;
  std::exception_ptr failure;
  try {
    read = detail::read_accelerate_directory(path, wanted, rng_name, rng_.state_dict(),
                                             process_index(), env_);
  } catch (const std::exception&) {
    if (!group_) throw;
    failure = std::current_exception();
  }
  if (group_) group_->agree(failure, fmt::format("load_state(): reading {}", path));
  StatefulSet set;
  for (std::size_t i = 0; i < components_.size(); ++i) {
    set.add(names[i], components_[i].object);
    if (components_[i].kind == "sampler") set.allow_missing(names[i]);
  }
  // Everything else may draw random numbers while loading; the restored streams must not move.
  set.add(rng_name, AnyStateful::ref(rng_), /*restore_last=*/true);
  set.restore(read.all);
  reset_after_load();
  step_ = read.step;
  continue_numbering_after(path);
  resumed_from_ = path;
  // Not a torchpoint checkpoint: an incremental save has nothing to link from it.
  last_checkpoint_.clear();
  report.path = path;
  report.components = read.files;
  report.step = step_;
  report.saved_world_size = 0;  // Accelerate does not record it
  report.not_applicable = read.not_applicable;
  for (const std::string& n : read.not_in_checkpoint) {
    report.notes.push_back(fmt::format("not in {}, left as it was: {}", path, n));
  }
  for (std::string& n : read.notes) report.notes.push_back(std::move(n));
  report.notes.push_back(fmt::format(
      "{} was written by Python Accelerate: its values were restored bit for bit, but "
      "PyTorch's Python optimizers and LibTorch's compute the following steps with other "
      "kernels, which may differ in the last bits",
      path));
  return report;
}

}  // namespace torchpoint
