// Accelerator: Hugging Face Accelerate's checkpointing API for people who write their own
// training loop — save_state / load_state of everything the run holds, automatic checkpoint
// naming under a project directory, register_for_checkpointing and skip_first_batches.
//
// Differences from Accelerate, on purpose: a checkpoint is committed atomically and verified
// on load; old checkpoints are deleted only after a new one is committed (numeric order); the
// iteration is restored by load_state; a failure to restore RNG state is an error; the data
// position is saved, so a resumed run continues mid-epoch exactly.
#pragma once

#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/optim/schedulers/step_lr.h>

#include <cstdint>
#include <exception>
#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "torchpoint/async_save.h"
#include "torchpoint/checkpoint_dir.h"
#include "torchpoint/data_loader.h"
#include "torchpoint/env.h"
#include "torchpoint/error.h"
#include "torchpoint/grad_scaler.h"
#include "torchpoint/lr_scheduler.h"
#include "torchpoint/process_group.h"
#include "torchpoint/rng_state.h"
#include "torchpoint/state_dict.h"

namespace torchpoint {

class RemovableHandle;

namespace detail {
class ZeroOptimizer;
template <typename>
inline constexpr bool kAlwaysFalse = false;
// LibTorch's torch::optim::ReduceLROnPlateauScheduler (LibTorch 2.1 and later), recognised by
// its shape so that this header also builds against LibTorch 1.13, which lacks it.
template <typename T>
concept LibTorchPlateauScheduler = requires {
  typename T::SchedulerMode;
  typename T::ThresholdMode;
}
&&requires(T& t) { t.step(0.0f); }
&&!std::is_base_of_v<LRScheduler, T>;
// A module holder: torch::nn::Linear, a TORCH_MODULE(Net), ...
template <typename T>
concept ModuleHolderType =
    std::is_base_of_v<torch::nn::ModuleHolder<typename T::ContainedType>, T>;
// A LibTorch LR scheduler whose state torchpoint can read whole: torch::optim::StepLR, whose
// state is the step count of its base class and its options (the learning rates live in the
// optimizer). The options are recorded so that a StepLR built with others is refused.
StateDict libtorch_step_lr_state(const torch::optim::StepLR& scheduler);
void load_libtorch_step_lr_state(torch::optim::StepLR& scheduler, const StateDict& state);
struct LibTorchStepLR {
  torch::optim::StepLR* scheduler;
  StateDict state_dict() const { return libtorch_step_lr_state(*scheduler); }
  void load_state_dict(const StateDict& s) { load_libtorch_step_lr_state(*scheduler, s); }
};
}  // namespace detail

namespace detail {
// The hooks of one kind registered on an Accelerator, each with the id its handle removes.
struct HookList : std::enable_shared_from_this<HookList> {
  // The prepared models, the model states about to be written (a save hook's; null for a load
  // hook) and the directory.
  using Hook = std::function<void(std::vector<std::shared_ptr<torch::nn::Module>>&,
                                  std::vector<StateDict>*, const std::string&)>;
  struct Entry {
    std::uint64_t id;
    Hook hook;
    bool sees_models;  // registered with the models (and weights): not only the directory
  };
  std::vector<Entry> hooks;
  std::uint64_t next_id = 1;

  RemovableHandle add(Hook hook, bool sees_models);
  // The hooks registered now, in order (a copy: an asynchronous save runs them later).
  std::vector<Hook> snapshot() const;
  bool any_sees_models() const;
};
}  // namespace detail

// What the register_*_hook methods return, as Accelerate's RemovableHandle: remove()
// unregisters the hook. Removing twice, or after the Accelerator is gone, does nothing. Not
// thread-safe with a save in progress on another thread (asynchronous saves copy the hooks
// when they start).
class RemovableHandle {
 public:
  RemovableHandle() = default;
  void remove();

