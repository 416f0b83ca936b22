// The loop of Accelerate's checkpointing guide (seed 000) on several processes, as torchrun runs
// it: every process runs this program; the Accelerator finds the others through torchrun's
// environment, gives every process rank 0's weights, averages the gradients, gives each process
// its part of every batch, and writes one checkpoint for all of them. Rerun after a crash (or let
// torchrun restart it) and it continues from the newest checkpoint, bit for bit.
//
// Usage:
//   torchrun --nproc-per-node 2 --max-restarts 1 --no-python accelerate_torchrun WORK_DIR
//   [KILL_STEP [EPOCHS]]
// With KILL_STEP (-1: none), rank 1 kills itself with SIGKILL after that step on torchrun's first
// attempt. EPOCHS: how many epochs to train (2).
// The main process writes the final weights to WORK_DIR/final_model.safetensors.
#include <fmt/format.h>
#include <signal.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>

#include "torchpoint/accelerator.h"
#include "torchpoint/module_state.h"
#include "torchpoint/tensor_file.h"

namespace tp = torchpoint;

namespace {

struct Regression : torch::data::datasets::Dataset<Regression> {
  Regression() {
    torch::manual_seed(7);
    x = torch::randn({2000, 10});
    y = x.sum(1, true).sin();
  }
  torch::data::Example<> get(std::size_t i) override { return {x[i], y[i]}; }
  c10::optional<std::size_t> size() const override { return 2000; }
  torch::Tensor x, y;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: accelerate_torchrun WORK_DIR [KILL_STEP [EPOCHS]]\n");
    return 2;
  }
  const std::string work = argv[1];
  const long kill_step = argc > 2 ? std::atol(argv[2]) : -1;
  const long num_epochs = argc > 3 ? std::atol(argv[3]) : 2;
  const char* restarts = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const bool first_attempt = restarts == nullptr || std::string(restarts) == "0";

  tp::Accelerator accelerator(
      tp::ProjectConfiguration().project_dir(work).automatic_checkpoint_naming(true).total_limit(
          2));
  torch::manual_seed(0);
  auto my_model =
      torch::nn::Sequential(torch::nn::Linear(10, 32), torch::nn::ReLU(), torch::nn::Linear(32, 1));
  torch::optim::SGD my_optimizer(my_model->parameters(),
                                 torch::optim::SGDOptions(0.05).momentum(0.9));
  // 16 samples per process and step: 2 processes train on global batches of 32.
  auto my_training_dataloader = tp::make_resumable_data_loader(
      Regression().map(torch::data::transforms::Stack<>()),
      torch::data::DataLoaderOptions().batch_size(16), /*shuffle=*/true, /*seed=*/0);
  tp::StepLR my_scheduler(my_optimizer, tp::StepLROptions(1).gamma(0.99));
  tp::TrainingCounters counters;
  auto [model, optimizer, train_dataloader] =
      accelerator.prepare(my_model, my_optimizer, my_training_dataloader);
  accelerator.register_for_checkpointing(my_scheduler, counters);
  accelerator.print(fmt::format("process {} of {} (torchrun attempt {})",
                                accelerator.process_index(), accelerator.num_processes(),
                                restarts ? restarts : "-"));

  if (auto report = accelerator.try_load_state()) {
    accelerator.print(fmt::format("resumed from {} at step {}", report->path, report->step));
  }
  while (counters.epoch < num_epochs) {
    for (auto& batch : *train_dataloader) {
      optimizer.zero_grad();
      auto loss = torch::mse_loss(model->forward(batch.data), batch.target);
      accelerator.backward(loss);
      optimizer.step();
      ++counters.step;
      if (counters.step % 25 == 0) accelerator.save_state();
      if (counters.step == kill_step && first_attempt && accelerator.process_index() == 1) {
        std::fprintf(stderr, "rank 1: killing itself with SIGKILL after step %ld\n", kill_step);
        ::raise(SIGKILL);
      }
    }
    my_scheduler.step();
    ++counters.epoch;
    accelerator.print(fmt::format("epoch {} done at step {}, lr {:.4f}", counters.epoch,
                                  counters.step, my_scheduler.get_last_lr()[0]));
  }
  if (accelerator.is_main_process()) {
    tp::save_file(work + "/final_model.safetensors", tp::module_state_dict(*model).to_container());
    accelerator.print("final weights written to " + work + "/final_model.safetensors");
  }
  return 0;
}
