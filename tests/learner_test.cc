// Learner::fit and luz's checkpoint callbacks: the seed's three scenarios, every callback
// option, callback state across resumes, the hook order, errors, progress output and plots.
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <limits>
#include <sstream>

#include "testing/test_util.h"
#include "tests/learner_job.h"
#include "torchpoint/module_state.h"
#include "torchpoint/optimizer_state.h"
#include "torchpoint/records_plot.h"
#include "torchpoint/tensor_file.h"
#include "report/progress.h"

namespace torchpoint {
namespace {

using testing::expect_error;
using testing::Interrupt;
using testing::LossTally;
using testing::TempDir;

FitOptions quiet(std::int64_t epochs = 10) { return FitOptions().epochs(epochs).verbose(false); }

// Every parameter and buffer of both models has the same bytes.
void expect_same_weights(Learner& a, Learner& b) {
  auto pa = a.model().named_parameters(), pb = b.model().named_parameters();
  ASSERT_EQ(pa.size(), pb.size());
  for (const auto& item : pa) {
    EXPECT_TRUE(testing::bitwise_equal(item.value(), pb[item.key()])) << item.key();
  }
}

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

void expect_same_records(const MetricRecords& a, const MetricRecords& b) {
  ASSERT_EQ(a.series(), b.series());
  for (const auto& [set, metric] : a.series()) {
    const auto& va = a.values(set, metric);
    const auto& vb = b.values(set, metric);
    ASSERT_EQ(va.size(), vb.size()) << set << " " << metric;
    for (std::size_t i = 0; i < va.size(); ++i) {
      EXPECT_TRUE(same_bits(va[i], vb[i]))
          << set << " " << metric << " epoch " << i + 1 << ": " << va[i] << " vs " << vb[i];
    }
  }
}

StateDict read_state(const std::string& path) { return StateDict::from_container(load_file(path)); }

// Records the epochs it sees and the hooks it is called at.
struct Probe : Callback {
  explicit Probe(int order_value = 0) : Callback("probe"), order_(order_value) {}
  int order() const override { return order_; }
  std::vector<std::int64_t> epochs;
  std::vector<std::string> hooks;
  std::function<void(Context&)> at_fit_begin;
  void on_fit_begin(Context& ctx) override {
    hooks.push_back("fit_begin");
    if (at_fit_begin) at_fit_begin(ctx);
  }
  void on_epoch_begin(Context& ctx) override {
    epochs.push_back(ctx.epoch);
    hooks.push_back("epoch_begin");
  }
  void on_train_begin(Context&) override { hooks.push_back("train_begin"); }
  void on_train_batch_begin(Context&) override { hooks.push_back("train_batch_begin"); }
  void on_train_batch_after_pred(Context&) override { hooks.push_back("train_after_pred"); }
  void on_train_batch_after_loss(Context&) override { hooks.push_back("train_after_loss"); }
  void on_train_batch_before_backward(Context&) override { hooks.push_back("before_backward"); }
  void on_train_batch_before_step(Context&) override { hooks.push_back("before_step"); }
  void on_train_batch_after_step(Context&) override { hooks.push_back("after_step"); }
  void on_train_batch_end(Context&) override { hooks.push_back("train_batch_end"); }
  void on_train_end(Context&) override { hooks.push_back("train_end"); }
  void on_valid_begin(Context&) override { hooks.push_back("valid_begin"); }
  void on_valid_batch_begin(Context&) override { hooks.push_back("valid_batch_begin"); }
  void on_valid_batch_after_pred(Context&) override { hooks.push_back("valid_after_pred"); }
  void on_valid_batch_after_loss(Context&) override { hooks.push_back("valid_after_loss"); }
  void on_valid_batch_end(Context&) override { hooks.push_back("valid_batch_end"); }
  void on_valid_end(Context&) override { hooks.push_back("valid_end"); }
  void on_epoch_end(Context&) override { hooks.push_back("epoch_end"); }
  void on_fit_end(Context&) override { hooks.push_back("fit_end"); }

