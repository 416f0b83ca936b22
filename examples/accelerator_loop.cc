// accelerator_loop: the README's Accelerator loop, a complete crash-and-resume training loop
// with automatic checkpoint naming. The README shows the part between the [loop] markers; a
// test (tests/python/accelerate_resume_check.py) checks that the README still shows it
// verbatim, kills this program with SIGKILL mid-epoch and at an epoch's last batch, reruns it,
// and compares the end with a run that was never interrupted.
//
//   accelerator_loop PROJECT_DIR [--kill-after-step N]
// Prints every batch it trains on ("batch <step>: <sample numbers>") and the final weights.
#include <signal.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "examples/readme_loop_job.h"
#include "torchpoint/torchpoint.h"

namespace tp = torchpoint;

int main(int argc, char** argv) {
  const auto [project, kill_after] = readme_loop::parse_args(argc, argv, "accelerator_loop");
  torch::manual_seed(0);
  torch::nn::Linear model(1, 1);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(1e-4).momentum(0.9));
  auto train_loader = tp::make_resumable_data_loader(
      readme_loop::Numbers().map(torch::data::transforms::Stack<>()),
      torch::data::DataLoaderOptions().batch_size(8), /*shuffle=*/true, /*seed=*/42);
  // [loop]
  tp::Accelerator accelerator(tp::ProjectConfiguration()
                                  .project_dir(project)  // checkpoints/checkpoint_<N> under it
                                  .automatic_checkpoint_naming(true)
                                  .total_limit(3));
  accelerator.prepare(model, optimizer, train_loader);
  accelerator.try_load_state();  // the newest valid checkpoint; nothing on a fresh project
  const long num_epochs = 3, checkpointing_steps = 2;
  // After a resume: the interrupted epoch, whose loop gives only the batches it had left.
  for (auto epoch = train_loader->sampler().next_epoch(); epoch < num_epochs; ++epoch) {
    for (auto& batch : *train_loader) {
      optimizer.zero_grad();
      auto loss = torch::mse_loss(model->forward(batch.data), batch.target);
      accelerator.backward(loss);
      optimizer.step();
      if (accelerator.step() % checkpointing_steps == 0) accelerator.save_state();
      // [loop end]
      readme_loop::print_batch(static_cast<long>(accelerator.step()), batch.data);
      if (accelerator.step() == kill_after) ::raise(SIGKILL);  // the crash, right after a save
      // [loop]
    }
  }
  // [loop end]
  std::printf("final weight %.9g bias %.9g\n", model->weight.item<double>(),
              model->bias.item<double>());
  return 0;
}
