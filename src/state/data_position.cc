#include "torchpoint/data_position.h"

#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/tensor.h>
#include <fmt/format.h>
#include <torch/serialize/archive.h>

#include <numeric>
#include <sstream>

#include "torchpoint/error.h"

namespace torchpoint {
namespace {

// SplitMix64: a small, well-mixed generator whose output is the same on every platform (the
// standard distributions are not).
struct SplitMix64 {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in [0, bound) without modulo bias (Lemire's method).
  std::uint64_t below(std::uint64_t bound) {
    __uint128_t m = static_cast<__uint128_t>(next()) * bound;
    auto low = static_cast<std::uint64_t>(m);
    if (low < bound) {
      std::uint64_t threshold = -bound % bound;
      while (low < threshold) {
        m = static_cast<__uint128_t>(next()) * bound;
        low = static_cast<std::uint64_t>(m);
      }
    }
    return static_cast<std::uint64_t>(m >> 64);
  }
};

std::vector<std::size_t> make_order(std::size_t size, bool shuffle, std::uint64_t seed,
                                    std::int64_t epoch) {
  std::vector<std::size_t> order(size);
  std::iota(order.begin(), order.end(), std::size_t{0});
  if (!shuffle) return order;
  SplitMix64 rng{seed * 0x632be59bd9b4e019ULL + static_cast<std::uint64_t>(epoch)};
  for (std::size_t i = size; i > 1; --i) std::swap(order[i - 1], order[rng.below(i)]);
  return order;
}

}  // namespace

ResumableSampler::ResumableSampler(std::size_t size, bool shuffle, std::uint64_t seed)
    : cursor_(std::make_shared<detail::SamplerCursor>()) {
  cursor_->size = size;
  cursor_->shuffle = shuffle;
  cursor_->seed = seed;
}

void ResumableSampler::ensure_order() const {
  detail::SamplerCursor& c = *cursor_;
  if (c.order_epoch == c.epoch && c.order.size() == c.size) return;
  c.order = make_order(c.size, c.shuffle, c.seed, c.epoch);
  c.order_epoch = c.epoch;
}

std::vector<std::size_t> ResumableSampler::order_of(std::int64_t epoch) const {
  return make_order(cursor_->size, cursor_->shuffle, cursor_->seed, epoch);
}

void ResumableSampler::reset(c10::optional<std::size_t> new_size) {
  detail::SamplerCursor& c = *cursor_;
  if (new_size && *new_size != c.size) {
    c.size = *new_size;
    c.order_epoch = -1;
  }
  c.finished = false;
  c.restored = false;
  if (c.resume_pending) {
    // Continue the restored (or skipped-into) epoch instead of starting a new one: DataLoader's
    // begin() calls reset(), which must not wipe a position that was just loaded.
    c.resume_pending = false;
  } else if (c.started) {
    ++c.epoch;
    c.consumed = 0;
    c.batches = 0;
  } else {
    c.started = true;
    c.consumed = 0;
    c.batches = 0;
  }
  c.issued = std::min(c.consumed, c.size);
  ensure_order();
}

c10::optional<std::vector<std::size_t>> ResumableSampler::next(std::size_t batch_size) {
  detail::SamplerCursor& c = *cursor_;
  ensure_order();
  if (c.issued >= c.size || batch_size == 0) return c10::nullopt;
  const auto count = static_cast<std::size_t>(c.shard_count);
  const auto rank = static_cast<std::size_t>(c.shard_rank);
  // This request's global batch: the next batch_size samples of every process.
  const std::size_t global = std::min(c.size - c.issued, batch_size * count);
  const std::size_t mine = global == batch_size * count ? batch_size : (global + count - 1) / count;
  std::vector<std::size_t> batch;
  batch.reserve(mine);
  for (std::size_t p = rank * mine; p < (rank + 1) * mine; ++p) {
    // Past the end of a short last global batch: the epoch's first samples again.
    batch.push_back(p < global ? c.order[c.issued + p] : c.order[(p - global) % c.size]);
  }
  c.issued += global;
  return batch;
}

void ResumableSampler::shard(int rank, int count) {
  if (count < 1 || rank < 0 || rank >= count) {
    throw Error(
        ErrorCode::InvalidArgument,
        fmt::format("sampler shard {} of {}: the rank must be in [0, {})", rank, count, count));
  }
  cursor_->shard_rank = rank;
  cursor_->shard_count = count;
}

void ResumableSampler::set_epoch(std::int64_t epoch) {
  cursor_->epoch = epoch;
  cursor_->consumed = 0;
  cursor_->batches = 0;
  cursor_->started = true;
  cursor_->resume_pending = true;
  cursor_->finished = false;
  cursor_->restored = false;
}

void ResumableSampler::consume(std::size_t samples) {
  cursor_->consumed = std::min(
      cursor_->size, cursor_->consumed + samples * static_cast<std::size_t>(cursor_->shard_count));
  ++cursor_->batches;
}

void ResumableSampler::skip_first_batches(std::size_t batches, std::size_t batch_size,
                                          bool drop_last) {
  detail::SamplerCursor& c = *cursor_;
  const std::size_t global_batch =
      std::max<std::size_t>(1, batch_size * static_cast<std::size_t>(c.shard_count));
  const std::size_t left = c.size - std::min(c.size, c.consumed);
  const bool batch_left = drop_last ? left >= global_batch : left > 0;
  // A position saved before the loader's first iteration says nothing about the user's data
  // (Accelerate's guide saves the starting state, then skips 100 batches): counted from epoch
  // 0's start like any skip.
  if (c.restored && c.started) {
    // Counted from the start of the saved epoch, as Accelerate counts: only the batches it
    // trained on (nothing changes) or, when none was left, 0 (the next epoch, which is where a
    // position derived from the step count has moved on to) say where the saved run was.
    const std::size_t done =
        c.batches != detail::SamplerCursor::kUnknownBatches
            ? c.batches
            : (std::min(c.consumed, c.size) + global_batch - 1) / global_batch;
    const std::size_t whole = drop_last ? c.size / global_batch
                                        : (c.size + global_batch - 1) / global_batch;
    if (batches == done) {
      // A checkpoint saved after the epoch's loop ended: its empty rest, then the next epoch,
      // so that a loop still counting the saved epoch does that epoch's end-of-epoch work.
      c.resume_pending = true;
      c.finished = false;
    } else if (batches == 0 && !batch_left) {
      ++c.epoch;
      c.consumed = 0;
      c.batches = 0;
      c.resume_pending = true;
      c.finished = false;
    } else {
      throw Error(
          ErrorCode::InvalidArgument,
          fmt::format(
              "skip_first_batches({}) after loading a data position: the checkpoint was saved "
              "after {} of the {} batches of epoch {} ({}); skip {} to continue that epoch{}. "
              "Skipping any other number would train on batches the saved run did not reach or "
              "had already trained on",
              batches, done, whole, c.epoch,
              c.finished ? "after the epoch's loop ended" : "inside the epoch's loop", done,
              batch_left ? std::string()
                         : fmt::format(", or 0 to begin epoch {} (the step count's epoch)",
                                       c.epoch + 1)));
    }
    c.restored = false;
    return;
  }
  if (c.started && !(c.resume_pending && batch_left)) ++c.epoch;
  c.restored = false;
  c.consumed = std::min(c.size, batches * global_batch);
  c.batches = batches;
  c.started = true;
  c.resume_pending = true;
  c.finished = false;
}

std::int64_t ResumableSampler::next_epoch() const {
  const detail::SamplerCursor& c = *cursor_;
  // What reset() will do: continue a pending position, else begin the next epoch once one has
  // started.
  return c.resume_pending || !c.started ? c.epoch : c.epoch + 1;
}

bool ResumableSampler::consumed_but_unfinished() const {
  const detail::SamplerCursor& c = *cursor_;
  return c.started && !c.finished && c.consumed >= c.size;
}

StateDict ResumableSampler::state_dict() const {
  StateDict sd;
  sd.set_description("sampler");
  sd.set("type", "ResumableSampler");
  sd.set("size", static_cast<std::uint64_t>(cursor_->size));
  sd.set("shuffle", cursor_->shuffle);
  sd.set("seed", cursor_->seed);
  sd.set("epoch", cursor_->epoch);
  sd.set("samples_consumed", static_cast<std::uint64_t>(cursor_->consumed));
  if (cursor_->batches != detail::SamplerCursor::kUnknownBatches) {
    sd.set("batches_consumed", static_cast<std::uint64_t>(cursor_->batches));
  }
  sd.set("started", cursor_->started);
  sd.set("epoch_finished", cursor_->finished);
  return sd;
}

void ResumableSampler::load_state_dict(const StateDict& state) {
  auto size = state.get<std::uint64_t>("size");
  auto shuffle = state.get<bool>("shuffle");
  auto seed = state.get<std::uint64_t>("seed");
  if (size != cursor_->size || shuffle != cursor_->shuffle || seed != cursor_->seed) {
    throw Error(ErrorCode::Incompatible,
                fmt::format("{} was saved for {} samples (shuffle {}, seed {}) but this sampler "
                            "has {} (shuffle {}, seed {}): the data set or its settings changed",
                            state.description(), size, shuffle, seed, cursor_->size,
                            cursor_->shuffle, cursor_->seed));
  }
  auto consumed = state.get<std::uint64_t>("samples_consumed");
  if (consumed > size) {
    throw Error(ErrorCode::Corruption, fmt::format("{}: position {} is past the {} samples",
                                                   state.description(), consumed, size));
  }
  // Absent from older files: skip_first_batches derives it from the samples consumed.
  const std::size_t batches = state.contains("batches_consumed")
                                  ? state.get<std::uint64_t>("batches_consumed")
                                  : detail::SamplerCursor::kUnknownBatches;
  auto epoch = state.get<std::int64_t>("epoch");
  auto started = state.get<bool>("started");
  // Absent from files of torchpoint 0.1.0 and earlier, which resumed every saved epoch.
  bool finished = state.contains("epoch_finished") && state.get<bool>("epoch_finished");
  cursor_->epoch = epoch;
  cursor_->consumed = consumed;
  cursor_->batches = batches;
  cursor_->started = started;
  cursor_->finished = finished;
  cursor_->restored = true;
  // An epoch whose loop ended is done: the next begin() starts the next one. Otherwise the
  // next begin() continues the saved epoch, even one with no batch left: the loop that was
  // interrupted in its last batch still has its end-of-epoch work to do.
  cursor_->resume_pending = cursor_->started && !cursor_->finished;
  cursor_->order_epoch = -1;
}

void ResumableSampler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("epoch", at::scalar_tensor(cursor_->epoch, at::kLong), /*is_buffer=*/true);
  archive.write("samples_consumed",
                at::scalar_tensor(static_cast<std::int64_t>(cursor_->consumed), at::kLong),
                /*is_buffer=*/true);
}

void ResumableSampler::load(torch::serialize::InputArchive& archive) {
  at::Tensor epoch, consumed;
  archive.read("epoch", epoch, /*is_buffer=*/true);
  archive.read("samples_consumed", consumed, /*is_buffer=*/true);
  cursor_->epoch = epoch.item<std::int64_t>();
  cursor_->consumed = std::min<std::size_t>(consumed.item<std::int64_t>(), cursor_->size);
  cursor_->batches = detail::SamplerCursor::kUnknownBatches;
  cursor_->restored = true;
  cursor_->finished = false;
  cursor_->started = true;
  cursor_->resume_pending = true;
  cursor_->order_epoch = -1;
}

namespace {

// Runs a LibTorch sampler's save() and reads the named tensors back.
template <typename Sampler>
StateDict through_archive(const Sampler& sampler, const std::vector<std::string>& keys,
                          const std::string& type) {
  torch::serialize::OutputArchive out;
  sampler.save(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  std::istringstream in_bytes(bytes.str());
  torch::serialize::InputArchive in;
  in.load_from(in_bytes);
  StateDict sd;
  sd.set_description("sampler");
  sd.set("type", type);
  for (const std::string& key : keys) {
    at::Tensor t;
    in.read(key, t, /*is_buffer=*/true);
    sd.set(key, t);
  }
  return sd;
}

template <typename Sampler>
void into_archive(Sampler& sampler, const StateDict& state, const std::vector<std::string>& keys,
                  const std::string& type) {
  if (state.get<std::string>("type") != type) {
    throw Error(ErrorCode::Incompatible, fmt::format("{} holds a {}, not a {}", state.description(),
                                                     state.get<std::string>("type"), type));
  }
  torch::serialize::OutputArchive out;
  for (const std::string& key : keys) out.write(key, state.tensor(key), /*is_buffer=*/true);
  std::ostringstream bytes;
  out.save_to(bytes);
  std::istringstream in_bytes(bytes.str());
  torch::serialize::InputArchive in;
  in.load_from(in_bytes);
  sampler.load(in);
}

}  // namespace

StateDict sampler_state_dict(const torch::data::samplers::RandomSampler& sampler) {
  return through_archive(sampler, {"index", "indices"}, "RandomSampler");
}
void load_sampler_state_dict(torch::data::samplers::RandomSampler& sampler,
                             const StateDict& state) {
  into_archive(sampler, state, {"index", "indices"}, "RandomSampler");
}
StateDict sampler_state_dict(const torch::data::samplers::SequentialSampler& sampler) {
  return through_archive(sampler, {"index"}, "SequentialSampler");
}
void load_sampler_state_dict(torch::data::samplers::SequentialSampler& sampler,
                             const StateDict& state) {
  into_archive(sampler, state, {"index"}, "SequentialSampler");
}

StateDict TrainingCounters::state_dict() const {
  StateDict sd;
  sd.set_description("counters");
  sd.set("epoch", epoch);
  sd.set("step", step);
  sd.set("batch_in_epoch", batch_in_epoch);
  sd.set("samples_seen", samples_seen);
  return sd;
}

void TrainingCounters::load_state_dict(const StateDict& state) {
  TrainingCounters c;
  c.epoch = state.get<std::int64_t>("epoch");
  c.step = state.get<std::int64_t>("step");
  c.batch_in_epoch = state.get<std::int64_t>("batch_in_epoch");
  c.samples_seen = state.get<std::int64_t>("samples_seen");
  *this = c;
}

void MetricRecords::record(const std::string& set, const std::string& metric, double value) {
  for (Series& s : series_) {
    if (s.set == set && s.metric == metric) {
      s.values.push_back(value);
      return;
    }
  }
  series_.push_back({set, metric, {value}});
}

const std::vector<double>& MetricRecords::values(const std::string& set,
                                                 const std::string& metric) const {
  static const std::vector<double> kNone;
  for (const Series& s : series_) {
    if (s.set == set && s.metric == metric) return s.values;
  }
  return kNone;
}

std::vector<std::pair<std::string, std::string>> MetricRecords::series() const {
  std::vector<std::pair<std::string, std::string>> out;
  for (const Series& s : series_) out.emplace_back(s.set, s.metric);
  return out;
}

StateDict MetricRecords::state_dict() const {
  StateDict sd;
  sd.set_description("records");
  Json index = Json::array();
  for (std::size_t i = 0; i < series_.size(); ++i) {
    const Series& s = series_[i];
    index.push_back({s.set, s.metric});
    sd.set(fmt::format("series.{}", i),
           at::tensor(c10::ArrayRef<double>(s.values), at::TensorOptions().dtype(at::kDouble))
               .reshape({static_cast<std::int64_t>(s.values.size())}));
  }
  sd.set("index", std::move(index));
  return sd;
}

void MetricRecords::load_state_dict(const StateDict& state) {
  std::vector<Series> loaded;
  const Json& index = state.value("index");
  if (!index.is_array()) {
    throw Error(ErrorCode::Corruption,
                fmt::format("{}: 'index' is not a list", state.description()));
  }
  for (std::size_t i = 0; i < index.size(); ++i) {
    const Json& entry = index[i];
    if (!entry.is_array() || entry.size() != 2 || !entry[0].is_string() || !entry[1].is_string()) {
      throw Error(ErrorCode::Corruption,
                  fmt::format("{}: index entry {} is not [set, metric]", state.description(), i));
    }
    at::Tensor t = state.tensor(fmt::format("series.{}", i));
    if (t.scalar_type() != at::kDouble || t.dim() != 1) {
      throw Error(ErrorCode::Corruption,
                  fmt::format("{}: series {} is not a float64 vector", state.description(), i));
    }
    at::Tensor c = t.contiguous();
    const double* p = c.data_ptr<double>();
    loaded.push_back({entry[0].get<std::string>(), entry[1].get<std::string>(),
                      std::vector<double>(p, p + c.numel())});
  }
  series_ = std::move(loaded);
}

}  // namespace torchpoint
