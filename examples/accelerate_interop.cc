// From Python Accelerate to C++ and back. examples/accelerate_interop.py trains with the real
// accelerate and calls save_state(); this program loads that directory with
// Accelerator::load_state, trains 10 more steps in C++, saves, and exports the checkpoint in
// Accelerate's layout, which the Python script loads with accelerator.load_state() to finish.
//
// Usage: accelerate_interop WORK_DIR  (after accelerate_interop.py start WORK_DIR)
#include <fmt/format.h>
#include <torch/torch.h>

#include <cstdio>

#include "torchpoint/accelerate_interop.h"
#include "torchpoint/accelerator.h"
#include "torchpoint/error.h"

namespace tp = torchpoint;

namespace {

// The batches of the Python script, computed the same way.
std::pair<torch::Tensor, torch::Tensor> batch(std::int64_t k) {
  torch::Tensor x = torch::linspace(-1, 1, 32).reshape({8, 4}) * ((k % 5) + 1) / 5;
  return {x, x.sum(1, /*keepdim=*/true).sin()};
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: accelerate_interop WORK_DIR\n");
    return 2;
  }
  const std::string work = argv[1];
  try {
    // [interop]
    tp::Accelerator accelerator(
        tp::ProjectConfiguration().project_dir(work + "/cpp").automatic_checkpoint_naming(true));
    auto model = torch::nn::Sequential(torch::nn::Linear(4, 16), torch::nn::Tanh(),
                                       torch::nn::Linear(16, 1));
    torch::optim::AdamW optimizer(model->parameters(), torch::optim::AdamWOptions(0.05));
    tp::StepLR scheduler(optimizer, tp::StepLROptions(5).gamma(0.5));
    accelerator.prepare(model, optimizer);
    accelerator.register_for_checkpointing(scheduler);

    // A directory written by Python's accelerator.save_state().
    tp::LoadStateReport report =
        accelerator.load_state(work + "/python/checkpoints/checkpoint_0");
    for (const std::string& line : report.not_applicable) fmt::print("  note: {}\n", line);

    float loss = 0;
    for (int i = 0; i < 10; ++i) {
      auto [x, y] = batch(accelerator.step());
      torch::Tensor l = torch::mse_loss(model->forward(x), y);
      accelerator.backward(l);
      optimizer.step();
      scheduler.step();
      optimizer.zero_grad();
      loss = l.item<float>();
    }
    std::string saved = accelerator.save_state();
    // The same checkpoint in Accelerate's layout, for Python's accelerator.load_state().
    tp::export_accelerate_checkpoint(saved, work + "/back_to_python");
    // [interop end]
    fmt::print("  C++: load_state(checkpoint_0 of Python): step {}, files {}\n", report.step,
               fmt::join(report.components, ", "));
    fmt::print("  C++: 10 more steps (loss {:.6f}), save_state() -> {}, exported to {}\n", loss,
               saved, work + "/back_to_python");
    return 0;
  } catch (const tp::Error& e) {
    std::fprintf(stderr, "accelerate_interop: %s\n", e.what());
    return 1;
  }
}