 private:
  friend struct detail::HookList;
  RemovableHandle(std::weak_ptr<detail::HookList> list, std::uint64_t id)
      : list_(std::move(list)), id_(id) {}
  std::weak_ptr<detail::HookList> list_;
  std::uint64_t id_ = 0;
};

// Where and how checkpoints are named, with Accelerate's fields and defaults.
struct ProjectConfiguration {
  // Root of the project; checkpoints go to <project_dir>/checkpoints/checkpoint_<n> with
  // automatic naming.
  TORCH_ARG(std::string, project_dir) = "";
  TORCH_ARG(bool, automatic_checkpoint_naming) = false;
  // With automatic naming, keep at most this many checkpoints (none: keep all).
  TORCH_ARG(std::optional<std::int64_t>, total_limit) = std::nullopt;
  // The number of the next automatically named checkpoint.
  TORCH_ARG(std::int64_t, iteration) = 0;
  // A component whose tensors hold more than this many bytes is saved as shards in Hugging
  // Face's layout (model-00001-of-00003.safetensors ... and model.safetensors.index.json), the
  // model's frozen parameters and buffers in shards of their own; 0: never shard. See
  // SaveDirectoryOptions::shard_size.
  TORCH_ARG(std::uint64_t, shard_size) = SaveDirectoryOptions::kDefaultShardSize;
  // A shard bit-identical to the same shard of the previous checkpoint this Accelerator saved
  // or loaded is hard-linked from it instead of written again (compared by checksums of the
  // bytes in memory at every save). Each checkpoint stays complete on its own.
  TORCH_ARG(bool, incremental) = true;
  // Accelerate's save_on_each_node, for nodes that do not share a disk: with several nodes
  // (torchrun agents; WORLD_SIZE > LOCAL_WORLD_SIZE), the local main process of every node writes
  // a complete checkpoint to project_dir on its own node (the model and other replicated state
  // once per node, the RNG states of that node's processes), all nodes committing or none. A
  // load reads each node's own copy, of the newest checkpoint every node holds committed and
  // valid: a node whose copy is missing or damaged makes every process fall back together.
  // With one node (or one process) it changes nothing.
  TORCH_ARG(bool, save_on_each_node) = false;
};

// What load_state() restored.
struct LoadStateReport {
  std::string path;                     // the checkpoint loaded
  std::vector<std::string> components;  // file names restored, RNG last
  std::vector<std::string> skipped;     // newer checkpoints passed over as corrupt, with why
  std::int64_t step = 0;
  // The LibTorch version that wrote the checkpoint ("1.13.0"; empty if not recorded).
  std::string libtorch_version;
  // What is worth knowing about this load, one sentence each; for example that the checkpoint
  // was written by another LibTorch version (every tensor is restored bit for bit, but that
  // version's kernels may compute the next steps differently).
  std::vector<std::string> notes;
  // The number of processes that wrote the checkpoint (1 for one written by one process; 0
  // for one written by Python Accelerate, which does not record it).
  int saved_world_size = 1;
  // The bytes of the checkpoint's files this process read and verified (0 for one written by
  // Python Accelerate). Under ZeRO a process reads only the shards that hold its part.
  std::uint64_t bytes_read = 0;
  // Python-side state of a checkpoint written by Python Accelerate that has no C++ counterpart
  // and was not restored (Python's random module, NumPy's generator), one sentence each.
  std::vector<std::string> not_applicable;
};

class Accelerator;

// What prepare(optimizer) returns, as Accelerate's AcceleratedOptimizer, so that the guide's
// loop is correct as written:
//   auto [model, optimizer] = acc.prepare(net, sgd);
//   acc.prepare(scaler);                      // optional
//   for (...) {
//     optimizer.zero_grad();
//     acc.backward(loss);
//     optimizer.step();                       // through the Accelerator
//   }
// step() is acc.optimizer_step(): nothing on an iteration that accumulates (accumulate()); with
// a prepared GradScaler it unscales, skips the step when a gradient holds an inf or NaN
// (step_was_skipped() then says so) and updates the scale. zero_grad() clears the gradients
// only on iterations that synchronize, as Accelerate's does, so a loop that zeroes every
// iteration accumulates correctly. Call either step() or acc.optimizer_step() per iteration,
// not both (that would step twice).
// It converts to the optimizer itself (O&, so also torch::optim::Optimizer&) for schedulers
// and functions that take one, and -> reaches the optimizer's other members. A handle: copies
// refer to the same optimizer; use it only while its Accelerator lives.
class AcceleratedOptimizerBase {
 public:
  // Steps through the Accelerator (see above). Returns whether the optimizer stepped.
  bool step();
  // Clears the gradients (LibTorch's zero_grad()) unless the current iteration accumulates.
  void zero_grad();
  // Whether the last step() on a synchronizing iteration was skipped because a gradient held
  // an inf or NaN (only with a GradScaler), as Accelerate's step_was_skipped.
  bool step_was_skipped() const { return step_was_skipped_; }
  std::vector<torch::optim::OptimizerParamGroup>& param_groups() const {
    return optimizer_->param_groups();
  }
  torch::optim::Optimizer& base() const { return *optimizer_; }

 protected:
  AcceleratedOptimizerBase(Accelerator& accelerator, torch::optim::Optimizer& optimizer,
                           std::shared_ptr<void> keep_alive)
      : accelerator_(&accelerator), optimizer_(&optimizer), keep_alive_(std::move(keep_alive)) {}

  Accelerator* accelerator_;
  torch::optim::Optimizer* optimizer_;
  std::shared_ptr<void> keep_alive_;  // the optimizer, when it was prepared as a shared_ptr
  bool step_was_skipped_ = false;
};

template <typename O>
class AcceleratedOptimizer : public AcceleratedOptimizerBase {
 public:
  AcceleratedOptimizer(Accelerator& accelerator, O& optimizer, std::shared_ptr<void> keep_alive)
      : AcceleratedOptimizerBase(accelerator, optimizer, std::move(keep_alive)) {}
  O& optimizer() const { return static_cast<O&>(*optimizer_); }
  O* operator->() const { return &optimizer(); }
  operator O&() const { return optimizer(); }  // NOLINT: converts as Accelerate's wrapper passes
};

// Several processes (torchrun): the same program runs as every process, each with its own
// Accelerator over the same project directory, on a file system every process sees (as
// Accelerate requires). prepare(model) gives every process rank 0's parameters; backward()
// averages the gradients over the processes, so every process steps identically; prepare(loader)
// gives each process its part of every global batch. save_state() is called by every process:
// the main process writes the model, optimizer, scheduler, scaler, data position and registered
// objects once, every process writes its own random_states_<rank>, and the checkpoint is
// committed by the main process only after every process has fsynced its files: any process's
// failure makes save_state() throw on every process with nothing committed. load_state() on any
// number of processes: see load_state().
class Accelerator {
 public:
  // Example:
  //   torchpoint::Accelerator acc(torchpoint::ProjectConfiguration()
  //                                   .project_dir("runs/exp1")
  //                                   .automatic_checkpoint_naming(true)
  //                                   .total_limit(3));
  //
  // `group`: the processes of the run; by default torchrun's (ProcessGroup::from_environment(),
  // null when the program runs as one process).
  explicit Accelerator(ProjectConfiguration config = {}, Env& env = Env::posix(),
                       std::shared_ptr<ProcessGroup> group = ProcessGroup::from_environment());
  // Accelerator(project_dir="...") as in Accelerate.
  explicit Accelerator(const std::string& project_dir)
      : Accelerator(ProjectConfiguration().project_dir(project_dir)) {}

