// Where a run is in its data: a sampler whose order is a pure function of (seed, epoch) and
// whose position is what the training loop consumed, so a resumed run sees exactly the batches
// the interrupted one had not yet seen.
#pragma once

#include <torch/data/samplers/base.h>
#include <torch/data/samplers/random.h>
#include <torch/data/samplers/sequential.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "torchpoint/error.h"
#include "torchpoint/state_dict.h"

namespace torchpoint {

namespace detail {
// What every copy of one ResumableSampler shares (LibTorch's DataLoader keeps its own copy).
struct SamplerCursor {
  static constexpr std::size_t kUnknownBatches = static_cast<std::size_t>(-1);
  std::size_t size = 0;
  bool shuffle = true;
  std::uint64_t seed = 0;
  std::int64_t epoch = 0;
  std::size_t consumed = 0;  // samples delivered to the training loop in this epoch
  std::size_t batches = 0;   // batches delivered to this process's loop in this epoch
  std::size_t issued = 0;    // samples handed to the loader (runs ahead with worker prefetch)
  bool started = false;
  bool resume_pending = false;  // the next reset() continues the epoch at `consumed`
  bool finished = false;        // the loop over `epoch` reached its end (see Tracked)
  bool restored = false;  // loaded from a checkpoint; cleared by the next reset() or skip
  std::int64_t order_epoch = -1;
  std::vector<std::size_t> order;
  int shard_rank = 0;   // this process's part of each global batch (see ResumableSampler::shard)
  int shard_count = 1;  // processes sharing the data
};
}  // namespace detail

// A sampler for LibTorch's DataLoader that can stop and resume mid-epoch.
//
// Each DataLoader::begin() (each `for (auto& batch : *loader)`) starts the next epoch, whose
// order is a pure function of (seed, epoch) — it draws nothing from torch's global RNG. The
// saved position is what the training loop received (see track()), not what worker threads
// prefetched, and whether the loop over that epoch reached its end.
//
// What the next begin() iterates after load_state_dict():
//   - the saved epoch's loop had reached its end (a checkpoint saved after the epoch's loop,
//     Accelerate's "epoch_N" pattern): the next epoch, whole;
//   - otherwise (saved inside the loop): the rest of the saved epoch. When that rest is empty
//     (saved in the body of the epoch's last batch) the loop runs once with no batch, so a loop
//     that keeps its own epoch counter in the checkpoint does that epoch's end-of-epoch work.
// skip_first_batches(n) right after load_state_dict() means what it means in Accelerate: the
// batches of the *saved* epoch from index n on, and then whole epochs. So n must be the number
// of batches of that epoch the checkpoint had trained on (the guide's "batches done" kept in a
// registered object); the one other value a documented idiom produces is 0 for a checkpoint
// whose epoch had no batch left (Accelerate's step_N pattern: starting_epoch =
// step / batches_per_epoch has moved to the next epoch, resume_step is 0), which begins the
// next epoch. Any other n throws InvalidArgument naming both numbers: skipping more or fewer
// batches than were trained on would train on the wrong data. (A position saved before the
// loader's first iteration holds nothing to contradict: any n counts from epoch 0's start.)
//
// Example:
//   torchpoint::ResumableSampler sampler(dataset.size().value(), /*shuffle=*/true, /*seed=*/7);
//   auto loader = torch::data::make_data_loader(dataset.map(Stack<>()), sampler, 32);
//   for (auto& batch : sampler.track(*loader)) { ...; if (time_to_save) save(sampler.state_dict());
//   }
class ResumableSampler : public torch::data::samplers::Sampler<> {
 public:
  ResumableSampler(std::size_t size, bool shuffle = true, std::uint64_t seed = 0);

  // Sampler interface (called by the DataLoader).
  void reset(c10::optional<std::size_t> new_size = c10::nullopt) override;
  c10::optional<std::vector<std::size_t>> next(std::size_t batch_size) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  // Epoch and position. epoch() is the epoch being (or last) iterated, from 0.
  std::int64_t epoch() const { return cursor_->epoch; }
  std::size_t samples_consumed() const { return cursor_->consumed; }
  std::size_t size() const { return cursor_->size; }
  // The epoch the next begin() iterates: the restored or skipped-into one, else the one after
  // the current (0 before the first). After load_state, an epoch loop resumes with
  //   for (auto epoch = sampler.next_epoch(); epoch < epochs; ++epoch) { for (auto& b : loader) }
  std::int64_t next_epoch() const;
  // Sets the epoch the next begin() starts (like DistributedSampler::set_epoch).
  void set_epoch(std::int64_t epoch);
  // Shares the data among `count` processes, this one being `rank` (Accelerator::prepare does
  // it). The order stays a pure function of (seed, epoch); each batch request of size b takes the
  // next b * count samples of it (a global batch), of which process r gets samples
  // [r * b, (r + 1) * b). The position is the number of samples of the epoch consumed by all
  // processes together, so a run resumed on another number of processes continues the epoch
  // with no sample repeated or skipped. An epoch's last global batch, when fewer samples are left,
  // is split evenly: each process gets ceil(left / count) samples, the missing ones (fewer than
  // count) taken again from the start of the epoch's order, so every process sees the same number
  // of batches of the same size (Accelerate's even_batches); with drop_last it is dropped.
  void shard(int rank, int count);
  int shard_rank() const { return cursor_->shard_rank; }
  int shard_count() const { return cursor_->shard_count; }
  // The training loop received one batch of `samples` samples (track() calls this for you);
  // sharded, every process received as many, so the position moves by `samples` times
  // shard_count().
  void consume(std::size_t samples);
  // Makes the next begin() start after the first `batches` batches of `batch_size` of an epoch,
  // without reading the skipped samples; the begin() after it iterates the next epoch, whole.
  // Right after load_state_dict(), the epoch is the saved one and `batches` must be the
  // batches it had trained on (then nothing changes), or 0 when it had none left (then the
  // next epoch begins): see above the class. Otherwise: the epoch the next begin() would start
  // (the pending one while it has a batch left, with `drop_last` a partial batch not
  // counting; else the one after it), skipping at most all of it.
  // Errors: InvalidArgument after load_state_dict() for any other `batches`, naming the saved
  // epoch, its batches trained on and its length; the position is then unchanged.
  void skip_first_batches(std::size_t batches, std::size_t batch_size, bool drop_last = false);
  // The loop over the current epoch reached its end (track() calls this for you).
  void finish_epoch() { cursor_->finished = true; }
  // True when every batch of the current epoch was consumed but its loop had not ended: what a
  // checkpoint saved in the body of an epoch's last batch restores.
  bool consumed_but_unfinished() const;
  // The sample indices of `epoch`, in order.
  std::vector<std::size_t> order_of(std::int64_t epoch) const;

