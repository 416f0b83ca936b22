// StateDict, AnyStateful, the resumable sampler, counters and metric records.
#include <torch/torch.h>

#include <limits>

#include "testing/test_util.h"
#include "torchpoint/data_position.h"
#include "torchpoint/error.h"
#include "torchpoint/state_dict.h"
#include "torchpoint/tensor_file.h"

namespace torchpoint {
namespace {

using testing::TempDir;

StateDict round_trip(const StateDict& sd) {
  TempDir dir;
  save_file(dir / "s.safetensors", sd.to_container());
  return StateDict::from_container(load_file(dir / "s.safetensors"));
}

TEST(StateDict, KeepsOrderKindsAndExactValuesThroughAFile) {
  StateDict sd;
  sd.set("z.weight", torch::randn({3, 2}));
  sd.set("epoch", 7);
  sd.set("a.bias", torch::arange(4));
  sd.set("name", "run-1");
  sd.set_double("best", std::numeric_limits<double>::infinity());
  sd.set_double("nan", std::numeric_limits<double>::quiet_NaN());
  sd.set("lr", 0.1 + 0.2);
  StateDict back = round_trip(sd);
  EXPECT_EQ(back.keys(), sd.keys());
  EXPECT_TRUE(back.tensor("z.weight").equal(sd.tensor("z.weight")));
  EXPECT_EQ(back.get<int>("epoch"), 7);
  EXPECT_EQ(back.get<std::string>("name"), "run-1");
  EXPECT_EQ(back.get_double("best"), std::numeric_limits<double>::infinity());
  EXPECT_TRUE(std::isnan(back.get_double("nan")));
  EXPECT_EQ(back.get<double>("lr"), 0.1 + 0.2);  // bit-exact through JSON
}

TEST(StateDict, NestsByPrefix) {
  StateDict model;
  model.set("fc.weight", torch::ones({2}));
  StateDict root;
  root.set_child("model", model);
  root.set("step", 3);
  EXPECT_EQ(root.keys(), (std::vector<std::string>{"model.fc.weight", "step"}));
  EXPECT_EQ(root.top_level_names(), (std::vector<std::string>{"model", "step"}));
  StateDict child = root.child("model");
  EXPECT_EQ(child.keys(), std::vector<std::string>{"fc.weight"});
  EXPECT_TRUE(root.has_child("model"));
  EXPECT_FALSE(root.has_child("optimizer"));
}

TEST(StateDict, MissingAndWrongKindKeysAreClearErrors) {
  StateDict sd;
  sd.set_description("scheduler");
  sd.set("t", torch::ones({1}));
  sd.set("v", 1);
  try {
    sd.tensor("nope");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::NotFound);
    EXPECT_NE(std::string(e.what()).find("scheduler has no tensor 'nope'"), std::string::npos)
        << e.what();
  }
  EXPECT_THROW(sd.value("t"), Error);
  EXPECT_THROW(sd.tensor("v"), Error);
  try {
    sd.get<std::string>("v");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Incompatible);
  }
}

struct Counter {
  int n = 0;
  StateDict state_dict() const {
    StateDict s;
    s.set("n", n);
    return s;
  }
  void load_state_dict(const StateDict& s) { n = s.get<int>("n"); }
};
static_assert(Stateful<Counter>);
static_assert(!Stateful<int>);
static_assert(!Stateful<torch::Tensor>);

TEST(AnyStateful, HoldsByReferenceSharedPointerOrValue) {
  Counter by_ref{3};
  auto shared = std::make_shared<Counter>(Counter{5});
  std::vector<AnyStateful> all = {AnyStateful::ref(by_ref), AnyStateful(shared),
                                  AnyStateful::value(Counter{9})};
  std::vector<StateDict> saved;
  for (const auto& a : all) saved.push_back(a.state_dict());
  by_ref.n = 0;
  shared->n = 0;
  for (std::size_t i = 0; i < all.size(); ++i) all[i].load_state_dict(saved[i]);
  EXPECT_EQ(by_ref.n, 3);
  EXPECT_EQ(shared->n, 5);
  EXPECT_EQ(all[2].state_dict().get<int>("n"), 9);
}