  // ZeRO, as DeepSpeed's stages (Accelerate's DeepSpeedPlugin(zero_stage=...)): 1 partitions
  // each prepared optimizer's state over the processes, every process keeping the state of about
  // 1/N of the parameters' elements (a flat split by bytes, not whole tensors) and stepping only
  // those, after which the updated parameters are gathered to every process; 2 also
  // reduce-scatters the gradients, each process keeping only the average of its own part (the
  // parameters' .grad() are freed after a synchronizing backward(): clip with
  // clip_grad_norm_()/clip_grad_value_() of this Accelerator, which work on the parts). 0 (the
  // default) shards nothing. SGD, Adam and AdamW (element-wise updates), every option, several
  // param groups, accumulation and a GradScaler; the parameters of one dtype. Call it before
  // prepare(optimizer); on one process it runs the same code with one part. Throws
  // InvalidArgument for another stage or after an optimizer was prepared; prepare(optimizer)
  // throws Unsupported for another optimizer.
  // Checkpoints are written by every process, nothing gathered: each its own part of the
  // optimizer state (<optimizer>_zero_<rank>) and about 1/N of the models' bytes (the models
  // split into shards dealt to the processes), with the global layout in the manifest; a load on
  // any number of processes at any stage reads the parts it needs (format 3.0, docs/format.md).
  // save_on_each_node gathers the state instead, so that each node's copy stands alone.
  //
  // Example:
  //   torchpoint::Accelerator acc;
  //   acc.set_zero_stage(2);
  //   auto [model, optimizer] = acc.prepare(net, adam);
  void set_zero_stage(int stage);
  int zero_stage() const { return zero_stage_; }
  // The bytes of optimizer state (moments, momentum buffers) this process holds for its
  // prepared optimizers: about 1/N of the unsharded state under ZeRO.
  std::int64_t optimizer_state_bytes() const;

  // The device to train on: the first CUDA device when there is one, else the CPU.
  torch::Device device() const;
  const ProjectConfiguration& project_configuration() const { return config_; }
  const std::string& project_dir() const { return config_.project_dir(); }
  // The processes of the run, with Accelerate's names. One process: 1, 0, 0, true, true.
  int num_processes() const { return group_ ? group_->size() : 1; }
  int process_index() const { return group_ ? group_->rank() : 0; }
  int local_process_index() const { return group_ ? group_->local_rank() : 0; }
  bool is_main_process() const { return process_index() == 0; }
  bool is_local_main_process() const { return local_process_index() == 0; }
  // The group, or null for one process.
  const std::shared_ptr<ProcessGroup>& process_group() const { return group_; }
  // Returns when every process has called it (at most the group's timeout, then Error naming
  // the processes that did not come).
  void wait_for_everyone();
  // Every process's `tensor` concatenated along the first dimension, in rank order (a
  // 0-dimensional tensor counts as one element); the same shape on every process. One process:
  // the tensor itself.
  at::Tensor gather(const at::Tensor& tensor);
  // The sum ("sum") or mean ("mean") of `tensor` over the processes, as a new tensor.
  at::Tensor reduce(const at::Tensor& tensor, const std::string& op = "sum");
  // Prints `text` and a newline on stdout from the main process only.
  void print(const std::string& text) const;
  // Runs `fn` on the main process first, then on the others (downloading or preprocessing
  // something once, which the others then read).
  template <typename F>
  void main_process_first(F&& fn) {
    if (!is_main_process()) wait_for_everyone();
    fn();
    if (is_main_process()) wait_for_everyone();
  }
  // While the returned guard lives, backward() does not average gradients over the processes
  // (gradient accumulation: backward() several times under no_sync(), then once without it,
  // which averages the accumulated gradients, then optimizer_step()). One process: no effect.
  //
  // Example:
  //   { auto guard = acc.no_sync(); acc.backward(loss1); }
  //   acc.backward(loss2);  // averages loss1's and loss2's accumulated gradients
  //   acc.optimizer_step(opt);
  class NoSync {
   public:
    // `active` false: a guard that changes nothing (accumulate() on a synchronizing iteration).
    explicit NoSync(Accelerator& acc, bool active = true) : acc_(&acc), previous_(acc.no_sync_) {
      if (active) acc.no_sync_ = true;
    }
    ~NoSync() {
      if (acc_) acc_->no_sync_ = previous_;
    }
    NoSync(NoSync&& other) noexcept : acc_(other.acc_), previous_(other.previous_) {
      other.acc_ = nullptr;
    }
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;
    NoSync& operator=(NoSync&&) = delete;

   private:
    Accelerator* acc_;
    bool previous_;
  };
  [[nodiscard]] NoSync no_sync() { return NoSync(*this); }

  // Gradient accumulation as Accelerate's Accelerator(gradient_accumulation_steps=n) with
  // accumulate(model): each iteration of the loop runs inside accumulate(), which decides whether
  // it synchronizes: every n-th iteration, and the last batch of a prepared loader's epoch
  // (which also starts the count again). backward() divides the loss by n; on the other
  // iterations it only accumulates gradients, locally (as under no_sync()), and
  // optimizer_step() returns false without stepping. The optimizer prepare() returned does the
  // same in its step(), and its zero_grad() clears nothing on those iterations (the raw
  // optimizer cannot be intercepted: zero it only when sync_gradients()). save_state() on an
  // iteration that does not synchronize, or after a backward() under no_sync() that no
  // synchronized backward() followed, throws InvalidArgument: the accumulated gradients are not
  // part of a checkpoint, so a run resumed from it would silently lose them.
  //
  // Example:
  //   acc.set_gradient_accumulation_steps(4);
  //   auto& optimizer = acc.prepare(sgd);
  //   for (auto& batch : *loader) {
  //     auto accumulating = acc.accumulate();
  //     acc.backward(loss_of(batch));
  //     optimizer.step();       // steps on every 4th iteration
  //     optimizer.zero_grad();  // clears on those iterations only
  //     if (acc.sync_gradients() && ++updates % 100 == 0) acc.save_state();
  //   }
  void set_gradient_accumulation_steps(int steps);
  int gradient_accumulation_steps() const { return accumulation_steps_; }
  // Whether the current iteration's backward() averages over the processes and its
  // optimizer_step() steps (true outside accumulate()).
  bool sync_gradients() const { return sync_gradients_; }
  [[nodiscard]] NoSync accumulate();

  // Backward passes run through backward() since the start of the run (restored by load_state).
  // Only acc.backward(loss) counts: a plain loss.backward() does not (a one-time warning on
  // stderr says so when save_state() or backward() sees one).
  std::int64_t step() const { return step_; }

