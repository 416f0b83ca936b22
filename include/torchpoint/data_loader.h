// A LibTorch DataLoader bundled with its ResumableSampler: iterate it like a DataLoader, and
// its position (epoch, batches consumed) is saved and restored with the rest of the run.
#pragma once

#include <torch/data/dataloader.h>
#include <torch/data/dataloader_options.h>

#include <cstdint>
#include <memory>

#include "torchpoint/data_position.h"
#include "torchpoint/error.h"

namespace torchpoint {

// Example:
//   auto loader = torchpoint::make_resumable_data_loader(
//       dataset.map(torch::data::transforms::Stack<>()),
//       torch::data::DataLoaderOptions().batch_size(32), /*shuffle=*/true, /*seed=*/0);
//   for (auto& batch : *loader) { ... }           // one epoch per loop
//   loader->sampler().state_dict();               // where the run is in its data
template <typename Dataset>
class ResumableDataLoader {
 public:
  using Loader = torch::data::StatelessDataLoader<Dataset, ResumableSampler>;

  ResumableDataLoader(Dataset dataset, torch::data::DataLoaderOptions options, bool shuffle,
                      std::uint64_t seed)
      : sampler_(dataset.size().value(), shuffle, seed),
        loader_(std::make_unique<Loader>(std::move(dataset), sampler_, options)) {}

  // Starts the next epoch, or continues a restored or skipped-into one (see ResumableSampler).
  auto begin() { return tracked().begin(); }
  auto end() { return tracked().end(); }

  ResumableSampler& sampler() { return sampler_; }
  const ResumableSampler& sampler() const { return sampler_; }
  std::size_t batch_size() const { return loader_->options().batch_size; }
  // Batches in one whole epoch (of this process, when the sampler is sharded).
  std::size_t batches_per_epoch() const {
    std::size_t n = sampler_.size(), b = batch_size() * sampler_.shard_count();
    return loader_->options().drop_last ? n / b : (n + b - 1) / b;
  }
  // The next iteration starts `batches` batches into the epoch it iterates (see
  // ResumableSampler::skip_first_batches), without reading the skipped samples; the one after
  // it is a whole epoch again.
  void skip_first_batches(std::size_t batches) {
    sampler_.skip_first_batches(batches, batch_size(), loader_->options().drop_last);
  }

 private:
  typename ResumableSampler::template Tracked<Loader> tracked() { return sampler_.track(*loader_); }

  ResumableSampler sampler_;  // shares its position with the loader's copy
  std::unique_ptr<Loader> loader_;
};

template <typename Dataset>
std::shared_ptr<ResumableDataLoader<Dataset>> make_resumable_data_loader(
    Dataset dataset, torch::data::DataLoaderOptions options, bool shuffle = true,
    std::uint64_t seed = 0) {
  return std::make_shared<ResumableDataLoader<Dataset>>(std::move(dataset), options, shuffle, seed);
}

}  // namespace torchpoint