// A dataset of n examples whose data is the example index, so batches show the order.
struct IndexDataset : torch::data::datasets::Dataset<IndexDataset> {
  explicit IndexDataset(std::size_t n) : n(n) {}
  torch::data::Example<> get(std::size_t i) override {
    return {torch::full({1}, static_cast<double>(i)), torch::zeros({1})};
  }
  c10::optional<std::size_t> size() const override { return n; }
  std::size_t n;
};

std::vector<std::int64_t> indices_of(const torch::data::Example<>& batch) {
  auto t = batch.data.to(torch::kLong).flatten();
  return std::vector<std::int64_t>(t.data_ptr<std::int64_t>(),
                                   t.data_ptr<std::int64_t>() + t.numel());
}

template <typename Loader>
std::vector<std::vector<std::int64_t>> run_epochs(Loader& loader, ResumableSampler& sampler,
                                                  int epochs, int stop_after_batches = -1,
                                                  StateDict* saved = nullptr) {
  std::vector<std::vector<std::int64_t>> seen;
  int count = 0;
  for (int e = 0; e < epochs; ++e) {
    for (auto& batch : sampler.track(loader)) {
      seen.push_back(indices_of(batch));
      if (++count == stop_after_batches) {
        if (saved) *saved = sampler.state_dict();
        return seen;
      }
    }
  }
  return seen;
}

class SamplerResume : public ::testing::TestWithParam<std::size_t> {};  // worker count

TEST_P(SamplerResume, MidEpochResumeSeesExactlyTheRemainingBatches) {
  const std::size_t workers = GetParam();
  auto make_loader = [&](ResumableSampler& sampler) {
    return torch::data::make_data_loader(
        IndexDataset(50).map(torch::data::transforms::Stack<>()), sampler,
        torch::data::DataLoaderOptions().batch_size(4).workers(workers));
  };
  ResumableSampler reference(50, /*shuffle=*/true, /*seed=*/11);
  auto ref_loader = make_loader(reference);
  auto expected = run_epochs(*ref_loader, reference, 3);
  ASSERT_EQ(expected.size(), 39u);  // 13 batches per epoch

  for (int stop : {1, 5, 13, 14, 20, 26, 27}) {
    SCOPED_TRACE(fmt::format("stop after {} batches, {} workers", stop, workers));
    ResumableSampler first(50, true, 11);
    auto loader = make_loader(first);
    StateDict saved;
    auto before = run_epochs(*loader, first, 3, stop, &saved);
    saved = round_trip(saved);

    ResumableSampler second(50, true, 11);
    auto loader2 = make_loader(second);
    second.load_state_dict(saved);
    // The saved epoch is continued first, even when none of its batches is left.
    int remaining_epochs = 3 - static_cast<int>(second.epoch());
    auto after = run_epochs(*loader2, second, remaining_epochs);
    before.insert(before.end(), after.begin(), after.end());
    EXPECT_EQ(before, expected);
  }
}

INSTANTIATE_TEST_SUITE_P(Workers, SamplerResume, ::testing::Values(0u, 2u));

TEST(Sampler, OrderIsAPureFunctionOfSeedAndEpoch) {
  ResumableSampler a(100, true, 3), b(100, true, 3), c(100, true, 4);
  EXPECT_EQ(a.order_of(5), b.order_of(5));
  EXPECT_NE(a.order_of(5), a.order_of(6));
  EXPECT_NE(a.order_of(5), c.order_of(5));
  auto order = a.order_of(0);
  std::sort(order.begin(), order.end());
  for (std::size_t i = 0; i < 100; ++i) ASSERT_EQ(order[i], i);
  torch::manual_seed(0);
  auto before = torch::randn({3});
  torch::manual_seed(0);
  (void)ResumableSampler(100, true, 3).order_of(2);
  EXPECT_TRUE(torch::randn({3}).equal(before)) << "the sampler must not draw from torch's RNG";
  ResumableSampler sequential(5, false);
  EXPECT_EQ(sequential.order_of(3), (std::vector<std::size_t>{0, 1, 2, 3, 4}));
}

