// GradScaler: PyTorch's scaling arithmetic, skipped steps, growth and backoff, the state
// round trip, and a resumed mixed-precision-style run that matches an uninterrupted one bit for
// bit.
#include "torchpoint/grad_scaler.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "testing/test_util.h"
#include "torchpoint/error.h"
#include "torchpoint/state_dict.h"
#include "torchpoint/tensor_file.h"

namespace torchpoint {
namespace {

using testing::bitwise_equal;
using testing::expect_error;
using testing::TempDir;

std::uint64_t bits(double d) { return std::bit_cast<std::uint64_t>(d); }

// A parameter with gradient `grad` and a plain SGD optimizer over it.
struct OneParam {
  explicit OneParam(std::vector<float> grad, double lr = 0.5)
      : param(torch::ones({static_cast<int64_t>(grad.size())}).requires_grad_()),
        optimizer({param}, torch::optim::SGDOptions(lr)) {
    set_grad(std::move(grad));
  }
  void set_grad(std::vector<float> grad) { param.mutable_grad() = torch::tensor(grad); }

  torch::Tensor param;
  torch::optim::SGD optimizer;
};

int64_t tracker(const GradScaler& scaler) {
  return scaler.state_dict().get<int64_t>("_growth_tracker");
}

TEST(GradScalerTest, DefaultsArePyTorchs) {
  GradScalerOptions options;
  EXPECT_EQ(options.init_scale(), 65536.0);
  EXPECT_EQ(options.growth_factor(), 2.0);
  EXPECT_EQ(options.backoff_factor(), 0.5);
  EXPECT_EQ(options.growth_interval(), 2000);
  EXPECT_TRUE(options.enabled());
  GradScaler scaler;
  EXPECT_TRUE(scaler.is_enabled());
  EXPECT_EQ(scaler.get_scale(), 65536.0);
}

TEST(GradScalerTest, ScaleMultipliesByFloat32Scale) {
  GradScaler scaler(GradScalerOptions().init_scale(3.0));
  torch::Tensor loss = torch::tensor(1.7f);
  torch::Tensor scaled = scaler.scale(loss);
  // PyTorch: outputs * _scale, with _scale a float32 tensor of shape [1].
  EXPECT_TRUE(bitwise_equal(scaled, loss * torch::full({1}, 3.0, torch::kFloat)));
  EXPECT_EQ(scaled.sizes(), torch::IntArrayRef({1}));
}

TEST(GradScalerTest, UnscaleUsesPyTorchsReciprocal) {
  // 3 has no exact float reciprocal: the rounding must be PyTorch's, in double then float.
  GradScaler scaler(GradScalerOptions().init_scale(3.0));
  OneParam p({3.0f, 5.0f, -7.0f, 1e-3f});
  torch::Tensor original = p.param.grad().clone();
  scaler.unscale_(p.optimizer);
  torch::Tensor inv_scale =
      torch::full({1}, 3.0, torch::kFloat).to(torch::kDouble).reciprocal().to(torch::kFloat);
  EXPECT_TRUE(bitwise_equal(p.param.grad(), original * inv_scale));
  // Dividing by the scale instead gives other bits for 5 and -7.
  EXPECT_FALSE(bitwise_equal(p.param.grad(), original / 3.0f));

  expect_error([&] { scaler.unscale_(p.optimizer); }, ErrorCode::InvalidArgument,
               {"unscale_() has already been called"});

  // step() does not unscale a second time.
  torch::Tensor before = p.param.detach().clone();
  EXPECT_TRUE(scaler.step(p.optimizer));
  EXPECT_TRUE(bitwise_equal(p.param.detach(), before - 0.5 * original * inv_scale));
  expect_error([&] { scaler.step(p.optimizer); }, ErrorCode::InvalidArgument,
               {"step() has already been called"});
  expect_error([&] { scaler.unscale_(p.optimizer); }, ErrorCode::InvalidArgument, {"after step()"});
  scaler.update();
  // A new iteration may unscale again.
  p.set_grad({1, 2, 3, 4});
  scaler.unscale_(p.optimizer);
}

TEST(GradScalerTest, InfOrNanGradientSkipsTheStepAndBacksOff) {
  for (float bad :
       {std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()}) {
    GradScaler scaler(GradScalerOptions().init_scale(1024.0).growth_interval(3));
    OneParam p({1.0f, 2.0f});
    EXPECT_TRUE(scaler.step(p.optimizer));
    scaler.update();
    EXPECT_EQ(tracker(scaler), 1);

    p.set_grad({1.0f, bad});
    torch::Tensor before = p.param.detach().clone();
    EXPECT_FALSE(scaler.step(p.optimizer)) << bad;
    EXPECT_TRUE(bitwise_equal(p.param.detach(), before)) << "the step must be skipped";
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), 512.0);
    EXPECT_EQ(tracker(scaler), 0) << "backoff resets the growth tracker";
  }
}

