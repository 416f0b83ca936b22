// Optimizer state for all six LibTorch 1.13 optimizers: continuation is bit-identical, and
// mismatches are clear errors that leave the optimizer untouched.
#include "torchpoint/optimizer_state.h"

#include <torch/torch.h>

#include "testing/test_util.h"
#include "torchpoint/error.h"
#include "torchpoint/module_state.h"
#include "torchpoint/tensor_file.h"

namespace torchpoint {
namespace {

using Factory = std::function<std::unique_ptr<torch::optim::Optimizer>(
    std::vector<torch::Tensor> first, std::vector<torch::Tensor> second)>;

struct OptimizerCase {
  std::string name;
  Factory make;
};

torch::nn::Sequential make_model() {
  return torch::nn::Sequential(torch::nn::Linear(6, 5), torch::nn::Tanh(), torch::nn::Linear(5, 2));
}

// Two param groups with different options, so per-group options and positions are exercised.
std::vector<OptimizerCase> cases() {
  using namespace torch::optim;
  auto groups = [](auto first_opts, auto second_opts, std::vector<torch::Tensor> a,
                   std::vector<torch::Tensor> b) {
    std::vector<OptimizerParamGroup> g;
    g.emplace_back(a, std::make_unique<decltype(first_opts)>(first_opts));
    g.emplace_back(b, std::make_unique<decltype(second_opts)>(second_opts));
    return g;
  };
  return {
      {"SGD",
       [=](auto a, auto b) -> std::unique_ptr<Optimizer> {
         return std::make_unique<SGD>(
             groups(SGDOptions(0.05).momentum(0.9).nesterov(true),
                    SGDOptions(0.02).momentum(0.5).weight_decay(1e-3), a, b),
             SGDOptions(0.05));
       }},
      {"Adam",
       [=](auto a, auto b) -> std::unique_ptr<Optimizer> {
         return std::make_unique<Adam>(
             groups(AdamOptions(1e-2), AdamOptions(3e-3).amsgrad(true), a, b), AdamOptions(1e-2));
       }},
      {"AdamW",
       [=](auto a, auto b) -> std::unique_ptr<Optimizer> {
         return std::make_unique<AdamW>(
             groups(AdamWOptions(1e-2).betas({0.8, 0.99}), AdamWOptions(2e-3).amsgrad(true), a, b),
             AdamWOptions(1e-2));
       }},
      {"RMSprop",
       [=](auto a, auto b) -> std::unique_ptr<Optimizer> {
         return std::make_unique<RMSprop>(
             groups(RMSpropOptions(1e-2).momentum(0.9).centered(true), RMSpropOptions(5e-3), a, b),
             RMSpropOptions(1e-2));
       }},
      {"Adagrad",
       [=](auto a, auto b) -> std::unique_ptr<Optimizer> {
         return std::make_unique<Adagrad>(
             groups(AdagradOptions(0.1).lr_decay(1e-3),
                    AdagradOptions(0.05).initial_accumulator_value(0.1), a, b),
             AdagradOptions(0.1));
       }},
      {"LBFGS",
       [=](auto a, auto b) -> std::unique_ptr<Optimizer> {
         std::vector<torch::Tensor> all = a;
         all.insert(all.end(), b.begin(), b.end());
         // LBFGS supports one param group only.
         return std::make_unique<LBFGS>(
             all, LBFGSOptions(0.5).history_size(4).max_iter(3).line_search_fn("strong_wolfe"));
       }},
  };
}

struct TrainRun {
  torch::nn::Sequential model;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
};

TrainRun build(const OptimizerCase& c, std::uint64_t seed) {
  torch::manual_seed(seed);
  TrainRun r{make_model(), nullptr};
  auto params = r.model->parameters();
  std::vector<torch::Tensor> first(params.begin(), params.begin() + 2);
  std::vector<torch::Tensor> second(params.begin() + 2, params.end());
  r.optimizer = c.make(first, second);
  return r;
}

float train_step(TrainRun& r, int step) {
  torch::manual_seed(1000 + step);  // the data of step `step`, the same in every run
  auto x = torch::randn({16, 6});
  auto y = torch::randn({16, 2});
  auto closure = [&] {
    r.optimizer->zero_grad();
    auto loss = torch::mse_loss(r.model->forward(x), y);
    loss.backward();
    return loss;
  };
  return r.optimizer->step(closure).item<float>();
}

class Continuation : public ::testing::TestWithParam<OptimizerCase> {};

TEST_P(Continuation, KStepsSaveLoadMStepsEqualsKPlusMUninterrupted) {
  const OptimizerCase& c = GetParam();
  const int k = 4, m = 5;
  TrainRun uninterrupted = build(c, 1);
  std::vector<float> expected;
  for (int s = 0; s < k + m; ++s) expected.push_back(train_step(uninterrupted, s));

  TrainRun first = build(c, 1);
  for (int s = 0; s < k; ++s) train_step(first, s);
  testing::TempDir dir;
  StateDict sd;
  sd.set_child("model", module_state_dict(*first.model));
  sd.set_child("optimizer", optimizer_state_dict(*first.optimizer));
  save_file(dir / "ckpt.safetensors", sd.to_container());
  first = TrainRun{};  // nothing of the first run survives

  TrainRun resumed = build(c, 77);  // different initial weights: all must come from the file
  StateDict loaded = StateDict::from_container(load_file(dir / "ckpt.safetensors"));
  load_module_state_dict(*resumed.model, loaded.child("model"));
  load_optimizer_state_dict(*resumed.optimizer, loaded.child("optimizer"));
  for (int s = k; s < k + m; ++s) {
    float loss = train_step(resumed, s);
    EXPECT_EQ(std::memcmp(&loss, &expected[s], sizeof loss), 0)
        << c.name << " step " << s << ": " << loss << " vs " << expected[s];
  }
  auto pa = uninterrupted.model->parameters(), pb = resumed.model->parameters();
  for (std::size_t i = 0; i < pa.size(); ++i) {
    EXPECT_TRUE(testing::bitwise_equal(pa[i], pb[i])) << c.name << " parameter " << i;
  }
  // The optimizer states match too, tensor for tensor.
  StateDict sa = optimizer_state_dict(*uninterrupted.optimizer);
  StateDict sb = optimizer_state_dict(*resumed.optimizer);
  ASSERT_EQ(sa.keys(), sb.keys());
  for (const auto& [key, value] : sa.entries()) {
    if (sa.is_tensor(key)) {
      EXPECT_TRUE(testing::bitwise_equal(sa.tensor(key), sb.tensor(key))) << c.name << " " << key;
    } else {
      EXPECT_EQ(sa.value(key), sb.value(key)) << c.name << " " << key;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(AllSix, Continuation, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });

TEST(OptimizerState, RecordsEveryParamGroupOption) {
  TrainRun r = build(cases()[1], 1);  // Adam
  train_step(r, 0);
  StateDict sd = optimizer_state_dict(*r.optimizer);
  EXPECT_EQ(sd.get<std::string>("type"), "Adam");
  EXPECT_EQ(sd.get<double>("param_groups.1.lr"), 3e-3);
  EXPECT_EQ(sd.get<bool>("param_groups.1.amsgrad"), true);
  EXPECT_EQ(sd.value("param_groups.0.betas"), Json::array({0.9, 0.999}));
  EXPECT_EQ(sd.get<std::int64_t>("state.1.1.step"), 1);
  EXPECT_TRUE(sd.is_tensor("state.1.1.max_exp_avg_sq"));
}

TEST(OptimizerState, MismatchesAreClearAndLeaveTheOptimizerUntouched) {
  TrainRun adam = build(cases()[1], 1);
  train_step(adam, 0);
  StateDict saved = optimizer_state_dict(*adam.optimizer);

  TrainRun sgd = build(cases()[0], 1);
  train_step(sgd, 0);
  StateDict sgd_before = optimizer_state_dict(*sgd.optimizer);
  try {
    load_optimizer_state_dict(*sgd.optimizer, saved);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Incompatible);
    EXPECT_NE(
        std::string(e.what()).find("saved from a Adam optimizer but is being loaded into a SGD"),
        std::string::npos)
        << e.what();
  }

  // Same type, other shapes: the second layer is wider.
  torch::manual_seed(5);
  auto wide =
      torch::nn::Sequential(torch::nn::Linear(6, 7), torch::nn::Tanh(), torch::nn::Linear(7, 2));
  auto p = wide->parameters();
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<torch::Tensor>(p.begin(), p.begin() + 2),
                      std::make_unique<torch::optim::AdamOptions>(1e-2));
  groups.emplace_back(std::vector<torch::Tensor>(p.begin() + 2, p.end()),
                      std::make_unique<torch::optim::AdamOptions>(1e-2));
  torch::optim::Adam other(groups, torch::optim::AdamOptions(1e-2));
  try {
    load_optimizer_state_dict(other, saved);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Incompatible);
    EXPECT_NE(std::string(e.what()).find("shape [5, 6] but its parameter has shape [7, 6]"),
              std::string::npos)
        << e.what();
  }
  EXPECT_TRUE(other.state().empty()) << "a failed load must not change the optimizer";
  EXPECT_EQ(other.param_groups()[0].options().get_lr(), 1e-2);

  // One group instead of two.
  torch::optim::Adam one_group(adam.model->parameters(), torch::optim::AdamOptions(1e-2));
  try {
    load_optimizer_state_dict(one_group, saved);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("2 param groups, the optimizer has 1"), std::string::npos);
  }
}

}  // namespace
}  // namespace torchpoint