 private:
  int order_;
};

// The seed's first scenario, as a test: an interrupt at the end of epoch 5, a rerun of the
// same fit, and records and weights bit-identical to a fit that was never interrupted.
TEST(Learner, SeedAutoResumeInterruptAtEpochFiveRerunFinishesBitIdentically) {
  auto data = testing::seed_data();
  auto reference = testing::linear_learner();
  torch::manual_seed(42);
  FitResult expected = reference->fit({data.x, data.y}, quiet());
  ASSERT_EQ(expected.records.values("train", "loss").size(), 10u);

  TempDir dir;
  std::string state = dir / "state.ckpt";
  auto interrupt = std::make_shared<Interrupt>();
  auto first = testing::linear_learner();
  torch::manual_seed(42);
  try {
    first->fit({data.x, data.y}, quiet().callbacks({interrupt, callbacks::auto_resume(state)}));
    FAIL() << "the interrupt callback must stop the first fit";
  } catch (const CallbackError& e) {
    EXPECT_EQ(e.callback(), "interrupt");
    EXPECT_EQ(e.hook(), "on_epoch_end");
    EXPECT_EQ(e.epoch(), 5);
    EXPECT_NE(std::string(e.what()).find("Error on epoch 5"), std::string::npos) << e.what();
  }
  ASSERT_TRUE(Env::posix().stat(state).exists);

  // The rerun: a new process would build a new model (other initial weights here, and other
  // global RNG state) and call the same fit.
  auto probe = std::make_shared<Probe>();
  auto second = testing::linear_learner(/*init_seed=*/99);
  torch::manual_seed(7);
  FitResult result = second->fit(
      {data.x, data.y}, quiet().callbacks({interrupt, callbacks::auto_resume(state), probe}));
  EXPECT_EQ(result.resumed_after_epoch, std::optional<std::int64_t>(4));
  EXPECT_EQ(probe->epochs, (std::vector<std::int64_t>{5, 6, 7, 8, 9, 10}))
      << "finished epochs must not be replayed and ctx.epoch must continue (luz#136)";
  EXPECT_EQ(result.epochs_completed, 10);
  expect_same_records(result.records, expected.records);
  expect_same_weights(*second, *reference);
  EXPECT_FALSE(Env::posix().stat(state).exists) << "a completed fit deletes its state file";
}

// Everything that carries state at once, interrupted mid-epoch with step-level saves: Dropout
// (RNG), Adam, an LR scheduler, validation data with a metric, model_checkpoint's best value,
// early stopping's counters and a custom callback's state.
TEST(Learner, MidEpochAutoResumeWithEveryKindOfStateIsBitIdentical) {
  auto data = testing::seed_data();
  auto valid = testing::seed_data(200);
  TempDir dir;
  auto run = [&](Learner& learner, const std::string& ckpts, std::vector<CallbackPtr> extra,
                 std::shared_ptr<LossTally> tally) {
    std::vector<CallbackPtr> cbs = {callbacks::lr_scheduler([](torch::optim::Optimizer& opt) {
                                      return std::make_unique<StepLR>(opt,
                                                                      StepLROptions(2).gamma(0.5));
                                    }),
                                    callbacks::model_checkpoint(ckpts).save_best_only(true),
                                    callbacks::early_stopping().patience(100), tally};
    cbs.insert(cbs.end(), extra.begin(), extra.end());
    return learner.fit(
        {data.x, data.y},
        quiet(6).valid_data({valid.x, valid.y}).metrics({metrics::mae()}).callbacks(cbs));
  };

  auto reference = testing::dropout_learner();
  torch::manual_seed(5);
  auto reference_tally = std::make_shared<LossTally>();
  FitResult expected = run(*reference, dir / "ref-ckpts/", {}, reference_tally);

  struct StopAt : Callback {
    StopAt() : Callback("stop_at") {}
    bool fired = false;
    void on_train_batch_end(Context& ctx) override {
      if (!fired && ctx.epoch == 3 && ctx.batch == 17) {
        fired = true;
        throw std::runtime_error("killed mid-epoch");
      }
    }
  };
  auto stop = std::make_shared<StopAt>();
  std::string state = dir / "state.ckpt";
  auto first = testing::dropout_learner();
  torch::manual_seed(5);
  EXPECT_THROW(
      run(*first, dir / "ckpts/", {stop, callbacks::auto_resume(state).save_every_steps(5)},
          std::make_shared<LossTally>()),
      CallbackError);

  auto second = testing::dropout_learner(/*init_seed=*/1234);
  torch::manual_seed(99);
  auto tally = std::make_shared<LossTally>();
  FitResult result = run(*second, dir / "ckpts/",
                         {stop, callbacks::auto_resume(state).save_every_steps(5)}, tally);
  EXPECT_EQ(result.resumed_after_epoch, std::optional<std::int64_t>(2));
  expect_same_records(result.records, expected.records);
  expect_same_weights(*second, *reference);
  EXPECT_TRUE(same_bits(tally->sum, reference_tally->sum));
  EXPECT_EQ(tally->batches, reference_tally->batches);
  EXPECT_EQ(result.steps, expected.steps);
  EXPECT_EQ(second->optimizer().param_groups()[0].options().get_lr(),
            reference->optimizer().param_groups()[0].options().get_lr());
  EXPECT_EQ(testing::list_sorted(dir / "ckpts"), testing::list_sorted(dir / "ref-ckpts"));
}

TEST(Learner, ModelCheckpointBestValueSurvivesAutoResume) {
  // mode max on a falling loss: only epoch 1 is ever "best". Had the best value been lost in
  // the resume, epoch 5 would be written too.
  auto data = testing::seed_data();
  TempDir dir;
  auto interrupt = std::make_shared<Interrupt>(5);
  auto options = [&] {
    return quiet(8).callbacks({interrupt,
                               callbacks::model_checkpoint(dir / "ckpts/")
                                   .monitor("train_loss")
                                   .mode(Mode::kMax)
                                   .save_best_only(true),
                               callbacks::auto_resume(dir / "state.ckpt")});
  };
  EXPECT_THROW(testing::linear_learner()->fit({data.x, data.y}, options()), CallbackError);
  testing::linear_learner()->fit({data.x, data.y}, options());
  auto files = testing::list_sorted(dir / "ckpts");
  ASSERT_EQ(files.size(), 1u) << fmt::format("{}", fmt::join(files, " "));
  EXPECT_EQ(files[0].rfind("epoch-01-train_loss-", 0), 0u) << files[0];
}

TEST(Learner, EarlyStoppingPatienceSurvivesAutoResume) {
  // mode max on a falling loss never improves after epoch 1: with patience 2 the fit stops at
  // epoch 3. The interrupt at epoch 2 must not reset the count.
  auto data = testing::seed_data();
  TempDir dir;
  auto interrupt = std::make_shared<Interrupt>(2);
  auto options = [&] {
    return quiet(10).callbacks(
        {interrupt, callbacks::early_stopping().monitor("train_loss").mode(Mode::kMax).patience(2),
         callbacks::auto_resume(dir / "state.ckpt")});
  };
  EXPECT_THROW(testing::linear_learner()->fit({data.x, data.y}, options()), CallbackError);
  FitResult result = testing::linear_learner()->fit({data.x, data.y}, options());
  EXPECT_TRUE(result.stopped_early);
  EXPECT_EQ(result.epochs_completed, 3);
}

TEST(Learner, SeedModelCheckpointWritesOneFilePerEpochNamedByTheMonitoredLoss) {
  auto data = testing::seed_data();
  TempDir dir;
  auto learner = testing::linear_learner();
  FitResult result = learner->fit(
      {data.x, data.y},
      quiet().callbacks({callbacks::model_checkpoint(dir / "checkpoints/").monitor("train_loss")}));
  std::vector<std::string> expected;
  const auto& losses = result.records.values("train", "loss");
  for (std::size_t i = 0; i < losses.size(); ++i) {
    expected.push_back(fmt::format("epoch-{:02d}-train_loss-{:.3f}.ckpt", i + 1, losses[i]));
  }
  EXPECT_EQ(testing::list_sorted(dir / "checkpoints"), expected);
  // Each file is a full learner checkpoint of its epoch.
  StateDict third = read_state(dir / "checkpoints" + "/" + expected[2]);
  EXPECT_EQ(third.get<std::int64_t>("counters.epoch"), 3);
  EXPECT_EQ(third.value("learner.metrics")["train_loss"].get<double>(), losses[2]);
}

TEST(Learner, ModelCheckpointTemplateAndSaveBestOnlyMinDelta) {
  auto data = testing::seed_data();
  TempDir dir;
  FitResult result = testing::linear_learner()->fit(
      {data.x, data.y},
      quiet(6).callbacks({callbacks::model_checkpoint(dir / "run-{epoch}-{train_loss:.2f}.ckpt")
                              .monitor("train_loss")
                              .save_best_only(true)
                              .min_delta(0.01)}));
  // Expected: the epochs whose loss beats the best so far by more than 0.01.
  std::vector<std::string> expected;
  double best = std::numeric_limits<double>::infinity();
  const auto& losses = result.records.values("train", "loss");
  for (std::size_t i = 0; i < losses.size(); ++i) {
    if (losses[i] < best - 0.01) {
      best = losses[i];
      expected.push_back(fmt::format("run-{}-{:.2f}.ckpt", i + 1, losses[i]));
    }
  }
  ASSERT_LT(expected.size(), losses.size()) << "the data must exercise min_delta";
  std::vector<std::string> got;
  for (const std::string& name : testing::list_sorted(dir.path())) {
    if (name.rfind("run-", 0) == 0) got.push_back(name);
  }
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(got, expected);
}

TEST(Learner, MonitoringAMetricThatDoesNotExistIsAClearError) {
  auto data = testing::seed_data();
  TempDir dir;
  auto learner = testing::linear_learner();
  expect_error(
      [&] {
        learner->fit({data.x, data.y},
                     quiet().callbacks({callbacks::model_checkpoint(dir / "c/")}));  // valid_loss
      },
      ErrorCode::InvalidArgument,
      {"monitors 'valid_loss'", "it records: train_loss", "valid_data"});
  expect_error(
      [&] {
        learner->fit({data.x, data.y},
                     quiet()
                         .metrics({metrics::mae()})
                         .callbacks({callbacks::early_stopping().monitor("train_acc")}));
      },
      ErrorCode::InvalidArgument, {"'train_acc'", "train_loss, train_mae"});
  expect_error(
      [&] {
        learner->fit(
            {data.x, data.y},
            quiet(1).callbacks(
                {callbacks::model_checkpoint(dir / "x-{nope}.ckpt").monitor("train_loss")}));
      },
      ErrorCode::InvalidArgument,
      {"x-{nope}.ckpt", "the fields it may use are {epoch}, {monitor}, {train_loss}"});
}

// luz's own example template: a directory per epoch, and the monitored value by {monitor}.
TEST(Learner, ModelCheckpointTemplateTakesLuzsMonitorField) {
  auto data = testing::seed_data();
  TempDir dir;
  FitResult result = testing::linear_learner()->fit(
      {data.x, data.y},
      quiet(3).callbacks(
          {callbacks::model_checkpoint(dir / "checkpoints/epoch-{epoch:02d}/model-{monitor:.2f}.pt")
               .monitor("train_loss")}));
  const auto& losses = result.records.values("train", "loss");
  ASSERT_EQ(losses.size(), 3u);
  for (int epoch = 1; epoch <= 3; ++epoch) {
    std::string expected = dir / fmt::format("checkpoints/epoch-{:02d}/model-{:.2f}.pt", epoch,
                                             losses[static_cast<std::size_t>(epoch - 1)]);
    EXPECT_TRUE(verify(expected).ok()) << expected;
  }
}

// luz_load_checkpoint(results, path): the weights go into the model the fit returned.
// Lightning's save_top_k through the checkpoint layer's retention policy: the k best files by
// the monitor and the newest stay, also across an interrupt and auto_resume.
TEST(Learner, ModelCheckpointSaveTopKKeepsTheBestAndTheNewest) {
  auto data = testing::seed_data();
  TempDir dir;
  auto options = [&](const std::string& ckpts, std::vector<CallbackPtr> extra) {
    // mode max on a falling loss: the best two are epochs 1 and 2.
    std::vector<CallbackPtr> cbs = {
        callbacks::model_checkpoint(ckpts).monitor("train_loss").mode(Mode::kMax).save_top_k(2)};
    for (auto& c : extra) cbs.push_back(c);
    return quiet(6).seed(7).callbacks(cbs);
  };
  testing::linear_learner()->fit({data.x, data.y}, options(dir / "whole/", {}));
  std::vector<std::string> whole = testing::list_sorted(dir / "whole");
  ASSERT_EQ(whole.size(), 3u);
  EXPECT_EQ(whole[0].rfind("epoch-01-", 0), 0u) << whole[0];
  EXPECT_EQ(whole[1].rfind("epoch-02-", 0), 0u) << whole[1];
  EXPECT_EQ(whole[2].rfind("epoch-06-", 0), 0u) << whole[2];

  EXPECT_THROW(testing::linear_learner()->fit(
                   {data.x, data.y},
                   options(dir / "resumed/", {std::make_shared<Interrupt>(4),
                                              callbacks::auto_resume(dir / "state.ckpt")})),
               CallbackError);
  testing::linear_learner()->fit(
      {data.x, data.y}, options(dir / "resumed/", {callbacks::auto_resume(dir / "state.ckpt")}));
  EXPECT_EQ(testing::list_sorted(dir / "resumed"), whole);

  // The same with both callbacks saving in the background: the deletions wait for each commit.
  auto async_options = [&](const std::string& ckpts, std::vector<CallbackPtr> extra) {
    std::vector<CallbackPtr> cbs = {callbacks::model_checkpoint(ckpts)
                                        .monitor("train_loss")
                                        .mode(Mode::kMax)
                                        .save_top_k(2)
                                        .async(true)};
    for (auto& c : extra) cbs.push_back(c);
    return quiet(6).seed(7).callbacks(cbs);
  };
  testing::linear_learner()->fit({data.x, data.y}, async_options(dir / "async/", {}));
  EXPECT_EQ(testing::list_sorted(dir / "async"), whole);
  EXPECT_THROW(testing::linear_learner()->fit(
                   {data.x, data.y},
                   async_options(dir / "async-resumed/",
                                 {std::make_shared<Interrupt>(4),
                                  callbacks::auto_resume(dir / "async-state.ckpt").async(true)})),
               CallbackError);
  testing::linear_learner()->fit(
      {data.x, data.y},
      async_options(dir / "async-resumed/",
                    {callbacks::auto_resume(dir / "async-state.ckpt").async(true)}));
  EXPECT_EQ(testing::list_sorted(dir / "async-resumed"), whole);
  EXPECT_FALSE(std::filesystem::exists(dir / "async-state.ckpt"))
      << "deleted at the end of the fit, after its last background save";

  expect_error([] { callbacks::model_checkpoint("x/").save_top_k(0).build(); },
               ErrorCode::InvalidArgument, {"save_top_k"});
}

TEST(Learner, LoadCheckpointIntoWhatFitReturned) {
  auto data = testing::seed_data();
  TempDir dir;
  auto learner = testing::linear_learner();
  FitResult results = learner->fit(
      {data.x, data.y},
      quiet(3).callbacks({callbacks::model_checkpoint(dir / "ck/").monitor("train_loss")}));
  ASSERT_EQ(results.model, learner->model_ptr()) << "a plain Learner trains its own model";
  std::string first = dir / "ck" + "/" + testing::list_sorted(dir / "ck").front();
  StateDict saved = read_state(first);
  load_checkpoint(results, first);
  EXPECT_TRUE(testing::bitwise_equal(results.model->named_parameters()["weight"],
                                     saved.tensor("model.weight")));
  EXPECT_TRUE(testing::bitwise_equal(results.model->named_parameters()["bias"],
                                     saved.tensor("model.bias")));

  FitResult empty;
  expect_error([&] { load_checkpoint(empty, first); }, ErrorCode::InvalidArgument,
               {"holds no model", first});
  expect_error([&] { load_checkpoint(results, dir / "missing.ckpt"); }, ErrorCode::NotFound,
               {"missing.ckpt"});
}

// Calling fit again: a plain Learner goes on from its weights (a warm start); a Learner made
// from a model_factory trains a new model each time, as luz's fit does, and each result keeps
// its own model.
TEST(Learner, FitAgainWarmStartsOrTrainsANewModelFromAFactory) {
  auto data = testing::seed_data();
  auto plain = testing::linear_learner();
  FitResult p1 = plain->fit({data.x, data.y}, quiet(2).seed(11));
  FitResult p2 = plain->fit({data.x, data.y}, quiet(2).seed(11));
  EXPECT_EQ(p1.model, p2.model);
  EXPECT_EQ(p2.records.values("train", "loss").size(), 2u) << "records start empty";
  EXPECT_LT(p2.records.values("train", "loss")[0], p1.records.values("train", "loss")[0])
      << "the second fit starts from the trained weights";

  auto make = [] { return torch::nn::Linear(10, 1); };
  auto optimizer = make_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.01));
  torch::manual_seed(1);
  Learner factory(model_factory(make), optimizer, torch::mse_loss);
  FitResult f1 = factory.fit({data.x, data.y}, quiet(2).seed(11));
  // The first fit trained the model the factory made first: the plain learner's first fit.
  expect_same_records(f1.records, p1.records);
  torch::manual_seed(1);  // the second model is made at the start of the fit, from this seed
  FitResult f2 = factory.fit({data.x, data.y}, quiet(2).seed(11));
  EXPECT_NE(f1.model, f2.model);
  EXPECT_EQ(f2.model, factory.model_ptr());
  expect_same_records(f2.records, f1.records);
  EXPECT_TRUE(testing::bitwise_equal(f1.model->named_parameters()["weight"],
                                     f2.model->named_parameters()["weight"]));
  // The optimizer is new too, over the new model's parameters.
  EXPECT_TRUE(factory.optimizer().param_groups()[0].params()[0].is_same(
      f2.model->named_parameters()["weight"]));
}

// luz's guide with a module generator: the interrupted fit is rerun on the same Learner; the
// new model auto_resume restores ends as the uninterrupted run's.
TEST(Learner, ModelFactoryResumesTheGuidesFlow) {
  auto data = testing::seed_data();
  TempDir dir;
  auto make = [] { return torch::nn::Linear(10, 1); };
  auto optimizer = make_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.01));
  torch::manual_seed(1);
  Learner reference(model_factory(make), optimizer, torch::mse_loss);
  FitResult expected = reference.fit({data.x, data.y}, quiet(6).seed(5));

  torch::manual_seed(1);
  Learner learner(model_factory(make), optimizer, torch::mse_loss);
  auto interrupt = std::make_shared<Interrupt>(4);
  auto options =
      quiet(6).seed(5).callbacks({callbacks::auto_resume(dir / "state.ckpt"), interrupt});
  EXPECT_THROW(learner.fit({data.x, data.y}, options), CallbackError);
  FitResult result = learner.fit({data.x, data.y}, options);
  EXPECT_EQ(result.resumed_after_epoch, std::optional<std::int64_t>(3));
  expect_same_records(result.records, expected.records);
  expect_same_weights(learner, reference);
}

