// accelerate_resume: the crash-and-resume loop of Accelerate's examples (step_N checkpoints,
// resumed with skip_first_batches), in C++. The README shows the part between the [loop]
// markers; a test (tests/accelerate_resume_check.cmake) checks that the README still shows it
// verbatim, kills this program with SIGKILL mid-run, reruns it, and compares the end with a run
// that was never interrupted.
//
//   accelerate_resume PROJECT_DIR [--kill-after-step N]
// Prints every batch it trains on ("batch <step>: <sample numbers>") and the final weights.
#include <signal.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include "examples/readme_loop_job.h"
#include "torchpoint/torchpoint.h"

namespace {

// The newest step_<N> under `dir`, or "" when there is none.
std::string newest_checkpoint(const std::string& dir) {
  std::string best;
  long best_step = -1;
  if (!std::filesystem::exists(dir)) return best;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    std::string name = entry.path().filename().string();
    if (name.rfind("step_", 0) != 0 || name.find(".tmp-") != std::string::npos) continue;
    if (!std::filesystem::exists(entry.path() / "manifest.json")) continue;  // not committed
    long step = std::stol(name.substr(5));
    if (step > best_step) best_step = step, best = name;
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const auto [project, kill_after] = readme_loop::parse_args(argc, argv, "accelerate_resume");
  torch::manual_seed(0);
  torch::nn::Linear model(1, 1);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(1e-4).momentum(0.9));
  auto train_dataloader = torchpoint::make_resumable_data_loader(
      readme_loop::Numbers().map(torch::data::transforms::Stack<>()),
      torch::data::DataLoaderOptions().batch_size(8), /*shuffle=*/true, /*seed=*/42);
  torchpoint::Accelerator accelerator(torchpoint::ProjectConfiguration().project_dir(project));
  // [loop]
  accelerator.prepare(model, optimizer, train_dataloader);
  const long num_epochs = 3, checkpointing_steps = 2;
  const long batches_per_epoch = static_cast<long>(train_dataloader->batches_per_epoch());
  long starting_epoch = 0, resume_step = 0, completed_steps = 0;
  std::string path = newest_checkpoint(project);  // "step_<N>", or "" for a fresh run
  if (!path.empty()) {
    accelerator.load_state(project + "/" + path);  // model, optimizer, RNG, data position
    completed_steps = std::stol(path.substr(5));
    starting_epoch = completed_steps / batches_per_epoch;
    resume_step = completed_steps % batches_per_epoch;  // 0 after an epoch's last batch
  }
  for (long epoch = starting_epoch; epoch < num_epochs; ++epoch) {
    auto active_dataloader = train_dataloader;
    if (!path.empty() && epoch == starting_epoch) {
      // Also when resume_step is 0: the epoch after the checkpoint's, from its first batch.
      active_dataloader = accelerator.skip_first_batches(train_dataloader, resume_step);
    }
    for (auto& batch : *active_dataloader) {
      optimizer.zero_grad();
      auto loss = torch::mse_loss(model->forward(batch.data), batch.target);
      accelerator.backward(loss);
      optimizer.step();
      ++completed_steps;
      // [loop end]
      readme_loop::print_batch(completed_steps, batch.data);
      // [loop]
      if (completed_steps % checkpointing_steps == 0) {
        accelerator.save_state(project + "/step_" + std::to_string(completed_steps));
      }
      // [loop end]
      if (completed_steps == kill_after) ::raise(SIGKILL);  // the crash, right after a step
      // [loop]
    }
  }
  // [loop end]
  std::printf("final weight %.9g bias %.9g\n", model->weight.item<double>(),
              model->bias.item<double>());
  return 0;
}