  // Registers objects whose state save_state() writes and load_state() restores, and returns
  // them, so `auto [model, opt, loader] = acc.prepare(model, opt, loader);` works. Accepts
  // modules (ModuleHolder or shared_ptr), optimizers (shared_ptr, or a reference the caller
  // keeps alive), ResumableDataLoader / ResumableSampler pointers, LR schedulers and a
  // GradScaler (references or shared_ptr). Each comes back as itself, except an optimizer O,
  // which comes back as an AcceleratedOptimizer<O>& (a shared_ptr to one for a shared_ptr),
  // whose step() goes through the Accelerator as Accelerate's wrapper does. Registration order
  // names the files: model.safetensors, model_1.safetensors, ...
  template <typename... Ts>
  decltype(auto) prepare(Ts&&... objects) {
    if constexpr (sizeof...(Ts) == 1) {
      return prepare_one(std::forward<Ts>(objects)...);
    } else {
      // Braces: the objects are registered left to right, which names their files.
      return std::tuple<decltype(prepare_one(std::forward<Ts>(objects)))...>{
          prepare_one(std::forward<Ts>(objects))...};
    }
  }

  // loss.backward(), through the GradScaler's scale when one is prepared; counts a step. With
  // several processes (outside no_sync()), then averages the gradients of every prepared model's
  // parameters over the processes: buckets of up to 25 MiB of one dtype, each flattened and
  // allreduced at once. Every process must produce gradients for the same parameters.
  void backward(const at::Tensor& loss);
  // optimizer.step(), through the GradScaler (unscale, skip on inf/NaN, update) when one is
  // prepared. Returns whether the optimizer stepped. With a GradScaler prepared, the gradients
  // after backward() are multiplied by the scale, so the optimizer must be stepped here or
  // through the AcceleratedOptimizer that prepare() returned. A loop that steps the raw
  // optimizer instead fails loudly: save_state() throws InvalidArgument while
  // a scaled backward() has not been consumed by optimizer_step() (so such a step never
  // reaches a checkpoint), and so does a backward() that finds the previous scaled gradients
  // cleared by zero_grad() without optimizer_step(). Gradient accumulation (several backward()
  // calls, then one optimizer_step()) is fine.
  bool optimizer_step(torch::optim::Optimizer& optimizer);
  // Several optimizers of one iteration (a GAN's generator and discriminator), as PyTorch's
  // recipe for several optimizers under a GradScaler steps them: each through the scaler, then
  // one update() of the scale for the iteration, which backs off if any of them met an inf/NaN.
  // (optimizer_step(o) for each updates after each, as Accelerate's optimizers do.) Returns, in
  // order, whether each stepped. Without a GradScaler, steps each.
  //
  // Example:
  //   acc.optimizer_step({generator_optimizer, discriminator_optimizer});
  std::vector<bool> optimizer_step(
      std::initializer_list<std::reference_wrapper<torch::optim::Optimizer>> optimizers);

  // Accelerate's unscale_gradients(): with a prepared GradScaler, unscales the gradients of
  // every prepared optimizer, so that they can be inspected or clipped; their next step does
  // not unscale again. Nothing without a GradScaler, or on an iteration that accumulates.
  void unscale_gradients();
  // Accelerate's clip_grad_norm_: unscale_gradients(), then scales the gradients of
  // `parameters` so that their total `norm_type` norm is at most `max_norm`
  // (torch::nn::utils::clip_grad_norm_). Returns the total norm before clipping. With several
  // processes backward() has already averaged the gradients, so every process clips alike.
  // With a GradScaler, on an iteration that accumulates it throws InvalidArgument (the
  // gradients are still scaled and partial): clip when sync_gradients(), as Accelerate's guide
  // does.
  //
  // Example:
  //   acc.backward(loss);
  //   if (acc.sync_gradients()) acc.clip_grad_norm_(model->parameters(), 1.0);
  //   optimizer.step();
  double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                         double norm_type = 2.0);
  // Accelerate's clip_grad_value_: unscale_gradients(), then clamps every gradient of
  // `parameters` to [-clip_value, clip_value]. Errors as clip_grad_norm_.
  void clip_grad_value_(const std::vector<at::Tensor>& parameters, double clip_value);

  // Registers objects saved as custom_checkpoint_<i> in registration order and restored by
  // load_state(): anything with state_dict()/load_state_dict(), and, as in Accelerate, modules
  // (a module holder such as torch::nn::Linear or a TORCH_MODULE, or a shared_ptr to a module)
  // and optimizers (by reference or shared_ptr). An object with no state does not compile, with
  // a message that says what it needs.
  // Example:
  //   acc.register_for_checkpointing(ema_model, second_optimizer, position);
  template <typename... Ts>
  void register_for_checkpointing(Ts&&... objects) {
    (register_one(std::forward<Ts>(objects)), ...);
  }