TEST(GradScalerTest, GrowsAfterGrowthIntervalGoodSteps) {
  GradScaler scaler(GradScalerOptions().init_scale(8.0).growth_interval(3).growth_factor(1.5));
  OneParam p({1.0f});
  std::vector<double> scales;
  std::vector<int64_t> trackers;
  for (int i = 0; i < 7; ++i) {
    if (i == 4) p.set_grad({std::numeric_limits<float>::infinity()});
    if (i == 5) p.set_grad({1.0f});
    scaler.step(p.optimizer);
    scaler.update();
    scales.push_back(scaler.get_scale());
    trackers.push_back(tracker(scaler));
  }
  EXPECT_EQ(scales, (std::vector<double>{8, 8, 12, 12, 6, 6, 6}));
  EXPECT_EQ(trackers, (std::vector<int64_t>{1, 2, 0, 1, 0, 1, 2}));
}

TEST(GradScalerTest, GrowthStopsBeforeFloat32Overflow) {
  const double big = std::numeric_limits<float>::max() / 1.5;
  GradScaler scaler(GradScalerOptions().init_scale(big).growth_interval(1));
  OneParam p({0.0f});
  scaler.step(p.optimizer);
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), static_cast<double>(static_cast<float>(big)));
  EXPECT_EQ(tracker(scaler), 0);
}

TEST(GradScalerTest, UpdateWithNewScaleAndMisuse) {
  GradScaler scaler;
  expect_error([&] { scaler.update(); }, ErrorCode::InvalidArgument, {"no inf checks"});
  scaler.update(0.1);
  EXPECT_EQ(scaler.get_scale(), static_cast<double>(0.1f));

  torch::Tensor param = torch::ones({2}).requires_grad_();
  torch::optim::SGD no_grads({param}, torch::optim::SGDOptions(0.1));
  expect_error([&] { scaler.step(no_grads); }, ErrorCode::InvalidArgument, {"no parameter"});

  OneParam half({1.0f});
  half.param.mutable_grad() = torch::ones({1}, torch::kHalf);
  expect_error([&] { scaler.unscale_(half.optimizer); }, ErrorCode::InvalidArgument, {"float16"});

  expect_error([] { GradScaler bad(GradScalerOptions().growth_factor(0.9).backoff_factor(1.0)); },
               ErrorCode::InvalidArgument, {"growth_factor", "backoff_factor"});
}

TEST(GradScalerTest, DisabledIsAPassThrough) {
  GradScaler scaler(GradScalerOptions().enabled(false));
  EXPECT_FALSE(scaler.is_enabled());
  torch::Tensor loss = torch::tensor(2.5f);
  EXPECT_TRUE(scaler.scale(loss).is_same(loss));
  OneParam p({std::numeric_limits<float>::infinity()});
  EXPECT_TRUE(scaler.step(p.optimizer)) << "a disabled scaler always steps";
  EXPECT_TRUE(std::isinf(p.param[0].item<float>()));
  scaler.update();
  EXPECT_EQ(scaler.get_scale(), 1.0);
  EXPECT_TRUE(scaler.state_dict().empty());

  // An enabled scaler refuses the empty state of a disabled one.
  GradScaler enabled;
  expect_error([&] { enabled.load_state_dict(scaler.state_dict()); }, ErrorCode::Incompatible,
               {"empty", "disabled"});
  // A disabled scaler ignores any state, as PyTorch does.
  scaler.load_state_dict(enabled.state_dict());
  EXPECT_EQ(scaler.get_scale(), 1.0);
}

TEST(GradScalerTest, StateRoundTripsThroughAFileExactly) {
  GradScaler scaler(
      GradScalerOptions().init_scale(1000.0).growth_factor(1.1).backoff_factor(0.3).growth_interval(
          5));
  OneParam p({std::numeric_limits<float>::infinity()});
  scaler.step(p.optimizer);
  scaler.update();  // 1000 * 0.3, rounded to float
  p.set_grad({1.0f});
  scaler.step(p.optimizer);
  scaler.update();
  scaler.step(p.optimizer);
  scaler.update();

  StateDict saved = scaler.state_dict();
  EXPECT_EQ(saved.keys(), (std::vector<std::string>{"scale", "growth_factor", "backoff_factor",
                                                    "growth_interval", "_growth_tracker"}));
  EXPECT_EQ(bits(saved.get_double("scale")), bits(static_cast<float>(1000.0 * 0.3)));

  TempDir dir;
  save_file(dir / "scaler.tp", saved.to_container());
  StateDict loaded = StateDict::from_container(load_file(dir / "scaler.tp"));

  GradScaler restored;
  restored.load_state_dict(loaded);
  EXPECT_EQ(bits(restored.get_scale()), bits(scaler.get_scale()));
  EXPECT_EQ(bits(restored.options().growth_factor()), bits(1.1));
  EXPECT_EQ(bits(restored.options().backoff_factor()), bits(0.3));
  EXPECT_EQ(restored.options().growth_interval(), 5);
  StateDict again = restored.state_dict();
  EXPECT_EQ(again.keys(), saved.keys());
  for (const char* key : {"scale", "growth_factor", "backoff_factor"}) {
    EXPECT_EQ(bits(again.get_double(key)), bits(saved.get_double(key))) << key;
  }
  EXPECT_EQ(again.get<int64_t>("growth_interval"), 5);
  EXPECT_EQ(again.get<int64_t>("_growth_tracker"), 2);
}