TEST(Sampler, SkipFirstBatchesDoesNotReadSkippedSamplesAndNextEpochIsWhole) {
  std::vector<std::size_t> reads;
  struct Recording : torch::data::datasets::Dataset<Recording> {
    std::vector<std::size_t>* reads;
    torch::data::Example<> get(std::size_t i) override {
      reads->push_back(i);
      return {torch::full({1}, static_cast<double>(i)), torch::zeros({1})};
    }
    c10::optional<std::size_t> size() const override { return 20; }
  };
  Recording ds;
  ds.reads = &reads;
  ResumableSampler sampler(20, true, 1);
  auto loader = torch::data::make_data_loader(ds.map(torch::data::transforms::Stack<>()), sampler,
                                              torch::data::DataLoaderOptions().batch_size(4));
  sampler.skip_first_batches(3, 4);
  std::vector<std::int64_t> first_epoch;
  for (auto& batch : sampler.track(*loader)) {
    for (auto i : indices_of(batch)) first_epoch.push_back(i);
  }
  auto order = sampler.order_of(0);
  EXPECT_EQ(first_epoch, std::vector<std::int64_t>(order.begin() + 12, order.end()));
  EXPECT_EQ(reads.size(), 8u) << "the 12 skipped samples must not be read";
  EXPECT_EQ(sampler.epoch(), 0);
  std::size_t second = 0;
  for (auto& batch : sampler.track(*loader)) second += indices_of(batch).size();
  EXPECT_EQ(second, 20u);
  EXPECT_EQ(sampler.epoch(), 1);
}

