// The whole state layer together: a run with Linear+Dropout+Adam+StepLR+GradScaler and
// shuffled data, saved mid-epoch to a file and restored into fresh objects, continues with
// bit-identical losses, parameters, optimizer state and RNG state.
#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include "testing/test_util.h"
#include "torchpoint/data_position.h"
#include "torchpoint/error.h"
#include "torchpoint/grad_scaler.h"
#include "torchpoint/lr_scheduler.h"
#include "torchpoint/module_state.h"
#include "torchpoint/optimizer_state.h"
#include "torchpoint/rng_state.h"
#include "torchpoint/tensor_file.h"

namespace torchpoint {
namespace {

constexpr std::size_t kSamples = 200;
constexpr std::size_t kBatch = 16;  // 13 batches per epoch, the last one of 8
constexpr int kEpochs = 3;

struct Data : torch::data::datasets::Dataset<Data> {
  Data() {
    torch::manual_seed(123);
    x = torch::randn({static_cast<std::int64_t>(kSamples), 10});
    y = x.sum(1, true).sin();
  }
  torch::data::Example<> get(std::size_t i) override { return {x[i], y[i]}; }
  c10::optional<std::size_t> size() const override { return kSamples; }
  torch::Tensor x, y;
};

// One training run. Everything is built in the constructor, as a user's program would;
// `init_seed` differs between runs so that a restore must bring every value back.
struct Job {
  explicit Job(std::uint64_t init_seed)
      : sampler(kSamples, /*shuffle=*/true, /*seed=*/5),
        loader(torch::data::make_data_loader(Data().map(torch::data::transforms::Stack<>()),
                                             sampler, kBatch)),
        model((torch::manual_seed(init_seed),
               torch::nn::Sequential(torch::nn::Linear(10, 32), torch::nn::Dropout(0.2),
                                     torch::nn::ReLU(), torch::nn::Linear(32, 1)))),
        optimizer(model->parameters(), torch::optim::AdamOptions(1e-2)),
        scheduler(optimizer, StepLROptions(1).gamma(0.9)),
        scaler(GradScalerOptions().init_scale(1024).growth_interval(4)) {}

  // Trains until kEpochs are done or `stop_at_step` steps were taken in total.
  void train(std::int64_t stop_at_step = -1) {
    while (counters.epoch < kEpochs) {
      for (auto& batch : sampler.track(*loader)) {
        optimizer.zero_grad();
        auto loss = torch::mse_loss(model->forward(batch.data), batch.target);
        // Every 7th step overflows, so the scaler skips a step and backs off.
        auto scaled = scaler.scale(counters.step % 7 == 3 ? loss * 1e38f * 1e10f : loss);
        scaled.backward();
        scaler.step(optimizer);
        scaler.update();
        losses.push_back(loss.item<float>());
        ++counters.step;
        ++counters.batch_in_epoch;
        counters.samples_seen += batch.data.size(0);
        if (counters.step == stop_at_step) return;
      }
      scheduler.step();
      ++counters.epoch;
      counters.batch_in_epoch = 0;
    }
  }

  StateDict state_dict() const {
    StateDict sd;
    sd.set_child("model", module_state_dict(*model));
    sd.set_child("optimizer", optimizer_state_dict(optimizer));
    sd.set_child("scheduler", scheduler.state_dict());
    sd.set_child("scaler", scaler.state_dict());
    sd.set_child("sampler", sampler.state_dict());
    sd.set_child("counters", counters.state_dict());
    sd.set_child("rng", rng.state_dict());
    return sd;
  }

  void load_state_dict(const StateDict& sd) {
    load_module_state_dict(*model, sd.child("model"));
    load_optimizer_state_dict(optimizer, sd.child("optimizer"));
    scheduler.load_state_dict(sd.child("scheduler"));
    scaler.load_state_dict(sd.child("scaler"));
    sampler.load_state_dict(sd.child("sampler"));
    counters.load_state_dict(sd.child("counters"));
    // Last: everything above may draw random numbers; the restored stream must be untouched.
    rng.load_state_dict(sd.child("rng"));
  }

  ResumableSampler sampler;
  std::unique_ptr<torch::data::StatelessDataLoader<
      torch::data::datasets::MapDataset<Data, torch::data::transforms::Stack<>>, ResumableSampler>>
      loader;
  torch::nn::Sequential model;
  torch::optim::Adam optimizer;
  StepLR scheduler;
  GradScaler scaler;
  RngState rng;
  TrainingCounters counters;
  std::vector<float> losses;
};

torch::Tensor cpu_rng_state() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

TEST(WholeRun, MidEpochSaveToAFileRestoresIntoFreshObjectsBitForBit) {
  Job reference(1);
  reference.train();
  ASSERT_EQ(reference.losses.size(), 39u);
  torch::Tensor reference_rng = cpu_rng_state();
  StateDict reference_end = reference.state_dict();

  for (std::int64_t stop : {1, 7, 13, 20, 26, 33}) {
    SCOPED_TRACE(fmt::format("interrupted after step {}", stop));
    testing::TempDir dir;
    {
      Job first(1);
      first.train(stop);
      save_file(dir / "state.ckpt", first.state_dict().to_container());
      // Draws after the save that the resumed run must not see.
      (void)torch::randn({5});
    }
    Job resumed(99);
    resumed.load_state_dict(StateDict::from_container(load_file(dir / "state.ckpt")));
    EXPECT_EQ(resumed.counters.step, stop);
    resumed.train();
    ASSERT_EQ(resumed.losses.size(), reference.losses.size() - stop);
    for (std::size_t i = 0; i < resumed.losses.size(); ++i) {
      float a = reference.losses[stop + i], b = resumed.losses[i];
      ASSERT_EQ(std::memcmp(&a, &b, sizeof a), 0)
          << "step " << stop + i << ": " << a << " vs " << b;
    }
    EXPECT_TRUE(testing::bitwise_equal(cpu_rng_state(), reference_rng)) << "RNG state differs";
    StateDict end = resumed.state_dict();
    ASSERT_EQ(end.keys(), reference_end.keys());
    for (const auto& [key, value] : reference_end.entries()) {
      if (key.starts_with("rng.")) continue;  // compared above, after the same draws
      if (reference_end.is_tensor(key)) {
        EXPECT_TRUE(testing::bitwise_equal(reference_end.tensor(key), end.tensor(key))) << key;
      } else {
        EXPECT_EQ(reference_end.value(key), end.value(key)) << key;
      }
    }
  }
}

TEST(WholeRun, EveryComponentIsPresentInTheSavedState) {
  Job job(1);
  job.train(5);
  StateDict sd = job.state_dict();
  EXPECT_EQ(sd.top_level_names(),
            (std::vector<std::string>{"model", "optimizer", "scheduler", "scaler", "sampler",
                                      "counters", "rng"}));
  // A component expected but absent is an error, never silently skipped.
  StateDict partial;
  partial.set_child("model", sd.child("model"));
  Job other(2);
  EXPECT_THROW(other.load_state_dict(partial), Error);
}

}  // namespace
}  // namespace torchpoint
