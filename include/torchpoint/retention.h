// Which checkpoints of a directory to keep: one retention policy, a pure function of a listing,
// under the Accelerator's total_limit and `torchpoint prune`.
#pragma once

#include <torch/arg.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "torchpoint/error.h"

namespace torchpoint {

enum class CheckpointStatus {
  Valid,        // committed and, where it was checked, verified
  Corrupt,      // committed, but its checksums prove it damaged
  Uncommitted,  // a temporary name (a save in progress or one that died), or no manifest
};

// "valid", "corrupt" or "uncommitted".
const char* checkpoint_status_name(CheckpointStatus status);

// What retention knows of one checkpoint. A listing is ordered oldest first.
struct RetentionEntry {
  std::string name;
  CheckpointStatus status = CheckpointStatus::Valid;
  std::optional<std::int64_t> step;
  // The value of the policy's best_metric recorded with this checkpoint, if any.
  std::optional<double> metric;
  std::int64_t commit_time_ms = 0;  // Unix time of the commit
  // Kept whatever the policy says, for this reason (the caller's: "newer than the checkpoint
  // this run resumed from"). Empty: not pinned.
  std::string pinned;
};

// What to keep. With no rule set (no keep_last, best_metric, keep_every_n_steps or
// keep_period_ms) every checkpoint is kept. Otherwise a valid checkpoint is kept when a rule
// keeps it and deleted when none does. Whatever the rules:
// - the newest valid checkpoint and pinned ones are kept;
// - uncommitted entries are kept and not counted (one may be a save in progress);
// - corrupt entries are kept and not counted, unless delete_corrupt.
struct RetentionPolicy {
  // The last N valid checkpoints (Accelerate's total_limit, Orbax's max_to_keep).
  TORCH_ARG(std::optional<std::size_t>, keep_last);
  // The keep_best valid checkpoints with the best value of this metric (lowest with
  // best_mode_max false); ties go to the earliest; NaN and a missing value never win.
  TORCH_ARG(std::optional<std::string>, best_metric);
  TORCH_ARG(std::size_t, keep_best) = 1;
  TORCH_ARG(bool, best_mode_max) = false;
  // With best_metric: keep the checkpoints that do not record it (Orbax's
  // keep_checkpoints_without_metrics); otherwise only the other rules can keep them.
  TORCH_ARG(bool, keep_without_metric) = false;
  // Every checkpoint whose step is a multiple of N (Orbax's keep_period).
  TORCH_ARG(std::optional<std::int64_t>, keep_every_n_steps);
  // The newest checkpoint of each period of this many milliseconds of commit time (one an
  // hour, one a day).
  TORCH_ARG(std::optional<std::int64_t>, keep_period_ms);
  TORCH_ARG(bool, delete_corrupt) = false;

 public:
  // Whether any keep rule is set; without one, every checkpoint is kept.
  bool has_rule() const {
    return keep_last_ || best_metric_ || keep_every_n_steps_ || keep_period_ms_;
  }
};

// The fate of one entry, with every reason that applies ("newest valid", "last 3", ...).
struct RetentionDecision {
  bool keep = true;
  std::vector<std::string> reasons;
};

// One decision per entry of `oldest_first`, in the same order. Touches nothing. Throws
// InvalidArgument for a zero keep_best, keep_every_n_steps or keep_period_ms, and NotFound when
// best_metric is set but no valid checkpoint records it (the best cannot be told, so nothing
// may be deleted for it).
std::vector<RetentionDecision> plan_retention(const std::vector<RetentionEntry>& oldest_first,
                                              const RetentionPolicy& policy);

}  // namespace torchpoint