// A callback's state may hold children (one StateDict per epoch here, with a tensor and a
// value each) and comes back whole after auto_resume.
TEST(Learner, NestedCallbackStateSurvivesAResume) {
  struct PerEpoch : Callback {
    PerEpoch() : Callback("per_epoch") {}
    StateDict epochs;
    void on_epoch_end(Context& ctx) override {
      StateDict child;
      child.set("weight", ctx.model->named_parameters()["weight"].detach().clone());
      child.set_double("loss", ctx.metrics.at("train_loss"));
      StateDict inner;
      inner.set("step", ctx.step);
      child.set_child("at", inner);
      epochs.set_child(fmt::format("epoch_{}", ctx.epoch), child);
    }
    StateDict state_dict() const override { return epochs; }
    void load_state_dict(const StateDict& s) override { epochs = s.clone(); }
  };
  auto data = testing::seed_data();
  TempDir dir;
  auto whole = std::make_shared<PerEpoch>();
  testing::linear_learner()->fit({data.x, data.y}, quiet(5).seed(3).callbacks({whole}));

  auto first = std::make_shared<PerEpoch>();
  auto options = [&](CallbackPtr cb, bool interrupt) {
    std::vector<CallbackPtr> cbs = {callbacks::auto_resume(dir / "s.ckpt"), cb};
    if (interrupt) cbs.push_back(std::make_shared<Interrupt>(3));
    return quiet(5).seed(3).callbacks(cbs);
  };
  EXPECT_THROW(testing::linear_learner()->fit({data.x, data.y}, options(first, true)),
               CallbackError);
  auto resumed = std::make_shared<PerEpoch>();
  testing::linear_learner()->fit({data.x, data.y}, options(resumed, false));
  for (int epoch = 1; epoch <= 5; ++epoch) {
    StateDict want = whole->epochs.child(fmt::format("epoch_{}", epoch));
    StateDict got = resumed->epochs.child(fmt::format("epoch_{}", epoch));
    EXPECT_TRUE(testing::bitwise_equal(got.tensor("weight"), want.tensor("weight"))) << epoch;
    EXPECT_TRUE(same_bits(got.get_double("loss"), want.get_double("loss"))) << epoch;
    EXPECT_EQ(got.child("at").get<std::int64_t>("step"),
              want.child("at").get<std::int64_t>("step"));
  }
}

TEST(Learner, SeedLoadCheckpointReplacesTheWeightsOfAFittedLearner) {
  auto data = testing::seed_data();
  TempDir dir;
  auto learner = testing::linear_learner();
  learner->fit(
      {data.x, data.y},
      quiet(3).callbacks({callbacks::model_checkpoint(dir / "ck/").monitor("train_loss")}));
  std::string first = dir / "ck" + "/" + testing::list_sorted(dir / "ck").front();
  StateDict saved = read_state(first);
  ASSERT_FALSE(testing::bitwise_equal(learner->model().named_parameters()["weight"],
                                      saved.tensor("model.weight")));
  load_checkpoint(*learner, first);
  EXPECT_TRUE(testing::bitwise_equal(learner->model().named_parameters()["weight"],
                                     saved.tensor("model.weight")));
  EXPECT_TRUE(testing::bitwise_equal(learner->model().named_parameters()["bias"],
                                     saved.tensor("model.bias")));
  // predict() now uses those weights.
  at::Tensor expected = torch::addmm(saved.tensor("model.bias"), data.x.slice(0, 0, 4),
                                     saved.tensor("model.weight").t());
  EXPECT_TRUE(torch::allclose(learner->predict(data.x.slice(0, 0, 4)), expected));
}

TEST(Learner, LoadCheckpointErrorsChangeNothing) {
  auto data = testing::seed_data();
  TempDir dir;
  auto learner = testing::linear_learner();
  learner->fit(
      {data.x, data.y},
      quiet(1).callbacks({callbacks::model_checkpoint(dir / "ck/").monitor("train_loss")}));
  std::string file = dir / "ck" + "/" + testing::list_sorted(dir / "ck").front();

  torch::manual_seed(3);
  Learner wide(torch::nn::Linear(10, 2),
               make_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.1)), torch::mse_loss);
  at::Tensor before = wide.model().named_parameters()["weight"].clone();
  expect_error([&] { load_checkpoint(wide, file); }, ErrorCode::Incompatible,
               {"size mismatch for weight: checkpoint [1, 10], model [2, 10]"});
  EXPECT_TRUE(testing::bitwise_equal(wide.model().named_parameters()["weight"], before));

  expect_error([&] { load_checkpoint(wide, dir / "missing.ckpt"); }, ErrorCode::NotFound,
               {"missing.ckpt"});
  save_file(dir / "plain.safetensors", {{{"w", torch::ones({2})}}, {}});
  expect_error([&] { load_checkpoint(wide, dir / "plain.safetensors"); }, ErrorCode::Incompatible,
               {"not a learner checkpoint"});
  testing::flip_bit(file, testing::file_size(file) - 3, 1);
  expect_error([&] { load_checkpoint(*learner, file); }, ErrorCode::Corruption, {file});
}

// Fits 3 epochs with Adam, early stopping and model_checkpoint, for the resume tests.
struct Saved {
  TempDir dir;
  std::string ckpts;
  std::string last;
  StateDict last_state;
  Saved() {
    auto data = testing::seed_data();
    auto learner = testing::dropout_learner();
    ckpts = dir / "ckpts";
    learner->fit({data.x, data.y},
                 quiet(3).callbacks({callbacks::model_checkpoint(ckpts + "/").monitor("train_loss"),
                                     callbacks::early_stopping().monitor("train_loss")}));
    last = ckpts + "/" + testing::list_sorted(ckpts).back();
    last_state = read_state(last);
  }
};

// What a fit sees right after resume_from_checkpoint ran (a probe that runs after it).
struct AfterResume {
  StateDict model, optimizer;
  MetricRecords records;
  std::int64_t epochs_done = 0;
  // 950: right after resume_from_checkpoint (900); 2000: after auto_resume (1000) too.
  std::shared_ptr<Probe> probe(int order = 950) {
    auto p = std::make_shared<Probe>(order);
    p->at_fit_begin = [this](Context& ctx) {
      model = module_state_dict(*ctx.model).clone();
      optimizer = optimizer_state_dict(*ctx.optimizer).clone();
      records = *ctx.records;
      epochs_done = ctx.learner->counters().epoch;
    };
    return p;
  }
};

bool model_matches(const StateDict& model, const StateDict& file) {
  for (const std::string& key : model.keys()) {
    if (!testing::bitwise_equal(model.tensor(key), file.tensor("model." + key))) return false;
  }
  return true;
}

TEST(Learner, SeedResumeFromCheckpointRestoresOnlyTheModelByDefault) {
  Saved saved;
  auto data = testing::seed_data();
  AfterResume seen;
  auto learner = testing::dropout_learner(77);
  FitResult result = learner->fit(
      {data.x, data.y},
      quiet(2).callbacks({callbacks::resume_from_checkpoint(saved.ckpts), seen.probe()}));
  EXPECT_TRUE(model_matches(seen.model, saved.last_state)) << "newest checkpoint's weights";
  EXPECT_FALSE(seen.optimizer.contains("state.0.0.exp_avg")) << "optimizer state not restored";
  EXPECT_TRUE(seen.records.empty());
  EXPECT_EQ(seen.epochs_done, 0);
  EXPECT_EQ(result.records.values("train", "loss").size(), 2u);
}

// As luz: the records come back and then the fit trains the epochs it asks for, after them
// (before, a fit of 10 epochs resumed at epoch 3 trained 7, and one resumed at epoch 10 none).
TEST(Learner, ResumeFromCheckpointRestoreRecordsContinuesAfterTheSavedEpoch) {
  Saved saved;
  auto data = testing::seed_data();
  AfterResume seen;
  FitResult result = testing::dropout_learner(77)->fit(
      {data.x, data.y},
      quiet(2).callbacks(
          {callbacks::resume_from_checkpoint(saved.last).restore_records(true), seen.probe()}));
  EXPECT_EQ(seen.epochs_done, 3);
  EXPECT_EQ(result.resumed_after_epoch, std::optional<std::int64_t>(3));
  EXPECT_EQ(result.epochs_completed, 5) << "3 restored + the 2 this fit asks for";
  MetricRecords saved_records;
  saved_records.load_state_dict(saved.last_state.child("records"));
  expect_same_records(seen.records, saved_records);
  ASSERT_EQ(result.records.values("train", "loss").size(), 5u);
  EXPECT_TRUE(same_bits(result.records.values("train", "loss")[2],
                        saved_records.values("train", "loss")[2]));
  EXPECT_FALSE(seen.optimizer.contains("state.0.0.exp_avg"));
}

TEST(Learner, ResumeFromCheckpointRestoreOptimizerState) {
  Saved saved;
  auto data = testing::seed_data();
  AfterResume seen;
  testing::dropout_learner(77)->fit(
      {data.x, data.y},
      quiet(1).callbacks(
          {callbacks::resume_from_checkpoint(saved.last).restore_optimizer_state(true),
           seen.probe()}));
  StateDict file_optimizer = saved.last_state.child("optimizer");
  ASSERT_TRUE(seen.optimizer.contains("state.0.0.exp_avg"));
  for (const std::string& key : file_optimizer.keys()) {
    if (file_optimizer.is_tensor(key)) {
      EXPECT_TRUE(testing::bitwise_equal(seen.optimizer.tensor(key), file_optimizer.tensor(key)))
          << key;
    }
  }
  EXPECT_TRUE(seen.records.empty());
}

// auto_resume resumes the same fit: a saved callback state that this fit has no callback for
// is an error naming it (resume_from_checkpoint, below, only warns).
TEST(Learner, AutoResumeRefusesCallbackStatesThisFitCannotTake) {
  auto data = testing::seed_data();
  TempDir dir;
  const std::string state = dir / "state.ckpt";
  try {
    testing::linear_learner()->fit(
        {data.x, data.y},
        quiet().callbacks({std::make_shared<Interrupt>(), callbacks::auto_resume(state),
                           callbacks::early_stopping().monitor("train_loss").patience(100)}));
    FAIL() << "the interrupt callback must stop the first fit";
  } catch (const CallbackError&) {
  }
  expect_error(
      [&] {
        testing::linear_learner()->fit({data.x, data.y},
                                       quiet().callbacks({callbacks::auto_resume(state)}));
      },
      ErrorCode::Incompatible, {"early_stopping", "no callback of that name"});
}

TEST(Learner, ResumeFromCheckpointRestoreCallbacksState) {
  Saved saved;
  auto data = testing::seed_data();
  CallbackPtr stopping = callbacks::early_stopping().monitor("train_loss").build();
  CallbackPtr checkpoint =
      callbacks::model_checkpoint(saved.dir / "more/").monitor("train_loss").build();
  StateDict restored;
  auto probe = std::make_shared<Probe>(950);
  probe->at_fit_begin = [&](Context&) { restored = stopping->state_dict(); };
  testing::dropout_learner(77)->fit(
      {data.x, data.y},
      quiet(1).callbacks(
          {callbacks::resume_from_checkpoint(saved.last).restore_callbacks_state(true), stopping,
           checkpoint, probe}));
  EXPECT_EQ(restored.get_double("best"),
            saved.last_state.get_double("callbacks.state.early_stopping.best"));
  EXPECT_TRUE(std::isfinite(restored.get_double("best")));

  // Without the flag the callback keeps its fresh state.
  CallbackPtr fresh = callbacks::early_stopping().monitor("train_loss").build();
  probe->at_fit_begin = [&](Context&) { restored = fresh->state_dict(); };
  testing::dropout_learner(77)->fit(
      {data.x, data.y},
      quiet(1).callbacks({callbacks::resume_from_checkpoint(saved.last), fresh, probe}));
  EXPECT_TRUE(std::isinf(restored.get_double("best")));

  // As luz: a saved callback state with no callback of this fit to take it is reported, not
  // refused, and the callbacks present get theirs.
  std::ostringstream output;
  CallbackPtr only_stopping = callbacks::early_stopping().monitor("train_loss").build();
  probe->at_fit_begin = [&](Context&) { restored = only_stopping->state_dict(); };
  testing::dropout_learner(77)->fit(
      {data.x, data.y},
      FitOptions().epochs(1).output(&output).callbacks(
          {callbacks::resume_from_checkpoint(saved.last).restore_callbacks_state(true),
           only_stopping, probe}));
  EXPECT_NE(output.str().find("warning: the checkpoint holds the state of callback(s) "
                              "model_checkpoint that this fit does not have"),
            std::string::npos)
      << output.str();
  EXPECT_EQ(restored.get_double("best"),
            saved.last_state.get_double("callbacks.state.early_stopping.best"));
}