  // Writes a checkpoint of everything prepared or registered, every RNG of the process, the
  // data position and the counters. With automatic naming, to
  // <project_dir>/checkpoints/checkpoint_<iteration> (then iteration + 1, and total_limit is
  // applied after the commit); otherwise to `output_dir`, which is then required. Returns the
  // path written. On failure every committed checkpoint is kept and nothing new is visible.
  // total_limit is a maximum (the checkpoint this run resumed from counts, and goes when it is
  // among the oldest), with one exception: a checkpoint that was there before this run and is
  // newer than the one it resumed from (after load_state() of an older one) is kept unless its
  // own checksums prove it corrupt, since it holds progress this run lacks.
  // `output_dir` may be an empty directory; a committed checkpoint there is replaced only with
  // `overwrite`, atomically (the old one stays whole until the new one is committed).
  // Waits for an asynchronous save in flight first (and throws its error if nothing received
  // it yet).
  // Several processes: every process calls it with the same arguments (see the class comment);
  // a process that stops answering makes the others throw within the group's timeout, naming it.
  std::string save_state(const std::string& output_dir = "", bool overwrite = false);
  // save_state() without stopping training: returns once every tensor of the state has been
  // copied into staging memory (reused from one save to the next), and writes, commits and
  // applies total_limit on a background thread. The loop may change every parameter as soon as
  // it returns. At most one save is in flight: the next save (or load_state()) waits for this
  // one first. Its error is thrown once, by whichever comes first of the handle's wait(), the
  // next save_state(), load_state() or wait_for_checkpoint(). Save hooks run on the background
  // thread. A kill while the background write runs leaves every earlier checkpoint intact and
  // this one absent. With automatic naming the iteration advances at once, so a failed
  // asynchronous save leaves its number unused. With several processes (plain data parallel or
  // ZeRO) each stages the part it writes, as save_state() would write it, and its background
  // thread writes it; the main process commits once every process has written and agreed, and
  // every process's handle gets the same outcome. Every process calls it at the same point.
  // With save_on_each_node on several nodes it throws Unsupported (use save_state()).
  SaveHandle save_state_async(const std::string& output_dir = "", bool overwrite = false);
  // The bytes of checkpoint files this process wrote in its last save_state() (files hard-linked
  // from an earlier checkpoint count nothing); 0 before the first. Under ZeRO about 1/N of the
  // checkpoint on each of N processes, else the main process writes the shared components.
  std::uint64_t last_save_bytes_written() const { return last_save_bytes_written_; }
  // Blocks until the asynchronous save in flight (if any) has committed; throws its error unless
  // it was already received. The destructor waits too, but never throws (it prints the error).
  void wait_for_checkpoint();

  // Restores everything save_state() wrote. With no argument, the newest valid checkpoint under
  // <project_dir>/checkpoints (numeric order; uncommitted ones are ignored, and newer ones
  // proven corrupt by their own checksums are skipped with a warning on stderr naming them).
  // A newer one that cannot be read (permissions, an I/O error, a FIFO) or was written by a
  // newer torchpoint is not passed over: load_state() throws naming it (IOError, Incompatible,
  // ...), since resuming from an older one would lose its progress. Every file is verified and
  // every component name checked before anything changes; should a component still refuse its
  // state, the ones already restored are put back (a copy of the current state is held while
  // loading). RNG state goes back last. A prepared model is not copied: its files are verified
  // against its parameters and buffers (names, dtypes, shapes, checksums) with the rest, and
  // read straight into its memory once everything else is restored; only an I/O error or the
  // files changing in between can fail then, with an error saying that the model may hold part
  // of the checkpoint. With automatic naming, the next save_state() writes
  // checkpoint_<n + 1>, or after the newest existing checkpoint when the one loaded was older.
  //
  // Several processes: every process calls it; the main process chooses the checkpoint (the
  // newest valid one, with no argument), every process verifies it, and nothing changes anywhere
  // unless every process could read it. Each process restores the model, optimizer and the rest,
  // and its own random_states_<rank>. On the number of processes that saved it, the run continues
  // bit for bit. On another number, the data position (global: samples consumed by all
  // processes) continues the epoch with no sample repeated or skipped, and a note says so; the
  // RNG files of ranks that no longer exist are named in the notes; a rank with no RNG file
  // restores rank 0's and then seeds its CPU generator with (rank 0's seed + its rank).
  //
  // A directory written by Python Accelerate's save_state() (see accelerate_interop.h) is read
  // too, when named as `input_dir`: model.safetensors (or pytorch_model.bin), optimizer.bin,
  // scheduler.bin, scaler.pt, custom_checkpoint_<i>.pkl and random_states_<rank>.pkl of the prepared and
  // registered objects, in Accelerate's order. The Python optimizer must be of the prepared
  // optimizer's type (Adam, AdamW, SGD, RMSprop, Adagrad; recognised from its options) with as
  // many parameters per group, and the scheduler of the same class (torchpoint's, which mirror
  // PyTorch's, or torch::optim::StepLR); torch's CPU generator and the step are restored
  // exactly; Python's random and NumPy states (and sampler.bin or dl_state_dict.bin, pickled
  // Python loader objects) are listed in `not_applicable`; data loaders keep their position
  // (Accelerate has none for a plain loader: skip_first_batches as Accelerate users do).
  // Everything is read and translated before anything changes. Errors: NotFound naming a
  // missing file, Incompatible naming what differs (or a file no object takes, or an
  // accelerator's RNG state), Unsupported naming a Python type or global torchpoint does not
  // read (it never runs Python code: only tensors, numbers, strings, lists, tuples, dicts and
  // NumPy arrays are read).
  LoadStateReport load_state(const std::string& input_dir = "");
  // The one call a resumable program makes at its start: load_state() of the newest valid
  // checkpoint when the project has a committed one, and nothing (nullopt, no change) on a
  // fresh project. Needs automatic naming's project directory. Errors as load_state(): a project
  // whose checkpoints are all invalid is not fresh, and throws NotFound listing them.
  std::optional<LoadStateReport> try_load_state();

  // The next iteration of `loader` yields the batches of an epoch from index `num_batches` on,
  // without reading the skipped samples; later iterations are whole epochs. Returns `loader`.
  // After load_state() the epoch is the one the checkpoint was saved in, counted from its
  // start, as in Accelerate; every resume idiom of Accelerate's users gives the uninterrupted
  // run's batches:
  //   position kept in a registered object (the guide): skip_first_batches(loader,
  //     batches_done) in the saved epoch, also when batches_done is the epoch's length;
  //   step_N: starting_epoch = N / batches_per_epoch; skip_first_batches(loader,
  //     N - starting_epoch * batches_per_epoch) in that first epoch, also when that is 0;
  //   epoch_N (saved after the epoch's loop and its end-of-epoch work): starting_epoch = N + 1,
  //     nothing skipped;
  //   no skip at all, the epoch kept in a registered object: the loader yields the rest.
  // Errors: InvalidArgument, naming both numbers, when `num_batches` after load_state() is
  // neither the batches the saved epoch had trained on nor 0 for a saved epoch with no batch
  // left: a resume is exact or an error. See ResumableSampler for the model.
  template <typename Dataset>
  std::shared_ptr<ResumableDataLoader<Dataset>> skip_first_batches(
      std::shared_ptr<ResumableDataLoader<Dataset>> loader, std::size_t num_batches) {
    loader->skip_first_batches(num_batches);
    return loader;
  }