// skip_first_batches right after a load counts from the start of the saved epoch, as in
// Accelerate: the batches the checkpoint had trained on continue that epoch (its last batch
// included: an empty rest, then the next epoch whole), 0 with no batch left begins the next
// epoch (a position derived from the step count), and anything else throws naming both numbers,
// leaving the position as it was.
TEST(Sampler, SkipAfterALoadCountsFromTheSavedEpochsStartOrThrows) {
  struct Numbers : torch::data::datasets::Dataset<Numbers> {
    torch::data::Example<> get(std::size_t i) override {
      return {torch::full({1}, static_cast<double>(i)), torch::zeros({1})};
    }
    c10::optional<std::size_t> size() const override { return 10; }  // 3 batches of 4, 4, 2
  };
  auto make_loader = [](ResumableSampler& sampler) {
    return torch::data::make_data_loader(Numbers().map(torch::data::transforms::Stack<>()),
                                         sampler, torch::data::DataLoaderOptions().batch_size(4));
  };
  // What the next two loops over the loader yield, flattened per epoch, with the epoch of each.
  auto next_two = [&](ResumableSampler& sampler) {
    auto loader = make_loader(sampler);
    std::vector<std::pair<std::int64_t, std::vector<std::int64_t>>> out;
    for (int i = 0; i < 2; ++i) {
      std::vector<std::int64_t> seen;
      for (auto& batch : sampler.track(*loader)) {
        for (auto v : indices_of(batch)) seen.push_back(v);
      }
      out.emplace_back(sampler.epoch(), seen);
    }
    return out;
  };
  ResumableSampler original(10, true, 9);
  StateDict first_batch, last_batch, after_loop;
  {
    auto loader = make_loader(original);
    int batches = 0;
    for (auto& batch : original.track(*loader)) {
      (void)batch;
      if (++batches == 1) first_batch = original.state_dict();
      if (batches == 3) last_batch = original.state_dict();
    }
    after_loop = original.state_dict();
  }
  auto order0 = original.order_of(0), order1 = original.order_of(1);
  auto from = [](const std::vector<std::size_t>& order, std::size_t i) {
    return std::vector<std::int64_t>(order.begin() + static_cast<std::ptrdiff_t>(i), order.end());
  };
  auto whole1 = from(order1, 0);
  using Seen = std::vector<std::pair<std::int64_t, std::vector<std::int64_t>>>;
  struct Case {
    const char* name;
    StateDict* state;
    std::size_t skip;
    Seen want;
  };
  const std::vector<Case> ok = {
      {"first batch, skip 1", &first_batch, 1, {{0, from(order0, 4)}, {1, whole1}}},
      {"last batch, skip 3", &last_batch, 3, {{0, {}}, {1, whole1}}},
      {"last batch, skip 0", &last_batch, 0, {{1, whole1}, {2, from(original.order_of(2), 0)}}},
      {"after the loop, skip 3", &after_loop, 3, {{0, {}}, {1, whole1}}},
      {"after the loop, skip 0", &after_loop, 0, {{1, whole1}, {2, from(original.order_of(2), 0)}}},
  };
  for (const Case& c : ok) {
    SCOPED_TRACE(c.name);
    ResumableSampler restored(10, true, 9);
    restored.load_state_dict(*c.state);
    restored.skip_first_batches(c.skip, 4);
    EXPECT_EQ(next_two(restored), c.want);
  }
  struct Bad {
    StateDict* state;
    std::size_t skip;
    std::vector<std::string> parts;
    Seen unchanged;
  };
  const std::vector<Bad> bad = {
      {&first_batch, 0, {"skip_first_batches(0)", "after 1 of the 3 batches of epoch 0",
                         "inside the epoch's loop", "skip 1 to continue"},
       {{0, from(order0, 4)}, {1, whole1}}},
      {&first_batch, 2, {"skip_first_batches(2)", "after 1 of the 3"}, {{0, from(order0, 4)}, {1, whole1}}},
      {&last_batch, 1, {"after 3 of the 3 batches of epoch 0", "or 0 to begin epoch 1"},
       {{0, {}}, {1, whole1}}},
      {&after_loop, 2, {"after the epoch's loop ended", "skip 3", "or 0 to begin epoch 1"},
       {{1, whole1}, {2, from(original.order_of(2), 0)}}},
  };
  for (const Bad& c : bad) {
    SCOPED_TRACE(c.parts[0]);
    ResumableSampler restored(10, true, 9);
    restored.load_state_dict(*c.state);
    testing::expect_error([&] { restored.skip_first_batches(c.skip, 4); },
                          ErrorCode::InvalidArgument, c.parts);
    EXPECT_EQ(next_two(restored), c.unchanged) << "a refused skip changed the position";
  }
  // A file written before batches were counted: the batches trained on come from the samples.
  StateDict old_file = last_batch;
  old_file.erase("batches_consumed");
  ResumableSampler restored(10, true, 9);
  restored.load_state_dict(old_file);
  restored.skip_first_batches(3, 4);
  EXPECT_EQ(next_two(restored), (Seen{{0, {}}, {1, whole1}}));
  // A position saved before the first iteration (the guide saves the starting state, then
  // skips 100 batches) contradicts nothing: any skip counts from epoch 0's start.
  ResumableSampler fresh(10, true, 9), loaded(10, true, 9);
  loaded.load_state_dict(fresh.state_dict());
  loaded.skip_first_batches(2, 4);
  EXPECT_EQ(next_two(loaded), (Seen{{0, from(order0, 8)}, {1, whole1}}));
}

// next_epoch() is what the next loop over the loader iterates: what an epoch loop resumes from.
TEST(Sampler, NextEpochIsTheEpochTheNextLoopIterates) {
  struct Numbers : torch::data::datasets::Dataset<Numbers> {
    torch::data::Example<> get(std::size_t i) override {
      return {torch::full({1}, static_cast<double>(i)), torch::zeros({1})};
    }
    c10::optional<std::size_t> size() const override { return 8; }
  };
  ResumableSampler sampler(8, true, 3);
  auto loader =
      torch::data::make_data_loader(Numbers().map(torch::data::transforms::Stack<>()), sampler,
                                    torch::data::DataLoaderOptions().batch_size(4));
  EXPECT_EQ(sampler.next_epoch(), 0) << "fresh";
  StateDict mid, last_batch, finished;
  int batches = 0;
  for (auto& batch : sampler.track(*loader)) {
    (void)batch;
    if (++batches == 1) mid = sampler.state_dict();
    if (batches == 2) last_batch = sampler.state_dict();  // in the body of the last batch
  }
  finished = sampler.state_dict();
  EXPECT_EQ(sampler.next_epoch(), 1) << "epoch 0's loop ended";
  for (const auto& [state, want] :
       std::vector<std::pair<StateDict, std::int64_t>>{{mid, 0}, {last_batch, 0}, {finished, 1}}) {
    ResumableSampler restored(8, true, 3);
    restored.load_state_dict(state);
    EXPECT_EQ(restored.next_epoch(), want);
    auto again =
        torch::data::make_data_loader(Numbers().map(torch::data::transforms::Stack<>()), restored,
                                      torch::data::DataLoaderOptions().batch_size(4));
    for (auto& batch : restored.track(*again)) (void)batch;
    EXPECT_EQ(restored.epoch(), want) << "the loop iterated the epoch next_epoch() named";
  }
  sampler.set_epoch(5);
  EXPECT_EQ(sampler.next_epoch(), 5);
}