TEST(Learner, ResumeFromDirectoryTakesTheLargestEpochNumberAndSkipsCorruptOnes) {
  auto data = testing::seed_data();
  TempDir dir;
  std::string ckpts = dir / "numbered";
  testing::linear_learner()->fit(
      {data.x, data.y},
      quiet(10).callbacks(
          {callbacks::model_checkpoint(ckpts + "/epoch-{epoch}.ckpt").monitor("train_loss")}));
  // Lexical order would take epoch-9.ckpt; the newest is epoch-10.ckpt.
  AfterResume seen;
  testing::linear_learner(5)->fit(
      {data.x, data.y},
      quiet(1).callbacks({callbacks::resume_from_checkpoint(ckpts), seen.probe()}));
  EXPECT_TRUE(model_matches(seen.model, read_state(ckpts + "/epoch-10.ckpt")));

  testing::flip_bit(ckpts + "/epoch-10.ckpt", 200, 0);
  std::ostringstream output;  // the Learner's warnings go where its progress goes
  testing::linear_learner(5)->fit({data.x, data.y},
                                  FitOptions().epochs(1).output(&output).callbacks(
                                      {callbacks::resume_from_checkpoint(ckpts), seen.probe()}));
  std::string warnings = output.str();
  EXPECT_NE(warnings.find("skipping invalid checkpoint " + ckpts + "/epoch-10.ckpt"),
            std::string::npos)
      << warnings;
  EXPECT_TRUE(model_matches(seen.model, read_state(ckpts + "/epoch-9.ckpt")));

  // A path that does not exist: as luz, a warning, and the fit starts from scratch.
  std::ostringstream fresh_output;
  FitResult fresh = testing::linear_learner()->fit(
      {data.x, data.y}, FitOptions()
                            .epochs(2)
                            .output(&fresh_output)
                            .callbacks({callbacks::resume_from_checkpoint(dir / "nowhere")}));
  EXPECT_NE(fresh_output.str().find("warning: resume_from_checkpoint: " + dir / "nowhere" +
                                    " does not exist; training starts from scratch"),
            std::string::npos)
      << fresh_output.str();
  EXPECT_EQ(fresh.resumed_after_epoch, std::nullopt);
  EXPECT_EQ(fresh.epochs_completed, 2);
  // verbose(false) silences it.
  std::ostringstream silent;
  testing::linear_learner()->fit({data.x, data.y},
                                 FitOptions().epochs(1).verbose(false).output(&silent).callbacks(
                                     {callbacks::resume_from_checkpoint(dir / "nowhere")}));
  EXPECT_EQ(silent.str(), "");
}

TEST(Learner, CallbackHooksRunInLuzOrder) {
  auto x = torch::randn({4, 10}), y = torch::randn({4, 1});
  auto probe = std::make_shared<Probe>();
  testing::linear_learner()->fit(
      {x, y},
      quiet(1).batch_size(2).valid_data({x.slice(0, 0, 2), y.slice(0, 0, 2)}).callbacks({probe}));
  std::vector<std::string> batch = {"train_batch_begin", "train_after_pred", "train_after_loss",
                                    "before_backward",   "before_step",      "after_step",
                                    "train_batch_end"};
  std::vector<std::string> expected = {"fit_begin", "epoch_begin", "train_begin"};
  expected.insert(expected.end(), batch.begin(), batch.end());
  expected.insert(expected.end(), batch.begin(), batch.end());
  for (const char* h :
       {"train_end", "valid_begin", "valid_batch_begin", "valid_after_pred", "valid_after_loss",
        "valid_batch_end", "valid_end", "epoch_end", "fit_end"}) {
    expected.push_back(h);
  }
  EXPECT_EQ(probe->hooks, expected);
}

TEST(Learner, CallbackErrorsNameTheCallbackAndTorchpointErrorsPassThrough) {
  auto data = testing::seed_data(64);
  struct Thrower : Callback {
    Thrower() : Callback("thrower") {}
    void on_train_batch_before_step(Context& ctx) override {
      if (ctx.epoch == 2) throw std::logic_error("bad gradient");
    }
  };
  try {
    testing::linear_learner()->fit({data.x, data.y},
                                   quiet(3).callbacks({std::make_shared<Thrower>()}));
    FAIL();
  } catch (const CallbackError& e) {
    EXPECT_STREQ(e.what(),
                 "error in callback 'thrower' at on_train_batch_before_step (epoch 2): bad "
                 "gradient");
    try {
      std::rethrow_if_nested(e);
      FAIL() << "the original exception is nested";
    } catch (const std::logic_error& original) {
      EXPECT_STREQ(original.what(), "bad gradient");
    }
  }
  struct Refuser : Callback {
    Refuser() : Callback("refuser") {}
    void on_fit_begin(Context&) override { throw Error(ErrorCode::Locked, "held elsewhere"); }
  };
  expect_error(
      [&] {
        testing::linear_learner()->fit({data.x, data.y},
                                       quiet(1).callbacks({std::make_shared<Refuser>()}));
      },
      ErrorCode::Locked, {"held elsewhere"});
  auto refuser = std::make_shared<Refuser>();
  expect_error(
      [&] {
        testing::linear_learner()->fit({data.x, data.y}, quiet(1).callbacks({refuser, refuser}));
      },
      ErrorCode::InvalidArgument, {"callback 'refuser' is given twice"});
}

// Several model_checkpoint callbacks in one fit need no hand-given names (luz's users add one
// per monitored metric): the later ones are numbered, and each keeps its own best value (with
// auto_resume in the fit, whose checkpoints hold both states).
TEST(Learner, SeveralModelCheckpointsInOneFitWithoutNames) {
  auto data = testing::seed_data();
  TempDir dir;
  auto make_callbacks = [&] {
    return std::vector<CallbackPtr>{
        callbacks::model_checkpoint(dir / "by_loss/").monitor("train_loss").save_best_only(true),
        callbacks::model_checkpoint(dir / "by_mae/")
            .monitor("train_mae")
            .mode(Mode::kMax)
            .save_best_only(true),
        callbacks::auto_resume(dir / "state.ckpt")};
  };
  std::vector<CallbackPtr> first = make_callbacks();
  testing::linear_learner()->fit({data.x, data.y},
                                 quiet(3).metrics({metrics::mae()}).callbacks(first));
  EXPECT_EQ(first[0]->name(), "model_checkpoint");
  EXPECT_EQ(first[1]->name(), "model_checkpoint_1");
  EXPECT_FALSE(testing::list_sorted(dir / "by_loss").empty());
  EXPECT_FALSE(testing::list_sorted(dir / "by_mae").empty());
  EXPECT_NE(first[0]->state_dict().get_double("best"), first[1]->state_dict().get_double("best"));
}

TEST(Learner, AutoResumeRefusesAStateFileOfAnotherModelAndChangesNothing) {
  auto data = testing::seed_data(64);
  TempDir dir;
  std::string state = dir / "state.ckpt";
  auto interrupt = std::make_shared<Interrupt>(1);
  EXPECT_THROW(
      testing::linear_learner()->fit(
          {data.x, data.y}, quiet(2).callbacks({interrupt, callbacks::auto_resume(state)})),
      CallbackError);
  // Epoch 1 was interrupted before auto_resume saved: no file yet. Save one at step 1.
  auto stop = std::make_shared<Interrupt>(1);
  EXPECT_THROW(testing::linear_learner()->fit(
                   {data.x, data.y},
                   quiet(2).callbacks({stop, callbacks::auto_resume(state).save_every_steps(1)})),
               CallbackError);
  ASSERT_TRUE(Env::posix().stat(state).exists);
  auto other = testing::dropout_learner();
  at::Tensor before = other->model().parameters()[0].clone();
  expect_error(
      [&] {
        other->fit({data.x, data.y}, quiet(2).callbacks({callbacks::auto_resume(state)}));
      },
      ErrorCode::Incompatible, {"model"});
  EXPECT_TRUE(testing::bitwise_equal(other->model().parameters()[0], before));
  EXPECT_TRUE(Env::posix().stat(state).exists) << "a refused state file is kept";
}

TEST(Learner, ProgressIsPlainLinesOffATerminalAndNothingWhenQuiet) {
  auto data = testing::seed_data(64);
  std::ostringstream out;
  testing::linear_learner()->fit(
      {data.x, data.y},
      FitOptions().epochs(2).output(&out).valid_data({data.x, data.y}).metrics({metrics::mae()}));
  std::string text = out.str();
  EXPECT_NE(text.find("Epoch 1/2 train_loss: "), std::string::npos) << text;
  EXPECT_NE(text.find("train_mae: "), std::string::npos) << text;
  EXPECT_NE(text.find("valid_loss: "), std::string::npos) << text;
  EXPECT_NE(text.find("Epoch 2/2"), std::string::npos) << text;
  EXPECT_EQ(std::count(text.begin(), text.end(), '\n'), 2) << text;
  EXPECT_EQ(text.find('\r'), std::string::npos) << "no redrawing off a terminal";

  std::ostringstream silent;
  testing::linear_learner()->fit({data.x, data.y}, quiet(2).output(&silent));
  EXPECT_TRUE(silent.str().empty());
}

