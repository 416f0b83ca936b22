// RngState: the default CPU generator (including its cached normal sample), registered
// generators and standard-library engines continue exactly after a restore, through a file too;
// mismatched or damaged states are errors that change nothing.
#include "torchpoint/rng_state.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdint>
#include <mutex>
#include <random>
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

// Everything a training step typically draws from the default CPU generator.
std::vector<torch::Tensor> default_draws() {
  torch::nn::Dropout dropout(torch::nn::DropoutOptions(0.5));
  dropout->train();
  return {
      torch::randn({1}),   // one cached-normal draw (small tensors)
      torch::randn({5}),   // small: Box-Muller with the cache
      torch::randn({40}),  // large: vectorised normal_fill
      torch::randn({3}, torch::kDouble),
      torch::rand({7}),
      torch::randperm(20),
      torch::randint(0, 1000, {6}),
      dropout(torch::ones({64})),  // bernoulli_ mask
      torch::randn({1}),
  };
}

void expect_same_draws(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    EXPECT_TRUE(bitwise_equal(a[i], b[i])) << "draw " << i << ": " << a[i] << " vs " << b[i];
  }
}

void expect_same_state(const StateDict& a, const StateDict& b) {
  ASSERT_EQ(a.keys(), b.keys());
  for (const std::string& key : a.keys()) {
    if (a.is_tensor(key)) {
      EXPECT_TRUE(bitwise_equal(a.tensor(key), b.tensor(key))) << key;
    } else {
      EXPECT_EQ(a.value(key), b.value(key)) << key;
    }
  }
}

bool default_has_cached_normal() {
  at::Generator gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return at::check_generator<at::CPUGeneratorImpl>(gen)->next_double_normal_sample().has_value();
}

TEST(RngStateTest, DefaultGeneratorContinuesExactly) {
  torch::manual_seed(11);
  torch::rand({100});
  RngState rng;
  const StateDict saved = rng.state_dict();
  ASSERT_TRUE(saved.is_tensor("cpu"));
  EXPECT_EQ(saved.tensor("cpu").scalar_type(), torch::kByte);

  const std::vector<torch::Tensor> uninterrupted = default_draws();
  torch::manual_seed(12345);  // anything in between is undone by the restore
  torch::randn({1});
  rng.load_state_dict(saved);
  expect_same_draws(uninterrupted, default_draws());
}

TEST(RngStateTest, CachedNormalSampleIsRestored) {
  torch::manual_seed(5);
  for (int i = 0; i < 3; ++i) torch::randn({1});  // an odd number of draws leaves one cached
  ASSERT_TRUE(default_has_cached_normal()) << "the test needs a cached normal sample";
  RngState rng;
  const StateDict saved = rng.state_dict();
  const std::vector<torch::Tensor> uninterrupted = default_draws();

  // The same engine state without the cached sample gives other numbers: seeding or
  // restoring only the Mersenne Twister is not enough.
  rng.load_state_dict(saved);
  {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    at::check_generator<at::CPUGeneratorImpl>(gen)->set_next_double_normal_sample(c10::nullopt);
  }
  EXPECT_FALSE(bitwise_equal(torch::randn({1}), uninterrupted[0]));

  rng.load_state_dict(saved);
  EXPECT_TRUE(default_has_cached_normal());
  expect_same_draws(uninterrupted, default_draws());
}

