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

#include "torchpoint/torchpoint.h"

namespace tp = torchpoint;

namespace {

// Sample i is the number i.
struct Numbers : torch::data::datasets::Dataset<Numbers> {
  torch::data::Example<> get(std::size_t i) override {
    auto v = torch::full({1}, static_cast<float>(i));
    return {v, v * 0.25};
  }
  c10::optional<std::size_t> size() const override { return 50; }
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: accelerator_loop PROJECT_DIR [--kill-after-step N]\n");
    return 2;
  }
  const std::string project = argv[1];
  const long kill_after =
      argc >= 4 && std::string(argv[2]) == "--kill-after-step" ? std::atol(argv[3]) : -1;
  torch::manual_seed(0);
  torch::nn::Linear model(1, 1);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(1e-4).momentum(0.9));
  auto train_loader = tp::make_resumable_data_loader(
      Numbers().map(torch::data::transforms::Stack<>()),
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
      std::printf("batch %ld:", static_cast<long>(accelerator.step()));
      for (std::int64_t i = 0; i < batch.data.size(0); ++i) {
        std::printf(" %d", static_cast<int>(batch.data[i][0].item<float>()));
      }
      std::printf("\n");
      std::fflush(stdout);
      if (accelerator.step() == kill_after) ::raise(SIGKILL);  // the crash, right after a save
      // [loop]
    }
  }
  // [loop end]
  std::printf("final weight %.9g bias %.9g\n", model->weight.item<double>(),
              model->bias.item<double>());
  return 0;
}
