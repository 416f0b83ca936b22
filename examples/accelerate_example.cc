// The checkpointing example of Hugging Face Accelerate's guide (seed 000), in C++:
// prepare a model, optimizer and data loader, register the LR scheduler, save the starting
// state, train, restore checkpoint_0, and resume 100 batches into an epoch.
//
// Usage: accelerate_example WORK_DIR
#include <fmt/format.h>
#include <torch/torch.h>

#include <cstdio>

#include "torchpoint/accelerator.h"
#include "torchpoint/error.h"

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
  if (argc != 2) {
    std::fprintf(stderr, "usage: accelerate_example WORK_DIR\n");
    return 2;
  }
  const std::string save_path = std::string(argv[1]) + "/my/save/path";
  int failures = 0;
  auto check = [&](bool ok, const std::string& what) {
    std::printf("  [%s] %s\n", ok ? "ok" : "FAILED", what.c_str());
    if (!ok) ++failures;
  };

  tp::Accelerator accelerator(
      tp::ProjectConfiguration().project_dir(save_path).automatic_checkpoint_naming(true));
  torch::manual_seed(0);
  auto my_model =
      torch::nn::Sequential(torch::nn::Linear(10, 32), torch::nn::ReLU(), torch::nn::Linear(32, 1));
  torch::optim::SGD my_optimizer(my_model->parameters(),
                                 torch::optim::SGDOptions(0.05).momentum(0.9));
  auto my_training_dataloader = tp::make_resumable_data_loader(
      Regression().map(torch::data::transforms::Stack<>()),
      torch::data::DataLoaderOptions().batch_size(16), /*shuffle=*/true, /*seed=*/0);
  tp::StepLR my_scheduler(my_optimizer, tp::StepLROptions(1).gamma(0.99));
  auto [model, optimizer, train_dataloader] =
      accelerator.prepare(my_model, my_optimizer, my_training_dataloader);

  // Register the LR scheduler
  accelerator.register_for_checkpointing(my_scheduler);

  // Save the starting state
  std::string first = accelerator.save_state();
  std::printf("saved the starting state to %s\n", first.c_str());
  auto initial_weight = model->parameters()[0].clone();

  auto device = accelerator.device();
  model->to(device);
  const int num_epochs = 2;
  for (int epoch = 0; epoch < num_epochs; ++epoch) {
    double total = 0;
    int batches = 0;
    for (auto& batch : *train_dataloader) {
      optimizer.zero_grad();
      auto inputs = batch.data.to(device);
      auto targets = batch.target.to(device);
      auto outputs = model->forward(inputs);
      auto loss = torch::mse_loss(outputs, targets);
      accelerator.backward(loss);
      optimizer.step();
      total += loss.item<double>();
      ++batches;
    }
    my_scheduler.step();
    std::printf("epoch %d: %d batches, mean loss %.4f, lr %.4f\n", epoch, batches, total / batches,
                my_scheduler.get_last_lr()[0]);
  }

  // Restore the previous state
  tp::LoadStateReport report = accelerator.load_state(save_path + "/checkpoints/checkpoint_0");
  std::printf("restored %s: %s\n", report.path.c_str(),
              fmt::format("{}", fmt::join(report.components, ", ")).c_str());
  check(model->parameters()[0].equal(initial_weight),
        "model weights are back to the starting state");
  check(my_scheduler.get_last_lr()[0] == 0.05, "the registered LR scheduler is back at lr 0.05");
  check(accelerator.save_state() == save_path + "/checkpoints/checkpoint_1",
        "the next save is checkpoint_1 (the iteration was restored, not reset)");

  // Assume the checkpoint was saved 100 steps into the epoch
  auto skipped_dataloader = accelerator.skip_first_batches(train_dataloader, 100);
  auto order = train_dataloader->sampler().order_of(train_dataloader->sampler().epoch());
  int first_epoch = 0;
  bool first_batch_right = false;
  for (auto& batch : *skipped_dataloader) {
    if (first_epoch == 0) {
      // Batch 100 starts at sample 1600 of this epoch's order.
      first_batch_right = batch.data[0].equal(Regression().x[order[1600]]);
    }
    ++first_epoch;
  }
  check(
      first_epoch == 25 && first_batch_right,
      fmt::format("after skip_first_batches(100): {} batches, starting at batch 100", first_epoch));
  int second_epoch = 0;
  for (auto& batch : *train_dataloader) {
    (void)batch;
    ++second_epoch;
  }
  check(second_epoch == 125,
        fmt::format("the next epoch is whole again: {} batches", second_epoch));

  try {
    tp::Accelerator manual(tp::ProjectConfiguration().project_dir(save_path));
    manual.save_state();
    check(false, "save_state() without a directory or automatic naming must fail");
  } catch (const tp::Error& e) {
    check(e.code() == tp::ErrorCode::InvalidArgument,
          "without automatic naming, a directory is required:");
    std::printf("    %s\n", e.what());
  }
  std::printf("%s\n", failures == 0 ? "accelerate example: all checks passed"
                                    : "accelerate example: SOME CHECKS FAILED");
  return failures == 0 ? 0 : 1;
}
