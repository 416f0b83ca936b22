// The main job of this repository (for now): train a small model, save its state to a
// directory checkpoint, load it into freshly built objects, and show that training continues
// bit for bit; then show what torchpoint does with a corrupt file and an existing checkpoint.
//
// Usage: torchpoint_demo WORK_DIR
#include <fmt/format.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>

#include "torchpoint/checkpoint_dir.h"
#include "torchpoint/error.h"
#include "torchpoint/module_state.h"
#include "torchpoint/optimizer_state.h"
#include "torchpoint/tensor_file.h"

namespace tp = torchpoint;

namespace {

struct Run {
  torch::nn::Sequential model{torch::nn::Linear(10, 32), torch::nn::ReLU(),
                              torch::nn::Linear(32, 1)};
  torch::optim::Adam optimizer{model->parameters(), torch::optim::AdamOptions(1e-2)};
};

torch::Tensor x_data() { return torch::linspace(-1, 1, 640).reshape({64, 10}); }
torch::Tensor y_data() { return x_data().sum(1, /*keepdim=*/true).sin(); }

float train_step(Run& run) {
  run.optimizer.zero_grad();
  torch::Tensor loss = torch::mse_loss(run.model->forward(x_data()), y_data());
  loss.backward();
  run.optimizer.step();
  return loss.item<float>();
}

// The model's parameters and buffers by name, and Adam's state by parameter position (the
// state layer's adapters), one component each.
std::vector<tp::Component> snapshot(Run& run) {
  return {{"model", tp::module_state_dict(*run.model).to_container()},
          {"optimizer", tp::optimizer_state_dict(run.optimizer).to_container()}};
}

void restore(Run& run, const tp::DirectoryCheckpoint& ckpt) {
  tp::load_module_state_dict(*run.model,
                             tp::StateDict::from_container(ckpt.components.at(0).contents));
  tp::load_optimizer_state_dict(run.optimizer,
                                tp::StateDict::from_container(ckpt.components.at(1).contents));
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: torchpoint_demo WORK_DIR\n");
    return 2;
  }
  const std::string work = argv[1];
  const std::string ckpt_dir = work + "/checkpoints/checkpoint_0";
  int failures = 0;
  auto check = [&](bool ok, const std::string& what) {
    std::printf("  [%s] %s\n", ok ? "ok" : "FAILED", what.c_str());
    if (!ok) ++failures;
  };

  torch::manual_seed(0);
  Run original;
  for (int i = 0; i < 20; ++i) train_step(original);
  std::printf("trained 20 steps; saving to %s\n", ckpt_dir.c_str());
  tp::CheckpointInfo info;
  info.step = 20;
  tp::save_directory(ckpt_dir, snapshot(original), info);

  std::printf("loading into a freshly built model and optimizer\n");
  torch::manual_seed(123);  // different initial weights: everything must come from the file
  Run resumed;
  tp::DirectoryCheckpoint loaded = tp::load_directory(ckpt_dir);
  restore(resumed, loaded);
  check(loaded.info.step == 20, fmt::format("manifest step is {}", loaded.info.step));
  bool params_equal = true;
  auto a = original.model->parameters();
  auto b = resumed.model->parameters();
  for (std::size_t i = 0; i < a.size(); ++i) params_equal = params_equal && a[i].equal(b[i]);
  check(params_equal, fmt::format("all {} parameters are bit-identical", a.size()));

  bool losses_equal = true;
  for (int i = 0; i < 10; ++i) {
    float la = train_step(original);
    float lb = train_step(resumed);
    losses_equal = losses_equal && same_bits(la, lb);
    if (i == 9) std::printf("  step 30 loss: original %.9g, resumed %.9g\n", la, lb);
  }
  check(losses_equal, "10 more steps give bit-identical losses (model + Adam state restored)");

  tp::VerifyReport report = tp::verify(ckpt_dir);
  check(report.ok(), "verify: every checksum of the checkpoint matches");

  std::printf("damaging a copy of the model file (one flipped bit)\n");
  {
    std::ifstream in(ckpt_dir + "/model.safetensors", std::ios::binary);
    std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    bytes[bytes.size() - 3] ^= 0x10;
    std::ofstream(work + "/damaged.safetensors", std::ios::binary) << bytes;
  }
  tp::VerifyReport damaged = tp::verify(work + "/damaged.safetensors");
  check(!damaged.ok(), "verify reports the damage");
  for (const std::string& p : damaged.problems) std::printf("    %s\n", p.c_str());
  try {
    tp::load_file(work + "/damaged.safetensors");
    check(false, "load of the damaged file must fail");
  } catch (const tp::Error& e) {
    check(e.code() == tp::ErrorCode::Corruption, "load refuses it with a Corruption error");
  }

  std::printf("saving again under the same name\n");
  try {
    tp::save_directory(ckpt_dir, snapshot(original));
    check(false, "overwriting a committed checkpoint must fail");
  } catch (const tp::Error& e) {
    check(e.code() == tp::ErrorCode::InvalidArgument,
          "refused: committed checkpoints are never overwritten");
    std::printf("    %s\n", e.what());
  }
  std::printf("%s\n", failures == 0 ? "demo: all checks passed" : "demo: SOME CHECKS FAILED");
  return failures == 0 ? 0 : 1;
}