TEST(Sampler, StateOfAnotherDataSetIsIncompatible) {
  ResumableSampler a(10, true, 1), b(11, true, 1);
  try {
    b.load_state_dict(a.state_dict());
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Incompatible);
    EXPECT_NE(std::string(e.what()).find("10 samples"), std::string::npos) << e.what();
  }
}

TEST(Sampler, LibTorchSamplersRoundTrip) {
  torch::manual_seed(1);
  torch::data::samplers::RandomSampler random(30);
  random.next(7);
  StateDict sd = round_trip(sampler_state_dict(random));
  auto expected = random.next(5);
  torch::manual_seed(99);
  torch::data::samplers::RandomSampler other(30);
  load_sampler_state_dict(other, sd);
  EXPECT_EQ(other.index(), 7u);
  EXPECT_EQ(other.next(5), expected);

  torch::data::samplers::SequentialSampler seq(10);
  seq.next(4);
  torch::data::samplers::SequentialSampler seq2(10);
  load_sampler_state_dict(seq2, round_trip(sampler_state_dict(seq)));
  EXPECT_EQ(seq2.index(), 4u);
  EXPECT_THROW(load_sampler_state_dict(random, sampler_state_dict(seq)), Error);
}

TEST(Counters, RoundTripExactly) {
  TrainingCounters c{3, 1234567890123, 17, 99999};
  TrainingCounters back;
  back.load_state_dict(round_trip(c.state_dict()));
  EXPECT_EQ(back.epoch, 3);
  EXPECT_EQ(back.step, 1234567890123);
  EXPECT_EQ(back.batch_in_epoch, 17);
  EXPECT_EQ(back.samples_seen, 99999);
}

TEST(Records, RoundTripBitForBit) {
  MetricRecords r;
  r.record("train", "loss", 0.1 + 0.2);
  r.record("valid", "loss", std::numeric_limits<double>::infinity());
  r.record("train", "loss", 1.0 / 3.0);
  r.record("train", "mae", std::numeric_limits<double>::quiet_NaN());
  MetricRecords back;
  back.load_state_dict(round_trip(r.state_dict()));
  EXPECT_EQ(back.series(), r.series());
  EXPECT_EQ(back.values("train", "loss"), (std::vector<double>{0.1 + 0.2, 1.0 / 3.0}));
  EXPECT_EQ(back.values("valid", "loss")[0], std::numeric_limits<double>::infinity());
  EXPECT_TRUE(std::isnan(back.values("train", "mae")[0]));
  EXPECT_TRUE(back.values("test", "loss").empty());
}

}  // namespace
}  // namespace torchpoint

#include "torchpoint/module_state.h"
#include "torchpoint/optimizer_state.h"
#include "torchpoint/stateful_set.h"