TEST(GradScalerTest, LoadRejectsBadStateAndChangesNothing) {
  GradScaler source(GradScalerOptions().init_scale(4.0));
  const StateDict good = source.state_dict();
  GradScaler target(GradScalerOptions().init_scale(2.0).growth_interval(9));

  StateDict missing = good;
  missing.erase("_growth_tracker");
  expect_error([&] { target.load_state_dict(missing); }, ErrorCode::Incompatible,
               {"'_growth_tracker' is missing"});

  StateDict extra = good;
  extra.set("momentum", Json(1));
  expect_error([&] { target.load_state_dict(extra); }, ErrorCode::Incompatible,
               {"unexpected entry 'momentum'"});

  StateDict wrong_kind = good;
  wrong_kind.set("scale", Json(4.0));
  expect_error([&] { target.load_state_dict(wrong_kind); }, ErrorCode::Incompatible,
               {"'scale' should be a float64 tensor"});

  StateDict out_of_range = good;
  out_of_range.set("growth_interval", Json(0));
  expect_error([&] { target.load_state_dict(out_of_range); }, ErrorCode::Incompatible,
               {"growth_interval must be in [1"});

  EXPECT_EQ(target.get_scale(), 2.0);
  EXPECT_EQ(target.options().growth_interval(), 9);
}

// --- A resumed run equals an uninterrupted one ------------------------------------------------

constexpr int kSteps = 24;

// Inputs and targets for every step, from their own generator.
struct Data {
  Data() {
    at::Generator gen = at::detail::createCPUGenerator(2024);
    for (int i = 0; i < kSteps; ++i) {
      x.push_back(torch::randn({8, 4}, gen));
      y.push_back(torch::randn({8, 2}, gen));
    }
  }
  std::vector<torch::Tensor> x, y;
};

bool overflows(int step) { return step % 5 == 2 || step == 11; }

struct Job {
  explicit Job(uint64_t init_seed) {
    torch::manual_seed(init_seed);
    model = torch::nn::Linear(4, 2);
    make_optimizer();
  }
  void make_optimizer() {
    optimizer =
        std::make_unique<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(0.05));
  }
  // One iteration; returns whether the optimizer stepped.
  bool train_step(const Data& data, int step) {
    optimizer->zero_grad();
    torch::Tensor loss = torch::mse_loss(model(data.x[step]), data.y[step]);
    // Overflows float32 once scaled, as a too-large scale does in fp16 training.
    if (overflows(step)) loss = loss * 1e38f;
    scaler.scale(loss).backward();
    bool stepped = scaler.step(*optimizer);
    scaler.update();
    return stepped;
  }

  torch::nn::Linear model{nullptr};
  std::unique_ptr<torch::optim::SGD> optimizer;
  GradScaler scaler{GradScalerOptions().init_scale(256.0).growth_interval(3)};
};

TEST(GradScalerTest, ResumedRunMatchesUninterruptedRunBitForBit) {
  const Data data;
  const int k = 15;

  Job reference(7);
  int skipped = 0;
  std::vector<double> scales;
  for (int step = 0; step < kSteps; ++step) {
    if (!reference.train_step(data, step)) ++skipped;
    scales.push_back(reference.scaler.get_scale());
  }
  ASSERT_GT(skipped, 3) << "the run must exercise skipped steps";
  ASSERT_NE(std::adjacent_find(scales.begin(), scales.end(), std::less<double>()), scales.end())
      << "the run must exercise growth";

  TempDir dir;
  {
    Job first(7);
    for (int step = 0; step < k; ++step) first.train_step(data, step);
    ASSERT_NE(tracker(first.scaler), 0) << "the checkpoint must fall between two growths";
    StateDict state;
    state.set_child("scaler", first.scaler.state_dict());
    for (const auto& item : first.model->named_parameters()) {
      state.set("model." + item.key(), item.value().detach().clone());
    }
    save_file(dir / "ckpt.tp", state.to_container());
  }

  Job resumed(99);  // another initialisation, and a scaler with other options
  resumed.scaler = GradScaler();
  StateDict state = StateDict::from_container(load_file(dir / "ckpt.tp"));
  {
    torch::NoGradGuard no_grad;
    for (auto& item : resumed.model->named_parameters()) {
      item.value().copy_(state.tensor("model." + item.key()));
    }
  }
  resumed.make_optimizer();  // SGD without momentum has no state
  resumed.scaler.load_state_dict(state.child("scaler"));
  for (int step = k; step < kSteps; ++step) resumed.train_step(data, step);

  for (const auto& item : reference.model->named_parameters()) {
    EXPECT_TRUE(bitwise_equal(item.value(), resumed.model->named_parameters()[item.key()]))
        << item.key();
  }
  EXPECT_EQ(bits(resumed.scaler.get_scale()), bits(reference.scaler.get_scale()));
  EXPECT_EQ(tracker(resumed.scaler), tracker(reference.scaler));
}

}  // namespace
}  // namespace torchpoint