TEST(RngStateTest, RegisteredGeneratorsAndEnginesContinueExactly) {
  std::mt19937 mt(42);
  std::mt19937_64 mt64(43);
  std::minstd_rand minstd(44);
  at::Generator augment = at::detail::createCPUGenerator(7);
  mt.discard(1000);
  torch::randn({1}, augment);  // leaves a cached normal sample in `augment`

  RngState rng;
  rng.register_engine("shuffle", mt);
  rng.register_engine("wide", mt64);
  rng.register_engine("small", minstd);
  rng.register_generator("augment", augment);
  const StateDict saved = rng.state_dict();

  auto draw = [&] {
    std::vector<torch::Tensor> out = {torch::randn({1}, augment), torch::rand({4}, augment),
                                      torch::randperm(10, augment), torch::randn({30}, augment)};
    std::vector<int64_t> engine_values;
    for (int i = 0; i < 5; ++i) {
      engine_values.push_back(static_cast<int64_t>(mt()));
      engine_values.push_back(static_cast<int64_t>(mt64() >> 1));
      engine_values.push_back(static_cast<int64_t>(minstd()));
    }
    out.push_back(torch::tensor(engine_values));
    return out;
  };
  const std::vector<torch::Tensor> uninterrupted = draw();
  rng.load_state_dict(saved);
  expect_same_draws(uninterrupted, draw());
}

TEST(RngStateTest, StateSurvivesSaveFileAndLoadFile) {
  torch::manual_seed(3);
  torch::randn({1});
  std::mt19937 shuffle(9);
  at::Generator augment = at::detail::createCPUGenerator(8);
  RngState rng;
  rng.register_engine("shuffle", shuffle);
  rng.register_generator("augment", augment);

  const StateDict saved = rng.state_dict();
  std::vector<std::string> expected_keys = {"cpu"};
  for (const std::string& key : saved.keys()) {
    if (key.starts_with("cuda.")) expected_keys.push_back(key);
  }
  expected_keys.push_back("generators.augment");
  expected_keys.push_back("engines.shuffle");
  EXPECT_EQ(saved.keys(), expected_keys);
  EXPECT_TRUE(saved.value("engines.shuffle").is_string());

  TempDir dir;
  save_file(dir / "rng.tp", saved.to_container());

  auto draw = [&] {
    std::vector<torch::Tensor> out = default_draws();
    out.push_back(torch::rand({5}, augment));
    out.push_back(torch::tensor(
        std::vector<int64_t>{static_cast<int64_t>(shuffle()), static_cast<int64_t>(shuffle())}));
    return out;
  };
  const std::vector<torch::Tensor> uninterrupted = draw();
  rng.load_state_dict(StateDict::from_container(load_file(dir / "rng.tp")));
  expect_same_draws(uninterrupted, draw());
}

// A saver and a loader with the same engines and generators, each in its own objects.
struct Registered {
  Registered() : augment(at::detail::createCPUGenerator(21)) {
    rng.register_engine("shuffle", shuffle);
    rng.register_generator("augment", augment);
  }
  std::mt19937 shuffle{77};
  at::Generator augment;
  RngState rng;
};

// Loads `state` expecting failure, then checks that no generator or engine moved: both their
// captured state and what they draw next.
void expect_refused_and_unchanged(Registered& target, const StateDict& state,
                                  const std::vector<std::string>& parts) {
  const StateDict before = target.rng.state_dict();
  expect_error([&] { target.rng.load_state_dict(state); }, ErrorCode::Incompatible, parts);
  expect_same_state(before, target.rng.state_dict());

  auto draw = [&] {
    std::vector<torch::Tensor> out = default_draws();
    out.push_back(torch::rand({5}, target.augment));
    out.push_back(torch::tensor(std::vector<int64_t>{static_cast<int64_t>(target.shuffle())}));
    return out;
  };
  const std::vector<torch::Tensor> after_failure = draw();
  target.rng.load_state_dict(before);
  expect_same_draws(after_failure, draw());
}

