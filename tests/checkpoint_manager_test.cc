// CheckpointManager in a loop of the user's own: save with step and metrics, retention after
// each commit, the newest valid checkpoint, and an exact restore; what `torchpoint ls` and
// `prune` read is the same listing.
#include "torchpoint/checkpoint_manager.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "testing/fault_env.h"
#include "testing/test_util.h"
#include "torchpoint/module_state.h"
#include "torchpoint/optimizer_state.h"

namespace torchpoint {
namespace {

using testing::expect_error;
using testing::TempDir;

// A model and its optimizer, trained on fixed data.
struct Job {
  explicit Job(std::uint64_t init_seed) {
    torch::manual_seed(init_seed);
    model = torch::nn::Linear(10, 1);
    optimizer =
        std::make_shared<torch::optim::Adam>(model->parameters(), torch::optim::AdamOptions(1e-2));
    state.add("model", ModuleState(model.ptr()));
    state.add("optimizer", OptimizerState(optimizer));
  }
  void train(int steps) {
    torch::manual_seed(5);
    auto x = torch::randn({32, 10}), y = torch::randn({32, 1});
    for (int i = 0; i < steps; ++i) {
      optimizer->zero_grad();
      torch::mse_loss(model->forward(x), y).backward();
      optimizer->step();
    }
  }
  torch::nn::Linear model{nullptr};
  std::shared_ptr<torch::optim::Adam> optimizer;
  StatefulSet state;
};

std::vector<std::string> names(const CheckpointListing& listing) {
  std::vector<std::string> out;
  for (const ListedCheckpoint& e : listing.entries) out.push_back(e.name);
  return out;
}

TEST(CheckpointManager, SavesListsKeepsTheBestAndLastAndRestoresExactly) {
  TempDir dir;
  const std::string ckpts = dir / "run/checkpoints";
  CheckpointManager manager(ckpts, CheckpointManagerOptions().retention(
                                       RetentionPolicy().keep_last(2).best_metric("val_loss")));
  EXPECT_FALSE(manager.try_latest().has_value()) << "a fresh project has nothing to resume";
  EXPECT_TRUE(manager.list().entries.empty());
  expect_error([&] { manager.latest(); }, ErrorCode::NotFound, {"no valid checkpoint", ckpts});

  Job job(1);
  const std::vector<double> val_loss = {0.5, 0.2, 0.4, 0.3, 0.6, 0.7};
  for (std::size_t i = 0; i < val_loss.size(); ++i) {
    job.train(10);
    std::string path = manager.save(job.state, 10 * static_cast<std::int64_t>(i + 1),
                                    {{"val_loss", val_loss[i]}, {"nan", std::nan("")}});
    EXPECT_EQ(path, ckpts + "/checkpoint_" + std::to_string(i));
  }
  // The best (0.2, checkpoint_1) and the last two stay.
  CheckpointListing listing = manager.list();
  EXPECT_EQ(names(listing),
            (std::vector<std::string>{"checkpoint_1", "checkpoint_4", "checkpoint_5"}));
  ASSERT_EQ(listing.entries.size(), 3u);
  EXPECT_EQ(listing.entries[0].step, 20);
  EXPECT_EQ(listing.entries[0].metric("val_loss"), 0.2);
  EXPECT_EQ(listing.entries[0].metric("nan"), std::nullopt) << "a NaN is not recorded";
  EXPECT_EQ(listing.entries[2].status, CheckpointStatus::Valid);
  EXPECT_TRUE(listing.entries[2].latest);
  EXPECT_EQ(manager.latest(), ckpts + "/checkpoint_5");

  // Training on from the checkpoint gives the bits of training on without stopping.
  job.train(5);
  Job resumed(99);
  CheckpointManager::Restored r = manager.restore(resumed.state);
  EXPECT_EQ(r.path, ckpts + "/checkpoint_5");
  EXPECT_EQ(r.step, 60);
  EXPECT_EQ(r.report.restored, (std::vector<std::string>{"model", "optimizer"}));
  resumed.train(5);
  EXPECT_TRUE(testing::bitwise_equal(resumed.model->weight, job.model->weight));
  EXPECT_TRUE(testing::bitwise_equal(resumed.model->bias, job.model->bias));

  // Numbering goes on after the largest number, never reusing one.
  EXPECT_EQ(manager.save(job.state, 70, {{"val_loss", 0.9}}), ckpts + "/checkpoint_6");
}

// The README's loop: stopped after step 13 (its last save at 10), run again, it resumes from
// step 10, saves 15 and 20 under new names and ends with the uninterrupted run's weights.
TEST(CheckpointManager, TheReadmeLoopResumesWhereItStopped) {
  TempDir dir;
  auto run = [&](Job& job, std::int64_t steps, std::int64_t stop_after) {
    CheckpointManager manager(
        dir / "runs/a/checkpoints",
        CheckpointManagerOptions()
            .name_format("step-{step:08d}")
            .retention(RetentionPolicy().keep_last(3).best_metric("val_loss")));
    std::int64_t step = 0;
    if (auto latest = manager.try_latest()) step = manager.restore(job.state, *latest).step;
    const std::int64_t first = step;
    while (step < steps) {
      job.train(1);
      double val_loss = 1.0 / static_cast<double>(step + 1);
      if (++step % 5 == 0) manager.save(job.state, step, {{"val_loss", val_loss}});
      if (step == stop_after) break;  // the kill
    }
    return first;
  };
  Job whole(1);
  for (int i = 0; i < 20; ++i) whole.train(1);
  Job killed(1);
  EXPECT_EQ(run(killed, 20, 13), 0);
  Job again(7);
  EXPECT_EQ(run(again, 20, -1), 10) << "resumed from the save at step 10";
  EXPECT_TRUE(testing::bitwise_equal(again.model->weight, whole.model->weight));
  EXPECT_TRUE(testing::bitwise_equal(again.model->bias, whole.model->bias));
  std::vector<std::string> kept = testing::list_sorted(dir / "runs/a/checkpoints");
  EXPECT_EQ(kept,
            (std::vector<std::string>{".lock", "step-00000010", "step-00000015", "step-00000020"}));
}

// The newest checkpoint proven corrupt by its own checksums is passed over; one that cannot be
// judged (written by a newer torchpoint) is an error naming it, never passed over.
TEST(CheckpointManager, TryLatestPassesOverCorruptButNotUnjudgeable) {
  TempDir dir;
  CheckpointManager manager(dir / "c");
  Job job(1);
  for (int step : {1, 2, 3}) manager.save(job.state, step);
  EXPECT_EQ(manager.list().entries.size(), 3u) << "no retention rule: all kept";
  std::string bad = dir / "c/checkpoint_2/model.safetensors";
  testing::flip_bit(bad, testing::file_size(bad) - 3, 1);
  EXPECT_EQ(manager.try_latest(), dir / "c/checkpoint_1");
  EXPECT_EQ(manager.list().entries[2].status, CheckpointStatus::Corrupt);

  manager.save(job.state, 4);  // checkpoint_3
  testing::make_manifest_newer(dir / "c/checkpoint_3/manifest.json");
  expect_error([&] { manager.try_latest(); }, ErrorCode::Incompatible,
               {dir / "c/checkpoint_3", "not passed over"});
}

// Names from a template: ordered by the step as a number (step-9 before step-10), found by
// try_latest, and read back with their epoch and metrics; a template that cannot be formatted
// or would order by another number is refused with the fields there are.
TEST(CheckpointManager, NameFormatWithStepEpochAndMetrics) {
  TempDir dir;
  CheckpointManager manager(dir / "c",
                            CheckpointManagerOptions()
                                .name_format("step-{step}-epoch-{epoch:02d}-loss-{loss:.2f}")
                                .retention(RetentionPolicy().keep_last(3)));
  Job job(1);
  for (std::int64_t step : {8, 9, 10, 11}) {
    manager.save(job.state, step, {{"loss", 1.0 / static_cast<double>(step)}}, step / 4);
  }
  CheckpointListing listing = manager.list();
  std::vector<std::string> want = {"step-9-epoch-02-loss-0.11", "step-10-epoch-02-loss-0.10",
                                   "step-11-epoch-02-loss-0.09"};
  EXPECT_EQ(names(listing), want) << "step 8 went: the last 3 by step, not by text";
  EXPECT_EQ(listing.entries.back().metadata["epoch"], 2);
  EXPECT_EQ(manager.latest(), dir / "c/" + want.back());

  expect_error(
      [&] { CheckpointManager(dir / "d", CheckpointManagerOptions().name_format("best")); },
      ErrorCode::InvalidArgument, {"{n}, {step} or {epoch}"});
  CheckpointManager typo(dir / "e", CheckpointManagerOptions().name_format("step-{step}-{acc}"));
  expect_error(
      [&] {
        typo.save(job.state, 1, {{"loss", 0.5}});
      },
      ErrorCode::InvalidArgument, {"cannot be formatted", "{n}, {step}, {loss}"});
  CheckpointManager run3(dir / "f", CheckpointManagerOptions().name_format("run3-step-{step}"));
  expect_error([&] { run3.save(job.state, 7); }, ErrorCode::InvalidArgument,
               {"would be ordered by 3"});
}

// A checkpoint that does not fit is refused before anything changes.
TEST(CheckpointManager, ARestoreThatDoesNotFitChangesNothing) {
  TempDir dir;
  CheckpointManager manager(dir / "c");
  Job job(1);
  StatefulSet model_only;
  model_only.add("model", ModuleState(job.model.ptr()));
  std::string path = manager.save(model_only, 1);

  Job other(2);
  at::Tensor before = other.model->weight.clone();
  expect_error([&] { manager.restore(other.state, path); }, ErrorCode::Incompatible, {"optimizer"});
  EXPECT_TRUE(testing::bitwise_equal(other.model->weight, before));

  torch::nn::Linear wide(20, 1);
  StatefulSet wide_set;
  wide_set.add("model", ModuleState(wide.ptr()));
  at::Tensor wide_before = wide->weight.clone();
  expect_error([&] { manager.restore(wide_set); }, ErrorCode::Incompatible, {"weight"});
  EXPECT_TRUE(testing::bitwise_equal(wide->weight, wide_before));
  expect_error([] { CheckpointManager(""); }, ErrorCode::InvalidArgument, {"directory"});
}

// restore() by number; the checkpoint a run restored from is kept while its manager lives,
// even past keep_last, and is released by the next run's manager.
TEST(CheckpointManager, RestoreByNumberAndTheCheckpointResumedFromIsKept) {
  TempDir dir;
  const std::string ckpts = dir / "checkpoints";
  auto options = CheckpointManagerOptions().retention(RetentionPolicy().keep_last(1));
  Job job(1);
  {
    CheckpointManager manager(ckpts, options);
    for (int i = 0; i < 3; ++i) manager.save(job.state, i);
    EXPECT_EQ(names(manager.list()), (std::vector<std::string>{"checkpoint_2"}));
  }
  // Keep all three so that an older one can be chosen.
  CheckpointManager all(ckpts);
  for (int i = 3; i < 5; ++i) all.save(job.state, i);
  EXPECT_EQ(names(all.list()),
            (std::vector<std::string>{"checkpoint_2", "checkpoint_3", "checkpoint_4"}));

  CheckpointManager manager(ckpts, options);
  Job resumed(9);
  expect_error([&] { manager.restore(resumed.state, std::uint64_t{7}); }, ErrorCode::NotFound,
               {"no checkpoint numbered 7", "2, 3, 4"});
  CheckpointManager::Restored r = manager.restore(resumed.state, std::uint64_t{3});
  EXPECT_EQ(r.path, ckpts + "/checkpoint_3");
  EXPECT_EQ(r.step, 3);
  EXPECT_TRUE(testing::bitwise_equal(resumed.model->weight, job.model->weight));
  manager.save(resumed.state, 4);
  manager.save(resumed.state, 5);
  EXPECT_EQ(names(manager.list()), (std::vector<std::string>{"checkpoint_3", "checkpoint_6"}))
      << "the newest and the one this run resumed from";
  CheckpointManager next_run(ckpts, options);
  EXPECT_EQ(next_run.apply_retention(), std::vector<std::string>{ckpts + "/checkpoint_3"});
}

// save_async(): the checkpoint holds the state of the call while training goes on; retention
// runs after the background commit; an error reaches the next save, which does not start.
TEST(CheckpointManager, SaveAsyncWritesTheStateOfTheCallAndReportsErrors) {
  TempDir dir;
  testing::FaultEnv env;
  const std::string ckpts = dir / "checkpoints";
  CheckpointManager manager(
      ckpts, CheckpointManagerOptions().retention(RetentionPolicy().keep_last(2)), &env);
  Job job(1), copy(2);
  for (int i = 1; i <= 4; ++i) {
    job.train(3);
    copy.state.restore(job.state.state_dict());  // what the checkpoint must hold
    SaveHandle h = manager.save_async(job.state, 3 * i);
    job.train(2);  // while it is written
    h.wait();
  }
  EXPECT_EQ(names(manager.list()), (std::vector<std::string>{"checkpoint_2", "checkpoint_3"}));
  Job restored(9);
  EXPECT_EQ(manager.restore(restored.state).step, 12);
  EXPECT_TRUE(testing::bitwise_equal(restored.model->weight, copy.model->weight));
  EXPECT_FALSE(testing::bitwise_equal(restored.model->weight, job.model->weight));

  env.fail_nth({testing::Op::Rename}, 1, EIO);
  manager.save_async(job.state, 15);
  expect_error([&] { manager.save_async(job.state, 16); }, ErrorCode::IOError, {"checkpoint_4"});
  manager.wait_for_checkpoint();  // received already: quiet
  EXPECT_EQ(names(manager.list()), (std::vector<std::string>{"checkpoint_2", "checkpoint_3"}));
  EXPECT_EQ(manager.save(job.state, 17), ckpts + "/checkpoint_4");
}

}  // namespace
}  // namespace torchpoint