// The bar takes the columns the terminal gives it and no more, with elapsed time, ETA and rate
// beside the count and loss; too narrow a terminal loses the bar, never its last column.
TEST(Learner, ProgressBarFitsTheTerminalAndShowsTimeAndRate) {
  auto t0 = detail::Progress::Clock::now();
  for (int width : {120, 80, 60, 40, 10}) {
    detail::Progress progress(nullptr, true, width, [&] { return t0; });
    std::string line = progress.bar_line("Epoch 3/10", 25, 100, 25, 5.0, 0.123456);
    EXPECT_LE(line.size(), static_cast<std::size_t>(width - 1)) << width << ": " << line;
    if (width >= 80) {
      // A quarter of the bar: 10 of 40 columns at 120, 5 of the 22 left at 80.
      EXPECT_NE(line.find(width == 120 ? " [==========>" : " [=====>"), std::string::npos) << line;
      EXPECT_NE(line.find("] 25/100 0:05<0:15 5.00 batch/s loss: 0.1235"), std::string::npos)
          << line;
    }
  }
  detail::Progress wide(nullptr, true, 200, [&] { return t0; });
  std::string full = wide.bar_line("Epoch 3/10", 100, 100, 100, 5.0, 0.5);
  EXPECT_NE(full.find("[" + std::string(40, '=') + "]"), std::string::npos) << full;
  // Slower than a batch a second: seconds per batch. Nothing timed yet: no rate, no ETA.
  EXPECT_NE(wide.bar_line("v", 2, 10, 2, 5.0, 0.5).find("0:05<0:20 2.50 s/batch"),
            std::string::npos);
  EXPECT_NE(wide.bar_line("v", 0, 10, 0, 0.0, 0.5).find("0/10 0:00<? ? batch/s"),
            std::string::npos);
  // A resumed epoch times only its own batches: 30 of 100 were done before, 10 in 2 s here.
  EXPECT_NE(wide.bar_line("e", 40, 100, 10, 2.0, 0.5).find("40/100 0:02<0:12 5.00 batch/s"),
            std::string::npos);

  // Drawn: a carriage return, the line, and erase-to-end-of-line, throttled to ten a second
  // except for the last batch of a pass.
  std::ostringstream out;
  auto now = t0;
  detail::Progress drawn(&out, true, 100, [&] { return now; });
  drawn.epoch_begin(1, 2, 4);
  now += std::chrono::milliseconds(500);
  drawn.batch(1, 0.25);
  drawn.batch(2, 0.25);  // same instant: skipped
  drawn.batch(4, 0.2);   // the last: drawn
  drawn.valid_begin(2);
  now += std::chrono::seconds(1);
  drawn.valid_batch(2, 0.3);
  drawn.epoch_end({{"train_loss", 0.2}, {"valid_loss", 0.3}});
  EXPECT_EQ(out.str(), "\r" + drawn.bar_line("Epoch 1/2", 1, 4, 1, 0.5, 0.25) + "\x1b[K" + "\r" +
                           drawn.bar_line("Epoch 1/2", 4, 4, 4, 0.5, 0.2) + "\x1b[K" + "\r" +
                           drawn.bar_line("Epoch 1/2 valid", 2, 2, 2, 1.0, 0.3) + "\x1b[K" +
                           "\r\x1b[KEpoch 1/2 train_loss: 0.2000 valid_loss: 0.3000 (1.5 s)\n");
}

// A real terminal (a pseudo-terminal of 72 and 120 columns): the program finds its width
// itself and draws training and validation bars that fit it.
TEST(Learner, ProgressBarOnAPseudoTerminal) {
  for (const char* columns : {"72", "120"}) {
    auto run = testing::run_python_script("progress_pty.py", {PROGRESS_CHILD, columns});
    EXPECT_EQ(run.status, 0) << run.output;
    EXPECT_NE(run.output.find(std::string(columns) + " columns: "), std::string::npos)
        << run.output;
  }
}

TEST(Learner, ResultTableAndPlots) {
  auto data = testing::seed_data(64);
  TempDir dir;
  FitResult result =
      testing::linear_learner()->fit({data.x, data.y}, quiet(3).valid_data({data.x, data.y}));
  std::string table = result.table();
  EXPECT_EQ(table.rfind("     epoch  train_loss  valid_loss\n", 0), 0u) << table;
  EXPECT_EQ(std::count(table.begin(), table.end(), '\n'), 4);
  EXPECT_NE(table.find(fmt::format("{:.6f}", result.records.values("valid", "loss")[2])),
            std::string::npos);

  // luz's plot(results) in the format the extension names. One panel (loss), two sets:
  // 800 x (64 + 300) px. tests/python/plot_check.py decodes the PNG itself: the size, the
  // title and tick labels drawn, a colour per set.
  result.plot(dir / "curves.png");
  std::string png = testing::read_bytes(dir / "curves.png");
  EXPECT_EQ(png.rfind("\x89PNG\r\n\x1a\n", 0), 0u);
  EXPECT_LT(png.size(), 200'000u) << "a compressed PNG";
  auto checked = testing::run_python_script("plot_check.py",
                                            {dir / "curves.png", "800", "364", "--colors", "2"});
  EXPECT_EQ(checked.status, 0) << checked.output;
  EXPECT_EQ(checked.output.rfind("ok: 800x364 RGB", 0), 0u) << checked.output;

  // The SVG parses as XML, and its metadata names the series (its text is glyph outlines).
  result.plot(dir / "curves.svg");
  EXPECT_NE(testing::read_bytes(dir / "curves.svg").find("data-set=\"valid\" data-metric=\"loss\""),
            std::string::npos);
  auto svg = testing::run_python_script("plot_check.py", {dir / "curves.svg"});
  EXPECT_EQ(svg.status, 0) << svg.output;
  EXPECT_EQ(svg.output,
            "svg 800x364 panels=1 columns=1 title='metrics by epoch'\n"
            "series set='train' metric='loss' values=3 points=3 runs=1\n"
            "series set='valid' metric='loss' values=3 points=3 runs=1\n");

  // The extension's case does not matter.
  result.plot(dir / "curves.PDF");
  std::string pdf = testing::read_bytes(dir / "curves.PDF");
  EXPECT_EQ(pdf.rfind("%PDF-", 0), 0u);
  pdf.erase(pdf.find_last_not_of(" \r\n") + 1);
  EXPECT_TRUE(pdf.ends_with("%%EOF"))
      << pdf.substr(pdf.size() - std::min<std::size_t>(pdf.size(), 40));

  expect_error([&] { result.plot(dir / "curves.jpg"); }, ErrorCode::InvalidArgument,
               {dir / "curves.jpg", ".png, .svg or .pdf"});
  EXPECT_FALSE(Env::posix().stat(dir / "curves.jpg").exists);
}

// Records of every awkward shape still draw labelled panels at the size records_plot.h states:
// 800 px wide (1000 with three columns), 64 + 300 px per row of panels.
TEST(RecordsPlot, AwkwardRecordsDrawLabelledPanels) {
  constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
  constexpr double kInf = std::numeric_limits<double>::infinity();
  struct Case {
    const char* name;
    std::vector<PlotSeries> series;
    const char* size;  // width, height
    const char* colors;
  };
  const std::vector<Case> cases = {
      {"one_epoch", {{"train", "loss", {0.7}}, {"valid", "loss", {0.8}}}, "800 364", "2"},
      {"all_nan",
       {{"train", "loss", {kNaN, kNaN, kInf}}, {"train", "acc", {0.5, 0.6}}},
       "800 364",
       "1"},
      {"equal_and_close",
       {{"train", "loss", {0.5, 0.5, 0.5}}, {"train", "acc", {0.9038, 0.90385, 0.9039}}},
       "800 364",
       "1"},
      {"magnitudes",
       {{"train", "huge", {1e12, 3e12}},
        {"valid", "tiny", {1e-9, 3e-9}},
        {"train", "negative", {-120.5, -80.2}},
        {"valid", "extreme", {-1.7e308, 1.7e308}}},
       "800 664",
       "2"},
      {"five_metrics",
       {{"train", "a", {1, 2}},
        {"valid", "b", {1, 2}},
        {"test", "c", {1, 2}},
        {"train", "d", {1, 2}},
        {"train", std::string(300, 'm'), {2, 1}}},
       "1000 664",
       "3"},
      {"nothing", {}, "800 364", "0"},
  };
  TempDir dir;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string path = dir / (std::string(c.name) + ".png");
    testing::write_bytes(path, render_records(c.series, c.name, PlotFormat::Png));
    std::istringstream size(c.size);
    std::string width, height;
    size >> width >> height;
    auto checked =
        testing::run_python_script("plot_check.py", {path, width, height, "--colors", c.colors});
    EXPECT_EQ(checked.status, 0) << checked.output;
    for (PlotFormat format : {PlotFormat::Svg, PlotFormat::Pdf}) {
      EXPECT_FALSE(render_records(c.series, c.name, format).empty());
    }
  }
}

// A map-style LibTorch dataset over the same tensors.
struct PairDataset : torch::data::datasets::Dataset<PairDataset> {
  PairDataset(torch::Tensor x_, torch::Tensor y_) : x(std::move(x_)), y(std::move(y_)) {}
  torch::Tensor x, y;
  torch::data::Example<> get(std::size_t i) override {
    return {x[static_cast<std::int64_t>(i)], y[static_cast<std::int64_t>(i)]};
  }
  torch::optional<std::size_t> size() const override { return static_cast<std::size_t>(x.size(0)); }
};

TEST(Learner, ADatasetAndTheSameTensorsTrainIdentically) {
  auto data = testing::seed_data(200);
  auto from_tensors = testing::linear_learner();
  FitResult a = from_tensors->fit({data.x, data.y}, quiet(2).seed(11));
  auto from_dataset = testing::linear_learner();
  FitResult b = from_dataset->fit(PairDataset(data.x, data.y), quiet(2).seed(11));
  expect_same_records(a.records, b.records);
  expect_same_weights(*from_tensors, *from_dataset);
  // Another seed gives another order, so the comparison above can fail.
  auto other = testing::linear_learner();
  FitResult c = other->fit({data.x, data.y}, quiet(2).seed(12));
  EXPECT_FALSE(
      same_bits(a.records.values("train", "loss")[1], c.records.values("train", "loss")[1]));
}

// Learner checkpoints of format version 1, committed: tests/data/golden_v1 holds one written
// under LibTorch 1.13, tests/data/golden_libtorch2 one written under LibTorch 2.13 (each
// rewritten with TORCHPOINT_WRITE_GOLDEN=1, by a build against that LibTorch, only when the
// format changes on purpose). Every later version, under either LibTorch, must restore both
// exactly — weights, optimizer state, counters, records, callback state — and train on.
// (Comparing with a fresh run instead would also compare this CPU's kernels, and this
// LibTorch's, with the ones that wrote the file.)
class GoldenLearner : public ::testing::TestWithParam<const char*> {};

TEST_P(GoldenLearner, CheckpointRestoresExactlyAndTrainsOn) {
  const char* src = std::getenv("TORCHPOINT_SOURCE_DIR");
  ASSERT_NE(src, nullptr) << "TORCHPOINT_SOURCE_DIR is set by CTest";
  const std::string folder = GetParam();
  const std::string golden = fmt::format("{}/tests/data/{}/learner_epoch2.ckpt", src, folder);
  const bool written_here = (folder == "golden_v1") == (TORCH_VERSION_MAJOR == 1);
  auto data = testing::seed_data(64);
  auto options = [] { return quiet(3).seed(3).metrics({metrics::mae()}); };
  if (std::getenv("TORCHPOINT_WRITE_GOLDEN") != nullptr && written_here) {
    struct SaveAt : Callback {
      explicit SaveAt(std::string p) : Callback("save_at"), path(std::move(p)) {}
      int order() const override { return 2000; }
      std::string path;
      void on_epoch_end(Context& ctx) override {
        if (ctx.epoch == 2) ctx.learner->save_checkpoint(path);
      }
    };
    testing::dropout_learner()->fit(
        {data.x, data.y},
        options().callbacks({callbacks::early_stopping().monitor("train_loss").patience(9),
                             std::make_shared<SaveAt>(golden)}));
  }
  StateDict file = read_state(golden);
  {
    TempDir scratch;
    testing::expect_safetensors_reads({golden}, scratch.path());
  }

  TempDir dir;
  testing::write_bytes(dir / "state.ckpt", testing::read_bytes(golden));
  AfterResume seen;
  auto probe = seen.probe(2000);
  StateDict stopping_state;
  CallbackPtr stopping = callbacks::early_stopping().monitor("train_loss").patience(9).build();
  probe->at_fit_begin = [&, inner = probe->at_fit_begin](Context& ctx) {
    inner(ctx);
    stopping_state = stopping->state_dict();
  };
  auto resumed = testing::dropout_learner(/*init_seed=*/8);
  FitResult got = resumed->fit(
      {data.x, data.y},
      options().callbacks({stopping, callbacks::auto_resume(dir / "state.ckpt"), probe}));
  EXPECT_TRUE(model_matches(seen.model, file));
  StateDict file_optimizer = file.child("optimizer");
  for (const std::string& key : file_optimizer.keys()) {
    if (file_optimizer.is_tensor(key)) {
      EXPECT_TRUE(testing::bitwise_equal(seen.optimizer.tensor(key), file_optimizer.tensor(key)))
          << key;
    }
  }
  EXPECT_EQ(seen.epochs_done, 2);
  EXPECT_TRUE(same_bits(stopping_state.get_double("best"),
                        file.get_double("callbacks.state.early_stopping.best")));
  MetricRecords file_records;
  file_records.load_state_dict(file.child("records"));
  expect_same_records(seen.records, file_records);
  EXPECT_EQ(got.resumed_after_epoch, std::optional<std::int64_t>(2));
  ASSERT_EQ(got.records.values("train", "loss").size(), 3u);
  ASSERT_EQ(got.records.values("train", "mae").size(), 3u);
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_TRUE(
        same_bits(got.records.values("train", "loss")[i], file_records.values("train", "loss")[i]));
  }
  EXPECT_TRUE(std::isfinite(got.records.values("train", "loss")[2]));
}