TEST(RngStateTest, MismatchedRegistrationsAreErrorsAndChangeNothing) {
  torch::manual_seed(1);
  std::mt19937 shuffle(1);
  std::mt19937 order(2);
  at::Generator augment = at::detail::createCPUGenerator(1);
  RngState saver;
  saver.register_engine("shuffle", shuffle);
  saver.register_engine("order", order);
  saver.register_generator("augment", augment);
  const StateDict saved = saver.state_dict();
  torch::randn({50});  // the saved "cpu" state is valid and differs from the current one

  Registered target;  // has "shuffle" and "augment", lacks "order", and registers "noise"
  at::Generator noise = at::detail::createCPUGenerator(5);
  target.rng.register_generator("noise", noise);
  expect_refused_and_unchanged(target, saved,
                               {"generator 'noise' ('generators.noise') is not in the checkpoint",
                                "engine 'order' is in the checkpoint but not registered",
                                "no generator or engine was changed"});

  // The other way round: a registered engine that the checkpoint lacks.
  Registered other;
  StateDict without_shuffle = other.rng.state_dict();
  without_shuffle.erase("engines.shuffle");
  expect_refused_and_unchanged(other, without_shuffle,
                               {"engine 'shuffle' ('engines.shuffle') is not in the checkpoint"});
}

TEST(RngStateTest, DamagedOrForeignStatesAreErrorsAndChangeNothing) {
  torch::manual_seed(2);
  Registered source;
  const StateDict good = source.rng.state_dict();
  torch::randn({50});
  source.shuffle.discard(3);
  Registered target;

  StateDict short_state = good;
  short_state.set("generators.augment", torch::zeros({10}, torch::kByte));
  expect_refused_and_unchanged(
      target, short_state, {"generator 'augment' ('generators.augment') has 10 bytes of state"});

  StateDict wrong_dtype = good;
  wrong_dtype.set("cpu", good.tensor("cpu").to(torch::kInt));
  expect_refused_and_unchanged(target, wrong_dtype,
                               {"default CPU generator ('cpu') should be a 1-d uint8 CPU tensor"});

  // The right size, but not a valid Mersenne Twister state: the generator itself refuses it.
  StateDict zeroed = good;
  zeroed.set("cpu", torch::zeros_like(good.tensor("cpu")));
  expect_refused_and_unchanged(target, zeroed,
                               {"default CPU generator ('cpu') refuses its saved state"});

  StateDict truncated = good;
  std::string text = good.get<std::string>("engines.shuffle");
  truncated.set("engines.shuffle", Json(text.substr(0, text.size() / 2)));
  expect_refused_and_unchanged(target, truncated,
                               {"engine 'shuffle' ('engines.shuffle') does not hold a state"});

  StateDict other_engine = good;
  std::mt19937_64 wide(5);
  other_engine.set("engines.shuffle", Json(detail::engine_text(wide)));
  expect_refused_and_unchanged(target, other_engine, {"engine 'shuffle'", "another engine type"});

  StateDict not_a_string = good;
  not_a_string.set("engines.shuffle", Json(5));
  expect_refused_and_unchanged(target, not_a_string, {"should be a JSON string"});

  if (!torch::cuda::is_available()) {
    StateDict from_gpu_run = good;
    from_gpu_run.set("cuda.0", torch::zeros({16}, torch::kByte));
    expect_refused_and_unchanged(
        target, from_gpu_run,
        {"'cuda.0' holds the state of a CUDA device this process does not have"});
  }

  // Every problem is reported at once.
  StateDict several = good;
  several.set("generators.augment", torch::zeros({10}, torch::kByte));
  several.set("engines.shuffle", Json("1 2 3"));
  several.set("step", Json(3));
  expect_refused_and_unchanged(
      target, several, {"'generators.augment'", "'engines.shuffle'", "unexpected entry 'step'"});
}

TEST(RngStateTest, RegistrationErrors) {
  RngState rng;
  std::mt19937 engine;
  rng.register_engine("a", engine);
  expect_error([&] { rng.register_generator("a", at::detail::createCPUGenerator(1)); },
               ErrorCode::InvalidArgument, {"'a' is already registered as an engine"});
  expect_error([&] { rng.register_engine("", engine); }, ErrorCode::InvalidArgument, {"empty"});
  expect_error([&] { rng.register_generator("g", at::Generator()); }, ErrorCode::InvalidArgument,
               {"undefined"});
}

}  // namespace
}  // namespace torchpoint
