// The training job of the Accelerator tests: MLP with Dropout, Adam, StepLR, GradScaler and
// shuffled data, driven through an Accelerator that saves every `save_every` steps (not
// aligned with the 13-batch epochs).
#pragma once

#include <torch/torch.h>

#include <functional>

#include "torchpoint/accelerator.h"
#include "torchpoint/data_loader.h"
#include "torchpoint/module_state.h"
#include "torchpoint/optimizer_state.h"

namespace torchpoint::testing {

struct JobData : torch::data::datasets::Dataset<JobData> {
  JobData() {
    torch::manual_seed(123);
    x = torch::randn({200, 10});
    y = x.sum(1, true).sin();
  }
  torch::data::Example<> get(std::size_t i) override { return {x[i], y[i]}; }
  c10::optional<std::size_t> size() const override { return 200; }
  torch::Tensor x, y;
};

using JobDataset = torch::data::datasets::MapDataset<JobData, torch::data::transforms::Stack<>>;

struct AcceleratorJob {
  static constexpr int kEpochs = 3;

  explicit AcceleratorJob(ProjectConfiguration config, Env& env = Env::posix(), int hidden = 32)
      : acc(std::move(config), env),
        loader(make_resumable_data_loader(JobData().map(torch::data::transforms::Stack<>()),
                                          torch::data::DataLoaderOptions().batch_size(16),
                                          /*shuffle=*/true, /*seed=*/5)),
        model((torch::manual_seed(1),
               torch::nn::Sequential(torch::nn::Linear(10, hidden), torch::nn::Dropout(0.2),
                                     torch::nn::ReLU(), torch::nn::Linear(hidden, 1)))),
        optimizer(model->parameters(), torch::optim::AdamOptions(1e-2)),
        scheduler(optimizer, StepLROptions(1).gamma(0.9)),
        scaler(GradScalerOptions().init_scale(1024).growth_interval(4)) {
    acc.prepare(model, optimizer, loader, scheduler, scaler);
    acc.register_for_checkpointing(counters);
  }

  // Trains to the end; calls on_step(step, loss) after each step and saves every save_every.
  void train(int save_every, const std::function<void(std::int64_t, float)>& on_step = {},
             const std::function<void(std::int64_t)>& after_save = {}) {
    while (counters.epoch < kEpochs) {
      for (auto& batch : *loader) {
        optimizer.zero_grad();
        auto loss = torch::mse_loss(model->forward(batch.data), batch.target);
        // Every 7th step overflows: the scaler skips it and backs off.
        acc.backward(counters.step % 7 == 3 ? loss * 1e38f * 1e10f : loss);
        acc.optimizer_step(optimizer);
        ++counters.step;
        ++counters.batch_in_epoch;
        if (on_step) on_step(counters.step, loss.item<float>());
        if (save_every > 0 && counters.step % save_every == 0) {
          if (save) {
            save(counters.step, loss.item<float>());
          } else {
            acc.save_state();
          }
          if (after_save) after_save(counters.step);
        }
      }
      scheduler.step();
      ++counters.epoch;
      counters.batch_in_epoch = 0;
    }
  }

  // Model, optimizer and scheduler state and the CPU RNG, as one StateDict for comparisons.
  StateDict final_state() {
    StateDict sd;
    sd.set_child("model", module_state_dict(*model));
    sd.set_child("optimizer", optimizer_state_dict(optimizer));
    sd.set_child("scheduler", scheduler.state_dict());
    sd.set_child("scaler", scaler.state_dict());
    RngState rng;
    sd.set_child("rng", rng.state_dict());
    return sd;
  }

  // Replaces acc.save_state() when set: save(step, loss).
  std::function<void(std::int64_t, float)> save;

  Accelerator acc;
  std::shared_ptr<ResumableDataLoader<JobDataset>> loader;
  torch::nn::Sequential model;
  torch::optim::Adam optimizer;
  StepLR scheduler;
  GradScaler scaler;
  TrainingCounters counters;
};

}  // namespace torchpoint::testing
