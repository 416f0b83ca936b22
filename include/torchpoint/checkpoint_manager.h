// The checkpoint layer: what a directory of checkpoints holds (listing, numbering, the newest
// valid one), retention over it, and a CheckpointManager that saves and restores a StatefulSet
// there. The Accelerator, luz's callbacks and the torchpoint CLI use these same functions.
#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "torchpoint/async_save.h"
#include "torchpoint/env.h"
#include "torchpoint/error.h"
#include "torchpoint/retention.h"
#include "torchpoint/state_dict.h"
#include "torchpoint/stateful_set.h"

namespace torchpoint {

// The number that orders checkpoints, from a name (a temporary's too, for the name it stands
// for): N of checkpoint_N; for any other name, the number after "epoch" when it has one
// (run3-epoch-10.ckpt -> 10), else its first decimal number (step_200 -> 200). nullopt when
// it has none. Numbers compare as numbers: 9 before 10.
std::optional<std::uint64_t> checkpoint_number(const std::string& name);

// One entry of a directory of checkpoints.
struct ListedCheckpoint {
  std::string name;  // entry name in the directory
  std::string path;
  bool is_directory = false;
  std::optional<std::uint64_t> number;  // checkpoint_number(name)
  CheckpointStatus status = CheckpointStatus::Uncommitted;
  std::vector<std::string> problems;  // why it is corrupt
  // The manifest's "step"; for a valid file checkpoint, the step its state records.
  std::optional<std::int64_t> step;
  Json metadata;                 // manifest "metadata" (file: {"metrics": ...}); null when unknown
  std::uint64_t size_bytes = 0;  // all files in it (a directory is not descended into)
  // Of size_bytes, the bytes of files with other names too (hard links): the shards an
  // incremental save shares with other checkpoints. Deleting this checkpoint frees
  // size_bytes - shared_bytes (or more, when the others are gone).
  std::uint64_t shared_bytes = 0;
  std::int64_t commit_time_ms = 0;  // Unix time of manifest.json (the commit), else of the entry
  bool latest = false;              // the newest valid one
  bool temporary = false;           // a save in progress, or the leftover of one that died
  // Set by the caller: kept whatever the retention policy says, for this reason (see
  // RetentionEntry::pinned). list_checkpoints() leaves it empty.
  std::string pinned;

  // metadata["metrics"][metric] when it is a number.
  std::optional<double> metric(const std::string& metric) const;
};

struct CheckpointListing {
  std::string dir;                        // where the checkpoints are
  std::vector<ListedCheckpoint> entries;  // oldest first
};

// Finds the checkpoints in `dir`, or in `dir`/checkpoints when that exists (a project
// directory): directories named checkpoint_<N> and other directories holding a manifest.json,
// files ending in .ckpt or .safetensors, and temporaries of either. Other entries are ignored.
// Every committed checkpoint is verified (all checksums) unless `verify` is false. An entry that
// disappears while it is being verified (retention renaming it away) is left out, never called
// corrupt. Ordered by checkpoint_number, ties and entries without one (those first) by name
// in natural order (step-9 before step-10); the latest is the
// last valid one. Throws NotFound for a missing `dir`, InvalidArgument when `dir` is a file or
// itself a checkpoint. With `verify` false no checkpoint data is read: committed entries are listed
// as valid (manifests and file headers are still read for steps and metrics).
CheckpointListing list_checkpoints(const std::string& dir, Env& env = Env::posix(),
                                   bool verify = true);

// The decisions of `policy` over `listing` (see plan_retention), entry by entry.
// Each entry's metric is ListedCheckpoint::metric(policy.best_metric()).
std::vector<RetentionDecision> plan_retention(const CheckpointListing& listing,
                                              const RetentionPolicy& policy);

// Deletes one checkpoint of `dir` so that a crash midway never leaves a damaged checkpoint
// under its name: a directory is first renamed to a temporary name, which the next save into
// `dir` sweeps away. The caller holds the directory's lock.
void remove_checkpoint(const std::string& dir, const ListedCheckpoint& entry, Env& env);

// Deletes, with remove_checkpoint() and under the directory's lock (Locked while a save into it
// runs), every entry of `listing` whose decision is not to keep, and syncs the directory.
// `decisions` are plan_retention's for this listing. Returns the paths deleted.
std::vector<std::string> delete_checkpoints(const CheckpointListing& listing,
                                            const std::vector<RetentionDecision>& decisions,
                                            Env& env = Env::posix());

struct CheckpointManagerOptions {
  // Applied after every committed save (none by default: every checkpoint is kept).
  TORCH_ARG(RetentionPolicy, retention);
  // How checkpoints are named, in fmt syntax: {n} (one past the largest checkpoint number in
  // the directory), {step}, {epoch} (when save() is given one) and every metric passed to
  // save(), each with a format spec if wanted: "step-{step:08d}",
  // "epoch-{epoch:03d}-{val_loss:.3f}". Checkpoints are ordered by checkpoint_number() of their
  // names, so a format must use {n}, {step} or {epoch}, before any other number.
  TORCH_ARG(std::string, name_format) = "checkpoint_{n}";
};

// A directory of checkpoints named checkpoint_<N>, for a training loop of your own. Each
// checkpoint is a directory checkpoint (docs/format.md) holding one file per component of the
// StatefulSet, with the step and metrics recorded in its manifest, so that `torchpoint ls`
// shows them and `prune --keep-best` and the retention policy can use them.
//
// Example:
//   torchpoint::StatefulSet state;
//   state.add("model", torchpoint::ModuleState(model));
//   state.add("optimizer", torchpoint::OptimizerState(optimizer));
//   torchpoint::CheckpointManager manager("runs/a/checkpoints",
//       torchpoint::CheckpointManagerOptions().retention(
//           torchpoint::RetentionPolicy().keep_last(3).best_metric("val_loss")));
//   std::int64_t step = 0;
//   if (auto latest = manager.try_latest()) step = manager.restore(state, *latest).step;
//   while (step < steps) {
//     ...;  // one training step
//     if (++step % 100 == 0) manager.save(state, step, {{"val_loss", val_loss}});
//   }
class CheckpointManager {
 public:
  // `dir` need not exist yet. `env`: Env::posix() when null.
  explicit CheckpointManager(std::string dir,
                             CheckpointManagerOptions options = CheckpointManagerOptions(),
                             Env* env = nullptr);
  ~CheckpointManager();
  CheckpointManager(const CheckpointManager&) = delete;
  CheckpointManager& operator=(const CheckpointManager&) = delete;