  // seed, size, shuffle, epoch, consumed samples and batches, and whether the epoch's loop
  // ended. Loading checks size, shuffle and seed (Incompatible otherwise); what the next
  // begin() iterates is described above the class.
  StateDict state_dict() const;
  void load_state_dict(const StateDict& state);

  // Wraps a DataLoader built with (a copy of) this sampler so that every batch the loop
  // receives counts as consumed. Range-for over the result.
  template <typename Loader>
  class Tracked;
  template <typename Loader>
  Tracked<Loader> track(Loader& loader) {
    return Tracked<Loader>(loader, *this);
  }

 private:
  void ensure_order() const;
  std::shared_ptr<detail::SamplerCursor> cursor_;
};

template <typename Loader>
class ResumableSampler::Tracked {
 public:
  Tracked(Loader& loader, ResumableSampler& sampler) : loader_(loader), sampler_(sampler) {}

  class iterator {
   public:
    using inner = decltype(std::declval<Loader&>().begin());
    iterator(inner it, ResumableSampler* sampler, std::size_t batch_size)
        : it_(std::move(it)), sampler_(sampler), batch_size_(batch_size) {}
    // Counting on delivery, not on ++: a checkpoint taken inside the loop body must count the
    // batch the body is processing.
    decltype(auto) operator*() {
      if (!counted_ && sampler_ != nullptr) {
        sampler_->consume(batch_size_);
        counted_ = true;
      }
      return *it_;
    }
    iterator& operator++() {
      ++it_;
      counted_ = false;
      return *this;
    }
    // Reaching the end marks the epoch's loop as finished (range-for compares with end()).
    bool operator!=(const iterator& other) const { return !(*this == other); }
    bool operator==(const iterator& other) const {
      bool at_end = it_ == other.it_;
      if (at_end && sampler_ != nullptr) sampler_->finish_epoch();
      return at_end;
    }

   private:
    inner it_;
    ResumableSampler* sampler_;
    std::size_t batch_size_;
    bool counted_ = false;
  };

  iterator begin() { return iterator(loader_.begin(), &sampler_, loader_.options().batch_size); }
  iterator end() { return iterator(loader_.end(), nullptr, 0); }

 private:
  Loader& loader_;
  ResumableSampler& sampler_;
};

// LibTorch's own samplers: their index and permutation, read and written through their
// archive methods (RandomSampler draws its permutation from the global RNG, so restore the RNG
// state too, or prefer ResumableSampler).
StateDict sampler_state_dict(const torch::data::samplers::RandomSampler& sampler);
void load_sampler_state_dict(torch::data::samplers::RandomSampler& sampler, const StateDict& state);
StateDict sampler_state_dict(const torch::data::samplers::SequentialSampler& sampler);
void load_sampler_state_dict(torch::data::samplers::SequentialSampler& sampler,
                             const StateDict& state);

// Counters of a run, saved as exact integers.
//
// Example:
//   torchpoint::TrainingCounters counters;
//   ++counters.step;
//   state.set_child("counters", counters.state_dict());
struct TrainingCounters {
  std::int64_t epoch = 0;           // epochs completed
  std::int64_t step = 0;            // optimizer steps taken
  std::int64_t batch_in_epoch = 0;  // batches consumed in the current epoch
  std::int64_t samples_seen = 0;    // samples consumed since the start of the run

  StateDict state_dict() const;
  void load_state_dict(const StateDict& state);
};

// Metric history: one value per epoch for each (set, metric), e.g. ("train", "loss"). Values
// are stored as float64 tensors, so they come back bit for bit (NaN and infinities included).
//
// Example:
//   torchpoint::MetricRecords records;
//   records.record("train", "loss", 1.237);
//   records.values("train", "loss");  // {1.237}
class MetricRecords {
 public:
  void record(const std::string& set, const std::string& metric, double value);
  // The values of (set, metric) in the order recorded; empty if none.
  const std::vector<double>& values(const std::string& set, const std::string& metric) const;
  // (set, metric) pairs in the order first recorded.
  std::vector<std::pair<std::string, std::string>> series() const;
  bool empty() const { return series_.empty(); }

  StateDict state_dict() const;
  void load_state_dict(const StateDict& state);

 private:
  struct Series {
    std::string set;
    std::string metric;
    std::vector<double> values;
  };
  std::vector<Series> series_;
};

}  // namespace torchpoint