INSTANTIATE_TEST_SUITE_P(WrittenByEachLibTorch, GoldenLearner,
                         ::testing::Values("golden_v1", "golden_libtorch2"));

// In a directory search, only a checkpoint proven corrupt is passed over (the test above). One
// that cannot be read or judged (a FIFO, a newer learner version) stops the search with
// an error naming it: resuming from the one before would quietly lose its epochs.
TEST(Learner, ResumeFromDirectoryStopsAtANewestCheckpointItCannotJudge) {
  auto data = testing::seed_data();
  TempDir dir;
  const std::string ckpts = dir / "numbered";
  testing::linear_learner()->fit(
      {data.x, data.y},
      quiet(3).callbacks(
          {callbacks::model_checkpoint(ckpts + "/epoch-{epoch}.ckpt").monitor("train_loss")}));
  const std::string newest = ckpts + "/epoch-3.ckpt";
  const std::string kept = testing::read_bytes(newest);
  StateDict future;
  future.set("learner.format", "torchpoint.learner");
  future.set("learner.version", 2);
  auto resume = [&] {
    testing::linear_learner(5)->fit({data.x, data.y},
                                    quiet(1).callbacks({callbacks::resume_from_checkpoint(ckpts)}));
  };
  for (const char* kind : {"fifo", "newer"}) {
    SCOPED_TRACE(kind);
    ASSERT_EQ(::unlink(newest.c_str()), 0);
    if (std::string(kind) == "fifo") {
      ASSERT_EQ(::mkfifo(newest.c_str(), 0644), 0);
      expect_error(resume, ErrorCode::InvalidArgument, {newest, "FIFO"});
    } else {
      save_file(newest, future.to_container());
      expect_error(resume, ErrorCode::Incompatible, {newest, "upgrade"});
    }
    ASSERT_EQ(::unlink(newest.c_str()), 0);
    testing::write_bytes(newest, kept);
  }
  resume();  // control: with the file restored, the same search resumes
}

// A loss module is a loss, as in luz (nn_cross_entropy_loss()), and accuracy() scores
// multiclass predictions; evaluate() agrees with the accuracy computed by hand.
TEST(Learner, LossModulesAndMulticlassAccuracy) {
  torch::manual_seed(3);
  auto x = torch::randn({60, 4});
  auto y = x.narrow(1, 0, 3).argmax(1);  // three classes, learnable from the inputs
  torch::nn::Linear net(4, 3);
  auto learner = std::make_shared<Learner>(
      net, make_optimizer<torch::optim::Adam>(torch::optim::AdamOptions(0.05)),
      torch::nn::CrossEntropyLoss());
  FitResult result = learner->fit({x, y}, quiet(5).batch_size(10).metrics({metrics::accuracy()}));
  ASSERT_EQ(result.records.values("train", "accuracy").size(), 5u);
  std::map<std::string, double> scores = learner->evaluate({x, y}, 60, {metrics::accuracy()});
  double by_hand = learner->predict(x).argmax(1).eq(y).to(at::kDouble).mean().item<double>();
  EXPECT_EQ(scores.at("valid_accuracy"), by_hand);
  EXPECT_GT(by_hand, 0.5) << "it learned something";
}

// luz's csv_logger: a row per epoch and set whose values read back to the records exactly; an
// interrupted fit resumed by auto_resume leaves the same file as an uninterrupted one (the row
// of the epoch it repeats is not written twice).
// luz's tfevents callback, judged by TensorBoard itself: its record reader checks every CRC,
// its EventAccumulator shows each epoch once with the recorded value (as float32), also after
// an interrupted fit and its auto_resume wrote one file each.
TEST(Learner, TfeventsScalarsReadByTensorBoard) {
  auto data = testing::seed_data();
  auto valid = testing::seed_data(50);
  TempDir dir;
  auto options = [&](std::vector<CallbackPtr> extra) {
    std::vector<CallbackPtr> cbs = {callbacks::tfevents(dir / "logs")};
    for (auto& c : extra) cbs.push_back(c);
    return quiet(6).metrics({metrics::mae()}).valid_data({valid.x, valid.y}).callbacks(cbs);
  };
  const std::string state = dir / "state.ckpt";
  torch::manual_seed(42);
  try {
    testing::linear_learner()->fit(
        {data.x, data.y}, options({std::make_shared<Interrupt>(4), callbacks::auto_resume(state)}));
    FAIL() << "the interrupt callback must stop the first fit";
  } catch (const CallbackError&) {
  }
  FitResult result =
      testing::linear_learner(99)->fit({data.x, data.y}, options({callbacks::auto_resume(state)}));
  ASSERT_EQ(result.resumed_after_epoch, std::optional<std::int64_t>(3));

  auto run = testing::run_python_script("tfevents_check.py", {dir / "logs"});
  ASSERT_EQ(run.status, 0) << run.output;
  // The resumed fit's file began with a SessionLog START at step 4: TensorBoard dropped the
  // interrupted fit's epoch 4 (four scalars) and says so on stderr, before the JSON line.
  EXPECT_NE(run.output.find("Removing 4 scalars"), std::string::npos) << run.output;
  const std::string json_line =
      run.output.substr(run.output.rfind('\n', run.output.size() - 2) + 1);
  ASSERT_TRUE(nlohmann::json::accept(json_line)) << run.output;
  auto seen = nlohmann::json::parse(json_line);
  EXPECT_EQ(seen["files"], 2) << "one event file per fit";
  ASSERT_EQ(seen["scalars"].size(), 4u) << run.output;
  for (const char* set : {"train", "valid"}) {
    for (const char* metric : {"loss", "mae"}) {
      const auto& points = seen["scalars"][std::string(set) + "/" + metric];
      const std::vector<double> values = result.records.values(set, metric);
      ASSERT_EQ(points.size(), 6u) << set << "/" << metric << ": " << points;
      for (std::size_t i = 0; i < 6; ++i) {
        EXPECT_EQ(points[i][0].get<std::int64_t>(), static_cast<std::int64_t>(i + 1));
        EXPECT_EQ(points[i][1].get<double>(), static_cast<double>(static_cast<float>(values[i])))
            << set << "/" << metric << " epoch " << i + 1;
      }
    }
  }

  // A torn record is data loss to TensorBoard's reader: the framing is TFRecord's, CRCs
  // included.
  std::string file;
  for (const std::string& name : testing::list_sorted(dir / "logs")) file = dir / "logs/" + name;
  testing::flip_bit(file, testing::file_size(file) - 20, 3);
  auto torn = testing::run_python_script("tfevents_check.py", {dir / "logs"});
  EXPECT_NE(torn.status, 0);
  EXPECT_NE(torn.output.find("DataLossError"), std::string::npos) << torn.output;

  expect_error([] { callbacks::tfevents("").build(); }, ErrorCode::InvalidArgument,
               {"log directory"});
}

TEST(Learner, CsvLoggerRowsMatchTheRecordsAndSurviveAResume) {
  auto data = testing::seed_data();
  auto valid = testing::seed_data(50);
  TempDir dir;
  auto options = [&](const std::string& csv, std::vector<CallbackPtr> extra) {
    std::vector<CallbackPtr> cbs = {callbacks::csv_logger(csv)};
    for (auto& c : extra) cbs.push_back(c);
    return quiet(6).metrics({metrics::mae()}).valid_data({valid.x, valid.y}).callbacks(cbs);
  };
  torch::manual_seed(42);
  FitResult whole =
      testing::linear_learner()->fit({data.x, data.y}, options(dir / "whole.csv", {}));
  std::vector<std::string> lines;
  {
    std::ifstream in(dir / "whole.csv");
    for (std::string line; std::getline(in, line);) lines.push_back(line);
  }
  ASSERT_EQ(lines.size(), 13u);
  EXPECT_EQ(lines[0], "epoch,set,loss,mae");
  for (std::size_t epoch = 1; epoch <= 6; ++epoch) {
    for (const char* set : {"train", "valid"}) {
      const std::string& line = lines[2 * epoch - (set == std::string("train") ? 1 : 0)];
      std::vector<std::string> cells;
      std::stringstream ss(line);
      for (std::string cell; std::getline(ss, cell, ',');) cells.push_back(cell);
      ASSERT_EQ(cells.size(), 4u) << line;
      EXPECT_EQ(cells[0], std::to_string(epoch));
      EXPECT_EQ(cells[1], set);
      EXPECT_EQ(std::stod(cells[2]), whole.records.values(set, "loss")[epoch - 1]) << line;
      EXPECT_EQ(std::stod(cells[3]), whole.records.values(set, "mae")[epoch - 1]) << line;
    }
  }

  const std::string state = dir / "state.ckpt";
  torch::manual_seed(42);
  try {
    testing::linear_learner()->fit(
        {data.x, data.y}, options(dir / "resumed.csv",
                                  {std::make_shared<Interrupt>(4), callbacks::auto_resume(state)}));
    FAIL() << "the interrupt callback must stop the first fit";
  } catch (const CallbackError&) {
  }
  // The interrupted fit wrote epoch 4's rows, which its checkpoint (epoch 3) does not hold.
  EXPECT_EQ(testing::read_bytes(dir / "resumed.csv").find("\n5,"), std::string::npos);
  EXPECT_NE(testing::read_bytes(dir / "resumed.csv").find("\n4,train"), std::string::npos);
  testing::linear_learner(99)->fit({data.x, data.y},
                                   options(dir / "resumed.csv", {callbacks::auto_resume(state)}));
  EXPECT_EQ(testing::read_bytes(dir / "resumed.csv"), testing::read_bytes(dir / "whole.csv"));
}

TEST(Learner, ALearnerCheckpointOfANewerVersionIsRefusedNamingBoth) {
  TempDir dir;
  StateDict state;
  state.set("learner.format", "torchpoint.learner");
  state.set("learner.version", 2);
  save_file(dir / "future.ckpt", state.to_container());
  auto learner = testing::linear_learner();
  expect_error([&] { load_checkpoint(*learner, dir / "future.ckpt"); }, ErrorCode::Incompatible,
               {"version 2", "newer than this torchpoint reads (1)", "upgrade"});
}

// ---- Several optimizers (luz's set_optimizers) ----