  const std::string& dir() const { return dir_; }

  // Every checkpoint, verified (list_checkpoints of dir()); empty when dir() does not exist.
  CheckpointListing list() const;

  // The path of the newest valid committed checkpoint, verifying newest first only until one
  // passes; nullopt when there is none. One proven corrupt by its own checksums is passed over
  // with a warning on stderr naming it; one that cannot be judged (unreadable, or written by a
  // newer torchpoint) is an error naming it, never passed over, since resuming from an older
  // one would silently lose its progress.
  std::optional<std::string> try_latest() const;
  // The same, but NotFound when there is none.
  std::string latest() const;

  // Writes `state` atomically as a checkpoint named by name_format (checkpoint_<N> by default),
  // with `step`, `metrics` and `epoch` in its manifest, then applies the retention policy.
  // Returns its path. On failure every committed checkpoint is kept. Throws InvalidArgument
  // when the name cannot be formatted (naming the fields there are); save_directory's error
  // when a committed checkpoint already has that name (the same step saved twice).
  std::string save(const StatefulSet& state, std::int64_t step,
                   const std::map<std::string, double>& metrics = {},
                   std::optional<std::int64_t> epoch = std::nullopt);
  // save() without stopping training (see AsyncCheckpointer): returns once the state is copied;
  // the checkpoint is written, committed and retention applied on a background thread. The
  // next save, restore() and apply_retention() wait for it first; its error is thrown once, by
  // the handle's wait(), the next save or wait_for_checkpoint(). list() and latest() see only
  // committed checkpoints, so not this one until it commits.
  SaveHandle save_async(const StatefulSet& state, std::int64_t step,
                        const std::map<std::string, double>& metrics = {},
                        std::optional<std::int64_t> epoch = std::nullopt);
  // Blocks until an asynchronous save in flight has committed; throws its error unless it was
  // already received. The destructor waits too, and never throws.
  void wait_for_checkpoint();

  struct Restored {
    std::string path;
    std::int64_t step = 0;
    RestoreReport report;
  };
  // Restores `state` from the checkpoint at `path` (latest() when empty): every file verified
  // and every component matched before anything changes (StatefulSet::restore's contract).
  // From then on, retention never deletes that checkpoint while this manager lives (the point
  // this run started from), even beyond keep_last.
  Restored restore(StatefulSet& state, const std::string& path = "");
  // The same for the checkpoint numbered `number` (checkpoint_number() of its name); NotFound,
  // naming the numbers there are, when none has it.
  Restored restore(StatefulSet& state, std::uint64_t number);

  // Applies the retention policy now; returns the paths deleted.
  std::vector<std::string> apply_retention();

 private:
  std::string name_for(std::uint64_t n, std::int64_t step,
                       const std::map<std::string, double>& metrics,
                       std::optional<std::int64_t> epoch) const;
  std::string save_with(const StatefulSet& state, std::int64_t step,
                        const std::map<std::string, double>& metrics,
                        std::optional<std::int64_t> epoch, SaveHandle* handle);
  std::vector<std::string> retain();  // apply_retention() without waiting
  std::string dir_;
  CheckpointManagerOptions options_;
  Env* env_;
  std::string restored_from_;  // entry name of the checkpoint restore() loaded
  // Made at the first save_async(); destroyed first, so that its background save never
  // outlives the members it uses.
  std::unique_ptr<AsyncCheckpointer> async_;
};

}  // namespace torchpoint
