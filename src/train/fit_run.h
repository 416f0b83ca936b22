// The state of one Learner::fit call, shared by the training loop (learner.cc) and the
// checkpoint code (learner_checkpoint.cc).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "torchpoint/data_position.h"
#include "torchpoint/learner.h"

namespace torchpoint::detail {

// A float64 running sum for one monitored value of the current epoch. Saved exactly, so an
// epoch resumed mid-way ends with the same mean.
struct Accumulator {
  double sum = 0;
  std::int64_t count = 0;
  double mean() const { return count == 0 ? 0.0 : sum / static_cast<double>(count); }
};

struct FitRun {
  Learner* learner = nullptr;
  const FitData* data = nullptr;
  const FitOptions* options = nullptr;
  Env* env = nullptr;
  std::shared_ptr<ProcessGroup> group;  // null: one process
  ResumableSampler sampler;             // sharded over the group's processes
  std::vector<CallbackPtr> callbacks;   // in call order
  std::vector<Metric> metrics;
  std::vector<std::string> monitors;            // every monitor name this fit records
  std::map<std::string, Accumulator> progress;  // by monitor name, for the running epoch
  // The epoch after counters.epoch was started before a restore: continue it, do not replay
  // its on_epoch_begin / on_train_begin.
  bool mid_epoch = false;
  std::optional<std::int64_t> resumed_after_epoch;
  // The background saves' own connection to the other processes (made at the first one);
  // outlives ctx, whose saver waits for the save in flight.
  std::unique_ptr<ProcessGroup> save_channel;
  Context ctx;

  FitRun(std::size_t size, bool shuffle, std::uint64_t seed) : sampler(size, shuffle, seed) {}

  // Runs `hook` of every callback in order; see Callback for how exceptions are reported.
  void each(const char* name, void (Callback::*hook)(Context&));
  // Adds the current batch's loss and metrics to the sums of `set` ("train" or "valid").
  void add_batch(const std::string& set);
  // Records the epoch's means of `set` (over every process) and puts them in ctx.metrics.
  void record_set(const std::string& set);
  // Replaces the sampler (restored from a checkpoint), sharded like the one it replaces.
  void set_sampler(ResumableSampler restored) {
    restored.shard(sampler.shard_rank(), sampler.shard_count());
    sampler = restored;
  }
};

}  // namespace torchpoint::detail