  // Save hooks run during save_state(), in the order registered, with the directory being
  // written (a temporary sibling of the output directory, renamed to it on commit), before the
  // components are written; files a hook writes there (save_pretrained-style configs) become
  // part of the checkpoint: listed in its manifest with checksums and verified on load, and
  // gone with it when the save fails. Load hooks run with the input directory before a load.
  // Each returns a handle whose remove() unregisters the hook, as Accelerate's RemovableHandle.
  //
  // As in Accelerate, a hook may also take the prepared models: a save hook
  // (models, weights, dir), where weights[i] is the state of models[i] about to be written
  // (its tensors are the model's own: replace entries, do not write into them); it may change,
  // add or erase entries, and erase states from the vector — the states left are written as
  // model, model_1, ... in their order, so a model the hook saved itself is not written twice.
  // A load hook (models, dir) may erase models from its vector: the ones left are read from
  // model, model_1, ... in their order, and the ones erased are not touched (the hook loaded
  // them). Save and load hooks must agree, or load_state() fails naming the component that
  // differs. save_state_async() refuses to run with a save hook that takes the weights (its
  // tensors are staged before the hooks run): use save_state() or a directory-only hook.
  // Example:
  //   auto handle = acc.register_save_state_pre_hook([](const std::string& dir) { ... });
  //   handle.remove();  // later saves no longer run it
  //   acc.register_save_state_pre_hook(
  //       [](auto& models, std::vector<torchpoint::StateDict>& weights, const std::string& dir) {
  //         torch::save(models.back(), dir + "/head.pt");  // saved its own way
  //         weights.pop_back();                           // so not as model_<n>
  //       });
  //   acc.register_load_state_pre_hook([](auto& models, const std::string& dir) {
  //     torch::load(models.back(), dir + "/head.pt");
  //     models.pop_back();
  //   });
  using ModelList = std::vector<std::shared_ptr<torch::nn::Module>>;
  RemovableHandle register_save_state_pre_hook(std::function<void(const std::string&)> hook);
  RemovableHandle register_save_state_pre_hook(
      std::function<void(ModelList& models, std::vector<StateDict>& weights,
                         const std::string& output_dir)>
          hook);
  RemovableHandle register_load_state_pre_hook(std::function<void(const std::string&)> hook);
  RemovableHandle register_load_state_pre_hook(
      std::function<void(ModelList& models, const std::string& input_dir)> hook);

  // Accelerate's log(): records metric values (the latest value of each name is kept), which
  // the next save_state() writes into its manifest's metadata as "metrics", where
  // `torchpoint ls` shows them and `torchpoint prune --keep-best NAME` ranks checkpoints by
  // them. A non-finite value is written as null. Throws InvalidArgument for an empty name.
  //
  // Example:
  //   accelerator.log({{"val_loss", 0.31}, {"accuracy", 0.92}});
  //   accelerator.save_state();
  void log(const std::map<std::string, double>& values);

  // RNGs beyond the default generators (saved in random_states_0).
  RngState& rng() { return rng_; }

  // The committed checkpoints under <project_dir>/checkpoints, by number.
  std::vector<std::pair<std::int64_t, std::string>> list_checkpoints() const;

 private:
  struct Component {
    std::string kind;  // "model", "optimizer", "scheduler", "scaler", "sampler", "custom"
    AnyStateful object;
  };

  // A module holder (torch::nn::Linear, or a TORCH_MODULE(Net) holder) comes back as its own
  // type, and a shared_ptr<NetImpl> as shared_ptr<NetImpl>, so `model->forward(x)` still works.
  template <typename H>
  requires std::is_base_of_v<torch::nn::ModuleHolder<typename H::ContainedType>, H> H
  prepare_one(H module) {
    add_model(module.ptr());
    return module;
  }
  template <typename M>
  requires std::is_base_of_v<torch::nn::Module, M> std::shared_ptr<M> prepare_one(
      std::shared_ptr<M> module) {
    add_model(module);
    return module;
  }
  // An optimizer comes back wrapped (AcceleratedOptimizer<O>, owned by this Accelerator), or
  // as a shared_ptr to one that keeps the optimizer alive.
  template <typename O>
  requires std::is_base_of_v<torch::optim::Optimizer, O> AcceleratedOptimizer<O>& prepare_one(
      O& optimizer) {
    return *add_optimizer(optimizer, nullptr);
  }
  template <typename O>
  requires std::is_base_of_v<torch::optim::Optimizer, O>
      std::shared_ptr<AcceleratedOptimizer<O>> prepare_one(std::shared_ptr<O> optimizer) {
    return add_optimizer(*optimizer, optimizer);
  }
  template <typename O>
  std::shared_ptr<AcceleratedOptimizer<O>> add_optimizer(O& optimizer,
                                                         std::shared_ptr<void> keep_alive) {
    add_component("optimizer", AnyStateful::value(OptimizerAdapter{&optimizer, keep_alive}));
    watch(optimizer);
    shard(optimizer);
    optimizers_.push_back(&optimizer);
    auto wrapped = std::make_shared<AcceleratedOptimizer<O>>(*this, optimizer, std::move(keep_alive));
    wrapped_optimizers_.push_back(wrapped);
    return wrapped;
  }
  template <typename S>
  requires std::is_base_of_v<LRScheduler, S> S& prepare_one(S& scheduler) {
    add_component("scheduler", AnyStateful::ref(static_cast<LRScheduler&>(scheduler)));
    return scheduler;
  }
  // LibTorch's torch::optim::StepLR, checkpointed exactly (its step count); its other
  // schedulers keep private state, and preparing one says what to use instead.
  torch::optim::StepLR& prepare_one(torch::optim::StepLR& scheduler) {
    add_component("scheduler", AnyStateful::value(detail::LibTorchStepLR{&scheduler}));
    return scheduler;
  }
  template <typename S>
  requires(std::is_base_of_v<torch::optim::LRScheduler, S> &&
           !std::is_same_v<S, torch::optim::StepLR>) S& prepare_one(S& scheduler) {
    static_assert(detail::kAlwaysFalse<S>,
                  "torchpoint: this LibTorch LR scheduler keeps state torchpoint cannot read, so "
                  "it cannot be checkpointed exactly: use torchpoint's scheduler of the same name "
                  "(torchpoint/lr_scheduler.h), or register an object with "
                  "state_dict()/load_state_dict(); torch::optim::StepLR itself is supported");
    return scheduler;
  }
  template <typename S>
  requires detail::LibTorchPlateauScheduler<S> S& prepare_one(S& scheduler) {
    static_assert(detail::kAlwaysFalse<S>,
                  "torchpoint: torch::optim::ReduceLROnPlateauScheduler keeps its state "
                  "(best value, bad epochs, cooldown) private, so it cannot be checkpointed "
                  "exactly: use torchpoint::ReduceLROnPlateau (torchpoint/lr_scheduler.h), with "
                  "the same options and PyTorch's state_dict");
    return scheduler;
  }
  GradScaler& prepare_one(GradScaler& scaler);
  template <typename Dataset>
  std::shared_ptr<ResumableDataLoader<Dataset>> prepare_one(
      std::shared_ptr<ResumableDataLoader<Dataset>> loader) {
    add_sampler(AnyStateful(std::shared_ptr<ResumableSampler>(loader, &loader->sampler())),
                loader->sampler());
    return loader;
  }
  ResumableSampler& prepare_one(ResumableSampler& sampler) {
    add_sampler(AnyStateful::ref(sampler), sampler);
    return sampler;
  }