// luz's custom-loop example: two layers, each with its own optimizer and learning rate, the
// first one's loss with an L1 penalty on its weights. fit() must step exactly as the loop a user
// would write: per batch and per optimizer in order, zero its gradients, forward, its loss,
// backward, its step.
TEST(LearnerOptimizers, TwoParameterSetsWithTwoLearningRatesStepAsAHandWrittenLoop) {
  auto data = testing::seed_data(256);
  auto valid = testing::seed_data(64);
  auto make = [] {
    torch::manual_seed(4);
    return torch::nn::Sequential(torch::nn::Linear(10, 8), torch::nn::ReLU(),
                                 torch::nn::Linear(8, 1));
  };
  auto set_optimizers = [](torch::nn::Sequential& m) {
    return NamedOptimizers{
        {"opt_fc1", std::make_shared<torch::optim::SGD>(m->ptr(0)->parameters(),
                                                        torch::optim::SGDOptions(0.1))},
        {"opt_fc2", std::make_shared<torch::optim::Adam>(m->ptr(2)->parameters(),
                                                         torch::optim::AdamOptions(0.01))}};
  };
  auto loss = [](const torch::nn::Module& model, const std::string& opt_name,
                 const at::Tensor& pred, const at::Tensor& target) {
    at::Tensor mse = torch::mse_loss(pred, target);
    if (opt_name != "opt_fc1") return mse;
    return mse + 0.01 * model.named_parameters()["0.weight"].abs().sum();
  };

  auto model = make();
  Learner learner(model, set_optimizers,
                  [&](const Context& ctx, const at::Tensor& pred, const at::Tensor& target) {
                    return loss(*ctx.model, ctx.opt_name, pred, target);
                  });
  ASSERT_EQ(learner.optimizers().names(), (std::vector<std::string>{"opt_fc1", "opt_fc2"}));
  struct Seen : Callback {
    Seen() : Callback("seen") {}
    std::vector<std::string> passes;  // opt_name at each before_step of the first batch
    std::vector<std::int64_t> steps;  // ctx.step at every batch end
    std::vector<std::string> loss_names;
    void on_train_batch_before_step(Context& ctx) override {
      if (ctx.step == 0) passes.push_back(ctx.opt_name);
      EXPECT_EQ(ctx.optimizer, &(*ctx.optimizers)[ctx.opt_name]);
    }
    void on_train_batch_end(Context& ctx) override {
      steps.push_back(ctx.step);
      loss_names.clear();
      for (const auto& [name, value] : ctx.losses) loss_names.push_back(name);
    }
  };
  auto seen = std::make_shared<Seen>();
  FitResult result = learner.fit(
      {data.x, data.y}, quiet(2).shuffle(false).valid_data({valid.x, valid.y}).callbacks({seen}));
  EXPECT_EQ(seen->passes, (std::vector<std::string>{"opt_fc1", "opt_fc2"}));
  EXPECT_EQ(seen->steps.size(), 16u);
  EXPECT_EQ(seen->steps.back(), 16) << "one step per batch, whatever the number of optimizers";
  EXPECT_EQ(seen->loss_names, (std::vector<std::string>{"opt_fc1", "opt_fc2"}));

  // The same training written by hand.
  auto hand = make();
  NamedOptimizers optimizers = set_optimizers(hand);
  std::vector<double> sum_fc1(2), sum_fc2(2);
  for (int epoch = 0; epoch < 2; ++epoch) {
    for (std::int64_t b = 0; b < 8; ++b) {
      at::Tensor x = data.x.slice(0, b * 32, b * 32 + 32);
      at::Tensor y = data.y.slice(0, b * 32, b * 32 + 32);
      for (const auto& [name, optimizer] : optimizers) {
        optimizer->zero_grad();
        at::Tensor l = loss(*hand, name, hand->forward(x), y);
        l.backward();
        optimizer->step();
        (name == "opt_fc1" ? sum_fc1 : sum_fc2)[epoch] += l.item<double>() * 32;
      }
    }
  }
  auto theirs = hand->named_parameters();
  for (const auto& item : learner.model().named_parameters()) {
    EXPECT_TRUE(testing::bitwise_equal(item.value(), theirs[item.key()])) << item.key();
  }
  for (std::string name : {"opt_fc1", "opt_fc2"}) {
    StateDict got = optimizer_state_dict(learner.optimizer(name));
    StateDict want = optimizer_state_dict(optimizers[name]);
    ASSERT_EQ(got.keys(), want.keys()) << name;
    for (const std::string& key : want.keys()) {
      if (want.is_tensor(key)) {
        EXPECT_TRUE(testing::bitwise_equal(got.tensor(key), want.tensor(key))) << name << key;
      }
    }
  }
  // Each optimizer's loss is recorded under its name, and the loss is their sum.
  const auto& fc1 = result.records.values("train", "loss_opt_fc1");
  const auto& fc2 = result.records.values("train", "loss_opt_fc2");
  const auto& total = result.records.values("train", "loss");
  ASSERT_EQ(fc1.size(), 2u);
  ASSERT_EQ(total.size(), 2u);
  for (int epoch = 0; epoch < 2; ++epoch) {
    EXPECT_TRUE(same_bits(fc1[epoch], sum_fc1[epoch] / 256)) << epoch;
    EXPECT_TRUE(same_bits(fc2[epoch], sum_fc2[epoch] / 256)) << epoch;
    EXPECT_NEAR(total[epoch], fc1[epoch] + fc2[epoch], 1e-12);
  }
  EXPECT_EQ(result.records.values("valid", "loss_opt_fc2").size(), 2u);
  EXPECT_GT(result.records.values("valid", "loss_opt_fc1")[1],
            result.records.values("valid", "loss_opt_fc2")[1])
      << "the first optimizer's loss has the L1 penalty";
  auto evaluated = learner.evaluate({valid.x, valid.y});
  EXPECT_TRUE(evaluated.count("valid_loss_opt_fc1") && evaluated.count("valid_loss_opt_fc2"));

  expect_error([&] { learner.optimizer(); }, ErrorCode::InvalidArgument,
               {"2 optimizers", "opt_fc1, opt_fc2", "optimizer(name)"});
  expect_error([&] { learner.optimizer("opt"); }, ErrorCode::InvalidArgument,
               {"no optimizer named 'opt'", "opt_fc1, opt_fc2"});
  Metric clash("loss_opt_fc1", [](const at::Tensor& p, const at::Tensor&) { return p; });
  expect_error([&] { learner.fit({data.x, data.y}, quiet(1).metrics({clash})); },
               ErrorCode::InvalidArgument,
               {"two metrics are named 'loss_opt_fc1'", "loss_<name>"});
}

TEST(LearnerOptimizers, NamedOptimizersRefuseBadNames) {
  auto model = torch::nn::Linear(10, 1);
  auto sgd = [&] {
    return std::make_shared<torch::optim::SGD>(model->parameters(), torch::optim::SGDOptions(1));
  };
  expect_error([&] { NamedOptimizers{{"g", sgd()}, {"g", sgd()}}; }, ErrorCode::InvalidArgument,
               {"two optimizers are named 'g'"});
  expect_error([&] { NamedOptimizers().add("a.b", sgd()); }, ErrorCode::InvalidArgument,
               {"'a.b'", "letters, digits and '_'"});
  expect_error([&] { NamedOptimizers().add("g", nullptr); }, ErrorCode::InvalidArgument,
               {"optimizer 'g' is null"});
  expect_error([&] { Learner learner(model, NamedOptimizers(), torch::mse_loss); },
               ErrorCode::InvalidArgument, {"needs a model, an optimizer and a loss"});
}

// With a model_factory, every fit makes a new model and, from it, new optimizers (luz's
// set_optimizers is a method of the model): each one holds the new model's parameters.
TEST(LearnerOptimizers, AModelFactoryMakesNewOptimizersForEveryFit) {
  auto data = testing::seed_data(64);
  Learner learner(
      model_factory([] {
        return torch::nn::Sequential(torch::nn::Linear(10, 8), torch::nn::Linear(8, 1));
      }),
      [](torch::nn::Sequential& m) {
        return NamedOptimizers{
            {"first", std::make_shared<torch::optim::SGD>(m->ptr(0)->parameters(),
                                                          torch::optim::SGDOptions(0.1))},
            {"second", std::make_shared<torch::optim::SGD>(m->ptr(1)->parameters(),
                                                           torch::optim::SGDOptions(0.01))}};
      },
      torch::mse_loss);
  FitResult first = learner.fit({data.x, data.y}, quiet(1));
  FitResult second = learner.fit({data.x, data.y}, quiet(1));
  ASSERT_NE(first.model, second.model);
  std::vector<at::Tensor> params = second.model->parameters();
  EXPECT_TRUE(learner.optimizer("first").param_groups()[0].params()[0].is_same(params[0]));
  EXPECT_TRUE(learner.optimizer("second").param_groups()[0].params()[0].is_same(params[2]));
  EXPECT_EQ(second.records.values("train", "loss_second").size(), 1u);
}

// Both optimizers' states, by name, as a map from "<name>/<key>" to tensors.
std::map<std::string, at::Tensor> optimizer_tensors(Learner& learner) {
  std::map<std::string, at::Tensor> out;
  for (const auto& [name, optimizer] : learner.optimizers()) {
    StateDict s = optimizer_state_dict(*optimizer);
    for (const std::string& key : s.keys()) {
      if (s.is_tensor(key)) out[name + "/" + key] = s.tensor(key).clone();
    }
  }
  return out;
}

void expect_same_tensors(const std::map<std::string, at::Tensor>& got,
                         const std::map<std::string, at::Tensor>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [key, t] : want) {
    ASSERT_TRUE(got.count(key)) << key;
    EXPECT_TRUE(testing::bitwise_equal(got.at(key), t)) << key;
  }
}

// The GAN's optimizers in a file: each under its name, as "<name>/<key>".
std::map<std::string, at::Tensor> file_optimizer_tensors(const StateDict& file) {
  std::map<std::string, at::Tensor> out;
  for (const Json& name : file.value("learner.optimizers")) {
    StateDict s = file.child("optimizer." + name.get<std::string>());
    for (const std::string& key : s.keys()) {
      if (s.is_tensor(key)) out[name.get<std::string>() + "/" + key] = s.tensor(key);
    }
  }
  return out;
}

// A GAN (Adam for the generator with an LR scheduler attached to it, SGD for the discriminator)
// interrupted mid-epoch and resumed by auto_resume ends as the uninterrupted fit: weights, both
// optimizers' states, the scheduler, records.
TEST(LearnerOptimizers, GanResumedByAutoResumeEndsAsTheUninterruptedFit) {
  auto data = testing::seed_data(320);
  TempDir dir;
  auto options = [&](std::vector<CallbackPtr> extra) {
    std::vector<CallbackPtr> cbs = {
        callbacks::lr_scheduler([](torch::optim::Optimizer& opt) {
          return std::make_unique<StepLR>(opt, StepLROptions(1).gamma(0.5));
        }).opt_name("generator"),
        callbacks::auto_resume(dir / "state.ckpt").save_every_steps(4)};
    cbs.insert(cbs.end(), extra.begin(), extra.end());
    torch::manual_seed(5);
    return quiet(3).callbacks(cbs);
  };
  auto whole = testing::gan_learner();
  FitResult want = whole->fit({data.x, data.y}, options({}));
  EXPECT_DOUBLE_EQ(whole->optimizer("generator").param_groups()[0].options().get_lr(),
                   1e-3 * 0.125);
  EXPECT_DOUBLE_EQ(whole->optimizer("discriminator").param_groups()[0].options().get_lr(), 0.05);

  struct FailAt : Callback {
    FailAt() : Callback("fail_at") {}
    void on_train_batch_end(Context& ctx) override {
      if (ctx.step == 15) throw std::runtime_error("killed at step 15");
    }
  };
  auto first = testing::gan_learner();
  EXPECT_THROW(first->fit({data.x, data.y}, options({std::make_shared<FailAt>()})),
               CallbackError);
  auto resumed = testing::gan_learner(/*init_seed=*/9);
  FitResult got = resumed->fit({data.x, data.y}, options({}));
  EXPECT_EQ(got.resumed_after_epoch, std::optional<std::int64_t>(1));
  expect_same_weights(*resumed, *whole);
  expect_same_tensors(optimizer_tensors(*resumed), optimizer_tensors(*whole));
  EXPECT_DOUBLE_EQ(resumed->optimizer("generator").param_groups()[0].options().get_lr(),
                   1e-3 * 0.125);
  expect_same_records(got.records, want.records);
  ASSERT_EQ(got.records.values("train", "loss_generator").size(), 3u);
  ASSERT_EQ(got.records.values("train", "loss_discriminator").size(), 3u);
}