namespace torchpoint {
namespace {

TEST(StatefulSet, MissingOrUnknownComponentsAreErrorsUnlessOptedOut) {
  Counter a{1}, b{2};
  StatefulSet set;
  set.add("a", AnyStateful::ref(a));
  set.add("b", AnyStateful::ref(b));
  StateDict saved = set.state_dict();
  EXPECT_EQ(saved.keys(), (std::vector<std::string>{"a.n", "b.n"}));

  StateDict partial;
  partial.set_child("a", saved.child("a"));
  partial.set("extra.x", 1);
  a.n = 10;
  try {
    set.restore(partial);
    FAIL();
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_EQ(e.code(), ErrorCode::Incompatible);
    EXPECT_NE(m.find("registered but not in the checkpoint: b"), std::string::npos) << m;
    EXPECT_NE(m.find("in the checkpoint but not registered: extra"), std::string::npos) << m;
  }
  EXPECT_EQ(a.n, 10) << "nothing may change when the names do not match";

  set.allow_missing("b");
  set.allow_unknown("extra");
  RestoreReport r = set.restore(partial);
  EXPECT_EQ(r.restored, std::vector<std::string>{"a"});
  EXPECT_EQ(r.skipped_missing, std::vector<std::string>{"b"});
  EXPECT_EQ(r.skipped_unknown, std::vector<std::string>{"extra"});
  EXPECT_EQ(a.n, 1);
  EXPECT_THROW(set.add("a", AnyStateful::ref(b)), Error);
  EXPECT_THROW(set.add("bad.name", AnyStateful::ref(b)), Error);
}

TEST(StatefulSet, AFailedComponentPutsBackTheOnesAlreadyRestored) {
  torch::manual_seed(0);
  auto model = torch::nn::Linear(4, 3);
  auto adam = std::make_shared<torch::optim::Adam>(model->parameters());
  StatefulSet set;
  set.add("model", ModuleState(model.ptr()));
  set.add("optimizer", OptimizerState(adam));
  StateDict saved = set.state_dict();
  saved = StateDict(saved);  // a copy whose model tensors we may replace
  saved.set("model.weight", torch::full({3, 4}, 7.0));
  saved.set("optimizer.type", "SGD");  // the optimizer part will refuse to load
  auto before = model->weight.clone();
  EXPECT_THROW(set.restore(saved), Error);
  EXPECT_TRUE(model->weight.equal(before)) << "the model must be put back";
}

// An optimizer's load replaces its state, so the set keeps the old state itself (no copy) to
// put it back when a later component fails: it comes back value for value.
TEST(StatefulSet, AnOptimizerRestoredBeforeAFailureGetsItsOwnStateBack) {
  torch::manual_seed(1);
  auto model = torch::nn::Linear(4, 3);
  auto adam = std::make_shared<torch::optim::Adam>(model->parameters());
  auto step = [&] {
    adam->zero_grad();
    model->forward(torch::randn({2, 4})).sum().backward();
    adam->step();
  };
  step();
  EXPECT_TRUE(AnyStateful(std::make_shared<OptimizerState>(adam)).load_replaces_state());
  EXPECT_FALSE(AnyStateful::value(ModuleState(model.ptr())).load_replaces_state());
  StatefulSet set;
  set.add("optimizer", OptimizerState(adam));  // restored first
  set.add("model", ModuleState(model.ptr()));
  StateDict other = set.state_dict().clone();  // the state one step later, for the optimizer
  step();
  StateDict before = set.state_dict().clone();
  other.set("model.weight", torch::zeros({5, 5}));  // the model refuses it
  EXPECT_THROW(set.restore(other), Error);
  StateDict now = set.state_dict();
  for (const std::string& key : before.keys()) {
    if (!before.is_tensor(key)) continue;
    EXPECT_TRUE(now.tensor(key).equal(before.tensor(key))) << key << " was not put back";
  }
  EXPECT_FALSE(now.tensor("optimizer.state.0.0.exp_avg").equal(
      other.tensor("optimizer.state.0.0.exp_avg")));
}

TEST(StatefulSet, RestoreLastComponentsGoLast) {
  std::vector<std::string> order;
  struct Probe {
    std::string name;
    std::vector<std::string>* order;
    StateDict state_dict() const {
      StateDict s;
      s.set("x", 1);
      return s;
    }
    void load_state_dict(const StateDict&) { order->push_back(name); }
  };
  StatefulSet set;
  set.add("rng", Probe{"rng", &order}, /*restore_last=*/true);
  set.add("model", Probe{"model", &order});
  set.add("sampler", Probe{"sampler", &order});
  set.restore(set.state_dict());
  EXPECT_EQ(order, (std::vector<std::string>{"model", "sampler", "rng"}));
}

}  // namespace
}  // namespace torchpoint