  // Modules and optimizers are registered as Accelerate registers them (their state, through
  // the same adapters as prepare(), as custom_checkpoint_<i>); anything else needs
  // state_dict()/load_state_dict().
  template <typename T>
  void register_one(std::shared_ptr<T> object) {
    if constexpr (std::is_base_of_v<torch::nn::Module, T>) {
      add_component("custom", AnyStateful::value(ModuleAdapter{std::move(object)}));
    } else if constexpr (std::is_base_of_v<AcceleratedOptimizerBase, T>) {
      add_component("custom", AnyStateful::value(OptimizerAdapter{&object->base(), object}));
    } else if constexpr (std::is_base_of_v<torch::optim::Optimizer, T>) {
      add_component("custom", AnyStateful::value(OptimizerAdapter{object.get(), object}));
    } else {
      static_assert(Stateful<T>,
                    "torchpoint: register_for_checkpointing needs an object with `StateDict "
                    "state_dict()` and `void load_state_dict(const torchpoint::StateDict&)`");
      add_component("custom", AnyStateful(std::move(object)));
    }
  }
  void register_one(torch::optim::StepLR& scheduler) {
    add_component("custom", AnyStateful::value(detail::LibTorchStepLR{&scheduler}));
  }
  template <typename T>
  void register_one(T& object) {
    if constexpr (detail::ModuleHolderType<T>) {
      add_component("custom", AnyStateful::value(ModuleAdapter{object.ptr()}));
    } else if constexpr (std::is_base_of_v<AcceleratedOptimizerBase, T>) {
      add_component("custom", AnyStateful::value(OptimizerAdapter{&object.base(), nullptr}));
    } else if constexpr (std::is_base_of_v<torch::optim::Optimizer, T>) {
      add_component("custom", AnyStateful::value(OptimizerAdapter{&object, nullptr}));
    } else {
      static_assert(!std::is_base_of_v<torch::optim::LRScheduler, T> &&
                        !detail::LibTorchPlateauScheduler<T>,
                    "torchpoint: this LibTorch LR scheduler keeps state torchpoint cannot read, "
                    "so it cannot be checkpointed exactly: use torchpoint's scheduler of the same "
                    "name (torchpoint/lr_scheduler.h); torch::optim::StepLR itself is supported");
      static_assert(Stateful<T>,
                    "torchpoint: register_for_checkpointing needs an object with `StateDict "
                    "state_dict()` and `void load_state_dict(const torchpoint::StateDict&)`");
      add_component("custom", AnyStateful::ref(object));
    }
  }

  struct ModuleAdapter {
    std::shared_ptr<torch::nn::Module> module;
    StateDict state_dict() const;
    void load_state_dict(const StateDict& state);
  };
  struct OptimizerAdapter {
    static constexpr bool kLoadReplacesState = true;  // see load_optimizer_state_dict()
    torch::optim::Optimizer* optimizer;
    std::shared_ptr<void> keep_alive;
    StateDict state_dict() const;
    void load_state_dict(const StateDict& state);
  };

