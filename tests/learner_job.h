// A small, deterministic Learner job shared by the Learner tests and the crash child: the
// seed's data (x of 1000x10, y of 1000x1) and models with and without random layers.
#pragma once

#include <torch/torch.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "torchpoint/callbacks.h"
#include "torchpoint/learner.h"

namespace torchpoint::testing {

struct SeedData {
  torch::Tensor x, y;
};

// The seed's random data, the same in every process.
inline SeedData seed_data(std::int64_t samples = 1000) {
  torch::manual_seed(1703);
  return {torch::randn({samples, 10}), torch::randn({samples, 1})};
}

// The seed's model: nn_linear(10, 1) with SGD(lr = 0.01) and MSE. `init_seed` sets its
// initial weights.
inline std::unique_ptr<Learner> linear_learner(std::uint64_t init_seed = 1) {
  torch::manual_seed(init_seed);
  auto model = torch::nn::Linear(10, 1);
  return std::make_unique<Learner>(
      model, make_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.01)), torch::mse_loss);
}

// A model whose training draws random numbers (Dropout) and whose optimizer has state (Adam).
inline std::unique_ptr<Learner> dropout_learner(std::uint64_t init_seed = 1) {
  torch::manual_seed(init_seed);
  auto model = torch::nn::Sequential(torch::nn::Linear(10, 16), torch::nn::ReLU(),
                                     torch::nn::Dropout(0.2), torch::nn::Linear(16, 1));
  return std::make_unique<Learner>(
      model, make_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(1e-2)), torch::mse_loss);
}

// A small GAN over the seed's x: a generator from 4 noise features to 10, and a discriminator
// (with Dropout, so that training draws random numbers) from 10 to one logit. forward(x) is the
// discriminator's score of real samples.
struct TinyGanImpl : torch::nn::Module {
  TinyGanImpl()
      : generator(register_module(
            "generator", torch::nn::Sequential(torch::nn::Linear(4, 16), torch::nn::ReLU(),
                                               torch::nn::Linear(16, 10)))),
        discriminator(register_module(
            "discriminator",
            torch::nn::Sequential(torch::nn::Linear(10, 16), torch::nn::ReLU(),
                                  torch::nn::Dropout(0.2), torch::nn::Linear(16, 1)))) {}
  torch::Tensor forward(torch::Tensor x) { return discriminator->forward(x); }
  torch::nn::Sequential generator, discriminator;
};
TORCH_MODULE(TinyGan);

// The GAN's optimizers, of two kinds: Adam for the generator, SGD with momentum for the
// discriminator (luz's set_optimizers).
inline NamedOptimizers gan_optimizers(TinyGan& gan) {
  return NamedOptimizers{
      {"generator", std::make_shared<torch::optim::Adam>(gan->generator->parameters(),
                                                         torch::optim::AdamOptions(1e-3))},
      {"discriminator",
       std::make_shared<torch::optim::SGD>(gan->discriminator->parameters(),
                                           torch::optim::SGDOptions(0.05).momentum(0.9))}};
}

// Each optimizer's loss, as luz's loss method reading ctx$opt_name: the generator's makes the
// discriminator call fakes real; the discriminator's tells real samples (`real_scores`, the
// forward pass) from fakes. Draws fresh noise on every call.
inline Learner::ContextLoss gan_loss(TinyGan gan) {
  return [gan](const Context& ctx, const at::Tensor& real_scores, const at::Tensor&) mutable {
    at::Tensor fake = gan->generator->forward(torch::randn({real_scores.size(0), 4}));
    auto bce = [](const at::Tensor& logits, double label) {
      return torch::binary_cross_entropy_with_logits(logits, torch::full_like(logits, label));
    };
    if (ctx.opt_name == "generator") return bce(gan->discriminator->forward(fake), 1.0);
    return bce(real_scores, 1.0) + bce(gan->discriminator->forward(fake.detach()), 0.0);
  };
}

inline std::unique_ptr<Learner> gan_learner(std::uint64_t init_seed = 1) {
  torch::manual_seed(init_seed);
  TinyGan gan;
  return std::make_unique<Learner>(gan, gan_optimizers, gan_loss(gan));
}

// The seed's `interrupt` callback: fails once, at the end of epoch 5.
struct Interrupt : Callback {
  explicit Interrupt(std::int64_t epoch = 5) : Callback("interrupt"), at_epoch(epoch) {}
  std::int64_t at_epoch;
  bool failed = false;
  void on_epoch_end(Context& ctx) override {
    if (ctx.epoch == at_epoch && !failed) {
      failed = true;
      throw std::runtime_error("Error on epoch " + std::to_string(at_epoch));
    }
  }
};

// A callback with state of its own (as the seed's weight_grad): the sum of every batch loss
// and the number of batches it saw, kept across resumes through state_dict().
struct LossTally : Callback {
  LossTally() : Callback("loss_tally") {}
  double sum = 0;
  std::int64_t batches = 0;
  void on_train_batch_end(Context& ctx) override {
    sum += ctx.loss.item<double>();
    ++batches;
  }
  StateDict state_dict() const override {
    StateDict s;
    s.set_double("sum", sum);
    s.set("batches", batches);
    return s;
  }
  void load_state_dict(const StateDict& s) override {
    sum = s.get_double("sum");
    batches = s.get<std::int64_t>("batches");
  }
};

}  // namespace torchpoint::testing