// luz's fully flexible step: a custom_step doing what fit()'s default passes do trains the GAN
// to the same bits, with the records and evaluate() taken from the ctx.losses it sets; killed
// mid-epoch and resumed by auto_resume, it ends as the uninterrupted fit.
TEST(LearnerOptimizers, ACustomStepTrainsAsTheDefaultPassesAndResumes) {
  auto data = testing::seed_data(192);
  auto valid = testing::seed_data(64);
  auto step_learner = [](std::uint64_t init_seed) {
    torch::manual_seed(init_seed);
    testing::TinyGan gan;
    Learner::ContextLoss loss = testing::gan_loss(gan);
    return std::make_unique<Learner>(
        gan, testing::gan_optimizers, custom_step([gan, loss](Context& ctx) mutable {
          for (const auto& [name, optimizer] : *ctx.optimizers) {
            ctx.opt_name = name;  // what gan_loss reads
            if (ctx.set == "train") optimizer->zero_grad();
            ctx.pred = gan->forward(ctx.input);
            at::Tensor l = loss(ctx, ctx.pred, ctx.target);
            if (ctx.set == "train") {
              l.backward();
              optimizer->step();
            }
            ctx.losses[name] = l.detach();
          }
        }));
  };
  TempDir dir;
  auto options = [&](std::vector<CallbackPtr> callbacks) {
    torch::manual_seed(5);
    return quiet(2).valid_data({valid.x, valid.y}).callbacks(callbacks);
  };
  auto passes = testing::gan_learner();
  FitResult want = passes->fit({data.x, data.y}, options({}));
  auto stepped = step_learner(1);
  FitResult got = stepped->fit({data.x, data.y}, options({}));
  expect_same_weights(*stepped, *passes);
  expect_same_tensors(optimizer_tensors(*stepped), optimizer_tensors(*passes));
  expect_same_records(got.records, want.records);
  ASSERT_EQ(got.records.values("valid", "loss_discriminator").size(), 2u);
  torch::manual_seed(6);
  auto evaluated = stepped->evaluate({valid.x, valid.y});
  torch::manual_seed(6);
  auto reference = passes->evaluate({valid.x, valid.y});
  ASSERT_EQ(evaluated.size(), 3u);
  for (const auto& [name, value] : reference) {
    EXPECT_TRUE(same_bits(evaluated[name], value)) << name;
  }

  struct FailAt : Callback {
    FailAt() : Callback("fail_at") {}
    void on_train_batch_end(Context& ctx) override {
      if (ctx.step == 9) throw std::runtime_error("killed at step 9");
    }
  };
  const std::string state = dir / "state.ckpt";
  EXPECT_THROW(step_learner(1)->fit({data.x, data.y},
                                    options({callbacks::auto_resume(state).save_every_steps(4),
                                             std::make_shared<FailAt>()})),
               CallbackError);
  auto resumed = step_learner(9);
  FitResult again = resumed->fit(
      {data.x, data.y}, options({callbacks::auto_resume(state).save_every_steps(4)}));
  EXPECT_EQ(again.resumed_after_epoch, std::optional<std::int64_t>(1));
  expect_same_weights(*resumed, *passes);
  expect_same_tensors(optimizer_tensors(*resumed), optimizer_tensors(*passes));
  expect_same_records(again.records, want.records);

  // A step that sets no loss of an optimizer is told which.
  Learner forgetful(testing::TinyGan(), testing::gan_optimizers,
                    custom_step([](Context& ctx) { ctx.losses["generator"] = torch::ones({}); }));
  expect_error([&] { forgetful.fit({data.x, data.y}, quiet(1)); }, ErrorCode::InvalidArgument,
               {"no loss of optimizer 'discriminator'", "ctx.losses[name]"});
}

// model_checkpoint writes every optimizer by name; resume_from_checkpoint with
// restore_optimizer_state and restore_checkpoint bring both back; load_checkpoint (luz's) the
// model only.
TEST(LearnerOptimizers, CheckpointsHoldAndRestoreEveryOptimizerByName) {
  auto data = testing::seed_data(128);
  TempDir dir;
  const std::string ckpts = dir / "ckpts";
  testing::gan_learner()->fit(
      {data.x, data.y},
      quiet(2).callbacks({callbacks::model_checkpoint(ckpts + "/").monitor("train_loss")}));
  const std::string last = ckpts + "/" + testing::list_sorted(ckpts).back();
  StateDict file = read_state(last);
  EXPECT_EQ(file.value("learner.optimizers"), Json({"generator", "discriminator"}));
  auto saved = file_optimizer_tensors(file);
  ASSERT_TRUE(saved.count("generator/state.0.0.exp_avg"));
  ASSERT_TRUE(saved.count("discriminator/state.0.0.momentum_buffer"));

  // resume_from_checkpoint, from the directory's newest.
  struct Capture : Callback {
    Capture() : Callback("capture") {}
    int order() const override { return 950; }  // right after resume_from_checkpoint
    std::map<std::string, at::Tensor> optimizers;
    StateDict model;
    void on_fit_begin(Context& ctx) override {
      optimizers = optimizer_tensors(*ctx.learner);
      model = module_state_dict(*ctx.model).clone();
    }
  };
  auto capture = std::make_shared<Capture>();
  testing::gan_learner(77)->fit(
      {data.x, data.y},
      quiet(1).callbacks(
          {callbacks::resume_from_checkpoint(ckpts).restore_optimizer_state(true), capture}));
  expect_same_tensors(capture->optimizers, saved);
  EXPECT_TRUE(model_matches(capture->model, file));

  // restore_checkpoint outside a fit.
  auto outside = testing::gan_learner(78);
  outside->restore_checkpoint(
      last, RestoreOptions().records(false).callbacks(false).position(false));
  expect_same_tensors(optimizer_tensors(*outside), saved);
  EXPECT_TRUE(model_matches(module_state_dict(outside->model()), file));

  // load_checkpoint: the model's weights, the optimizers as they were.
  auto loaded = testing::gan_learner(79);
  auto before = optimizer_tensors(*loaded);
  load_checkpoint(*loaded, last);
  EXPECT_TRUE(model_matches(module_state_dict(loaded->model()), file));
  expect_same_tensors(optimizer_tensors(*loaded), before);
}

// Restoring optimizer state needs the same optimizers by name: anything else is refused, naming
// both sets, before anything changes. A scheduler must be attached to the same optimizer.
TEST(LearnerOptimizers, RestoringOtherOptimizerNamesIsRefusedNamingBothSets) {
  auto data = testing::seed_data(64);
  TempDir dir;
  auto gan = testing::gan_learner();
  gan->save_checkpoint(dir / "gan.ckpt");
  auto single_gan = [] {
    torch::manual_seed(3);
    testing::TinyGan model;
    return std::make_unique<Learner>(
        model, std::make_shared<torch::optim::Adam>(model->parameters()),
        testing::gan_loss(model));
  };
  auto one = single_gan();
  one->save_checkpoint(dir / "one.ckpt");
  EXPECT_EQ(read_state(dir / "one.ckpt").value("learner.optimizers"), Json({"opt"}));
  const auto restore_all = RestoreOptions().callbacks(false).position(false);

  StateDict weights = module_state_dict(one->model()).clone();
  Error e = expect_error([&] { one->restore_checkpoint(dir / "gan.ckpt", restore_all); },
                         ErrorCode::Incompatible,
                         {"gan.ckpt", "{generator, discriminator}", "this Learner has {opt}",
                          "NamedOptimizers", "without the optimizer state"});
  EXPECT_TRUE(model_matches(module_state_dict(one->model()), read_state(dir / "one.ckpt")))
      << "nothing changed: " << e.what();
  // Through resume_from_checkpoint as well; without the optimizer state it loads.
  expect_error(
      [&] {
        single_gan()->fit({data.x, data.y},
                          quiet(1).callbacks({callbacks::resume_from_checkpoint(dir / "gan.ckpt")
                                                  .restore_optimizer_state(true)}));
      },
      ErrorCode::Incompatible, {"{generator, discriminator}", "{opt}"});
  single_gan()->fit({data.x, data.y},
                    quiet(1).callbacks({callbacks::resume_from_checkpoint(dir / "gan.ckpt")}));

  expect_error([&] { gan->restore_checkpoint(dir / "one.ckpt", restore_all); },
               ErrorCode::Incompatible, {"{opt}", "this Learner has {generator, discriminator}"});
  // A file written before optimizers had names holds one: a two-optimizer Learner refuses it.
  StateDict legacy = read_state(dir / "one.ckpt");
  legacy.erase("learner.optimizers");
  save_file(dir / "legacy.ckpt", legacy.to_container());
  expect_error([&] { gan->restore_checkpoint(dir / "legacy.ckpt", restore_all); },
               ErrorCode::Incompatible,
               {"legacy.ckpt", "one optimizer, saved without a name", "2 optimizers",
                "{generator, discriminator}"});
  single_gan()->restore_checkpoint(dir / "legacy.ckpt", restore_all);

  // The scheduler: which optimizer, said and checked.
  auto scheduler = [](std::string opt_name) {
    return callbacks::lr_scheduler([](torch::optim::Optimizer& opt) {
             return std::make_unique<StepLR>(opt, StepLROptions(1));
           })
        .opt_name(std::move(opt_name));
  };
  auto fit_with = [&](CallbackPtr callback) {
    testing::gan_learner()->fit({data.x, data.y}, quiet(1).callbacks({callback}));
  };
  expect_error([&] { fit_with(scheduler("")); },
               ErrorCode::InvalidArgument,
               {"lr_scheduler", "2 optimizers (generator, discriminator)", ".opt_name(name)"});
  expect_error([&] { fit_with(scheduler("critic")); },
               ErrorCode::InvalidArgument, {"opt_name 'critic'", "generator, discriminator"});
  const std::string state = dir / "state.ckpt";
  struct Fail : Callback {
    Fail() : Callback("fail") {}
    int order() const override { return 2000; }  // after auto_resume saved the epoch
    void on_epoch_end(Context&) override { throw std::runtime_error("stop"); }
  };
  EXPECT_THROW(testing::gan_learner()->fit(
                   {data.x, data.y}, quiet(2).callbacks({scheduler("generator"),
                                                         callbacks::auto_resume(state),
                                                         std::make_shared<Fail>()})),
               CallbackError);
  expect_error(
      [&] {
        testing::gan_learner()->fit(
            {data.x, data.y},
            quiet(2).callbacks({scheduler("discriminator"), callbacks::auto_resume(state)}));
      },
      ErrorCode::Incompatible,
      {"attached to optimizer 'generator'", "attached to 'discriminator'",
       ".opt_name(\"generator\")"});
}

TEST(Learner, FitDataChecksItsTensors) {
  expect_error(
      [] {
        FitData(torch::zeros({3, 2}), torch::zeros({4, 1}));
      },
      ErrorCode::InvalidArgument, {"x has 3 samples but y has 4"});
  auto learner = testing::linear_learner();
  expect_error(
      [&] {
        learner->fit({torch::zeros({4, 10}), torch::zeros({4, 1})}, quiet().batch_size(0));
      },
      ErrorCode::InvalidArgument, {"batch_size"});
}

}  // namespace
}  // namespace torchpoint