  void add_component(const std::string& kind, AnyStateful object);
  // The models and model states the save hooks left.
  struct SavedModels {
    ModelList models;
    std::vector<StateDict> weights;
  };
  // Runs the save hooks with the prepared models and their states, in `dir`.
  void run_save_hooks(const std::vector<detail::HookList::Hook>& hooks, const std::string& dir,
                      SavedModels& saved);
  // components_ with its first `count` model components made by `model(j)` and the others left
  // out: what a save or load sees after the hooks.
  std::vector<Component> components_with_models(
      std::size_t count, const std::function<AnyStateful(std::size_t)>& model) const;
  struct HookedComponents;
  // A prepared model: a component, the parameters whose gradients backward() averages, and (with
  // several processes) given rank 0's parameters and buffers at once.
  void add_model(std::shared_ptr<torch::nn::Module> module);
  void average_gradients();
  // The sampler of a prepared loader: sharded over the processes.
  void add_sampler(AnyStateful sampler, ResumableSampler& shardable);
  std::string save_state_distributed(const std::string& output_dir, bool overwrite);
  // save_state_async() with several processes: each stages what it writes now; opening, writing,
  // agreeing and committing run on its background thread, over save_channel_.
  SaveHandle save_state_async_distributed(const std::string& output_dir, bool overwrite);
  // save_on_each_node with several nodes: every node's local main process writes its own copy.
  bool saves_per_node() const;
  std::string save_state_per_node(const std::string& output_dir, bool overwrite);
  // load_state() of a torchpoint checkpoint, step by step (accelerator_checkpoint.cc).
  struct Loading;
  // load_state() of a directory written by Python Accelerate's save_state.
  LoadStateReport load_accelerate_state(const std::string& path, LoadStateReport report);
  // What every load resets: no scaled gradient pending, the accumulation count restarted; each
  // sharded optimizer takes its part of the whole state restored, unless `zero_restored` (the
  // load set their parts itself).
  void reset_after_load(bool zero_restored = false);
  // With automatic naming, the next save goes after `path` and after every existing one.
  void continue_numbering_after(const std::string& path);
  // What every save checks first (a directory or automatic naming; no unconsumed scaled
  // gradients), then the path it writes: output_dir, or the next automatically named one.
  std::string begin_save(const std::string& output_dir);
  // Watches the optimizer's first trainable parameter: a hook on it counts backward passes
  // that did not go through backward(), and its gradient shows when gradients were cleared.
  void watch(torch::optim::Optimizer& optimizer);
  // Under ZeRO, the sharded stepper of the optimizer being prepared (zero_, parallel to
  // optimizers_); and the one of a prepared optimizer, or null.
  void shard(torch::optim::Optimizer& optimizer);
  detail::ZeroOptimizer* zero_of(const torch::optim::Optimizer& optimizer) const;
  // The sharded optimizers with their components' names (`names`: component_names()).
  std::vector<std::pair<std::string, detail::ZeroOptimizer*>> sharded(
      const std::vector<std::string>& names) const;
  // What a save under ZeRO adds: the shards' names for every rank of `world`, this process's
  // shards, and the global layouts for the manifest (null when nothing is sharded).
  std::vector<std::string> zero_shard_names(const std::vector<std::string>& names,
                                            int world) const;
  std::vector<torchpoint::Component> zero_shards(const std::vector<std::string>& names) const;
  Json zero_layouts(const std::vector<std::string>& names) const;
  // One optimizer's step (with the GradScaler, when prepared); the scaler's update is the
  // caller's.
  bool step_one(torch::optim::Optimizer& optimizer);
  // Throws when scaled gradients from backward() were not consumed by optimizer_step(): at
  // save_state(), or at a backward() that finds them cleared (optimizer.step() then zero_grad()).
  void check_no_step_on_scaled_gradients(bool saving);
  // Warns once on stderr when backward passes ran outside backward(), which step() does not
  // count.
  void warn_about_uncounted_backwards();
  // File stem of the i-th component: "model", "model_1", "custom_checkpoint_0", ...
  std::vector<std::string> component_names() const;
  std::string checkpoints_dir() const;
  void apply_total_limit(const std::string& just_written);
  // How this save writes its directory: shards, the frozen tensors, what to link from.
  SaveDirectoryOptions directory_options(bool overwrite) const;
  // save_state() and save_state_async(): a synchronous save when `saver` is null.
  std::string save_state_with(const std::string& output_dir, bool overwrite,
                              AsyncCheckpointer* saver, SaveHandle* handle);

  ProjectConfiguration config_;
  Env& env_;
  std::shared_ptr<ProcessGroup> group_;
  std::vector<std::shared_ptr<torch::nn::Module>> models_;
  bool no_sync_ = false;
  int accumulation_steps_ = 1;
  std::int64_t accumulation_count_ = 0;  // iterations since the count last started
  bool sync_gradients_ = true;
  // A backward() under no_sync() (or a non-synchronizing accumulate()) that no synchronized
  // backward() or optimizer step has followed: its gradients exist in this process only.
  bool unsynced_backward_ = false;
  std::vector<ResumableSampler*> samplers_;  // the prepared loaders' samplers
  std::vector<torch::optim::Optimizer*> optimizers_;  // the prepared optimizers
  int zero_stage_ = 0;
  std::vector<std::unique_ptr<detail::ZeroOptimizer>> zero_;  // each optimizer's, or null
  // What prepare(optimizer) returned: held here so that a reference to one stays valid.
  std::vector<std::shared_ptr<AcceleratedOptimizerBase>> wrapped_optimizers_;
  std::vector<Component> components_;
  GradScaler* scaler_ = nullptr;
  RngState rng_;
  std::int64_t step_ = 0;
  std::string resumed_from_;
  // The checkpoint this Accelerator last saved or loaded: what an incremental save links from.
  std::string last_checkpoint_;
  std::uint64_t last_save_bytes_written_ = 0;
  // The first checkpoint number this run writes after load_state(): checkpoints numbered
  // between resumed_from_'s and this one were there before and are kept by retention.
  std::int64_t first_own_number_ = 0;
  std::shared_ptr<detail::HookList> save_hooks_ = std::make_shared<detail::HookList>();
  std::shared_ptr<detail::HookList> load_hooks_ = std::make_shared<detail::HookList>();

  struct BackwardCounts;  // shared with the gradient hooks, which may outlive this object
  std::shared_ptr<BackwardCounts> backward_counts_;
  struct Watched {
    at::Tensor param;
    unsigned hook;
    // Its gradient had a non-zero value (among its first elements) after the last scaled
    // backward(): all zeros later means zero_grad() ran (LibTorch 1.13 zeroes, 2.x unsets).
    bool had_gradient = false;
  };
  std::vector<Watched> hooked_;  // one trainable parameter per optimizer
  // A scaled backward() ran and no optimizer_step() has consumed its gradients yet.
  bool scaled_pending_ = false;
  bool warned_uncounted_ = false;
  Json logged_metrics_ = Json::object();  // by name, in the order first logged
  // The background saves' own connection to the other processes (several processes only).
  std::unique_ptr<ProcessGroup> save_channel_;
  // Made at the first save_state_async(); destroyed first, so that its background save never
  // outlives the members it uses.
  std::unique_ptr<AsyncCheckpointer> async_;

 public:
  ~Accelerator();
  Accelerator(const Accelerator&) = delete;
  Accelerator& operator=(const Accelerator&) = delete;
};

}  // namespace torchpoint
