// A Learner fit (Dropout, Adam, an LR scheduler callback, validation with a metric,
// model_checkpoint, early stopping, a custom stateful callback, auto_resume every 10 steps and
// at epoch ends) runs in a child process that is SIGKILLed at planned points — before any
// save, mid-epoch, on the last batch, around an epoch-end save, inside saves — and rerun
// unchanged. Every step's loss, the final model, optimizer, counters and records, and the
// checkpoints written must be bit-identical to the uninterrupted run.
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <map>
#include <random>
#include <sstream>

#include "testing/test_util.h"
#include "tests/child_log.h"
#include "torchpoint/state_dict.h"
#include "torchpoint/tensor_file.h"

namespace torchpoint {
namespace {

int run_child(const std::string& dir, const std::string& log, const std::string& kill,
              const std::string& saves) {
  return testing::run_child(LEARNER_CHILD, {dir, log, kill, saves});
}

int run_gan_child(const std::string& dir, const std::string& log, const std::string& kill) {
  return testing::run_child(LEARNER_CHILD, {dir, log, kill, "sync", "gan"});
}

void expect_same_state(const StateDict& got, const StateDict& want) {
  ASSERT_EQ(got.keys(), want.keys());
  for (const auto& [key, value] : want.entries()) {
    if (std::holds_alternative<at::Tensor>(value)) {
      EXPECT_TRUE(testing::bitwise_equal(got.tensor(key), std::get<at::Tensor>(value))) << key;
    } else {
      EXPECT_EQ(got.value(key), std::get<Json>(value)) << key;
    }
  }
}

// Kills the job at twelve points, reruns it, and compares with an uninterrupted run with
// synchronous saves. `saves`: "sync" or "async" (auto_resume and model_checkpoint in the
// background, whose kills at op:N fall inside background writes).
void kill_at_twelve_points(const std::string& saves) {
  constexpr long kSteps = 6 * 32;  // 6 epochs of 32 batches
  const bool async = saves == "async";
  testing::TempDir dir;
  std::string reference_dir = dir / "reference";
  ASSERT_EQ(run_child(reference_dir, dir / "reference.log", "none", "sync"), 0);
  testing::ChildLog reference = testing::read_child_log(dir / "reference.log");
  ASSERT_EQ(reference.steps.size(), static_cast<std::size_t>(kSteps));
  ASSERT_EQ(reference.count("done"), 1u);
  const long reference_ops = std::stol(reference.last("ops"));
  StateDict reference_final = StateDict::from_container(load_file(reference_dir + "/final.ckpt"));
  std::vector<std::string> reference_ckpts = testing::list_sorted(reference_dir + "/ckpts");
  ASSERT_FALSE(reference_ckpts.empty());
  EXPECT_FALSE(Env::posix().stat(reference_dir + "/state.ckpt").exists);

  ASSERT_GT(reference_ops, 100);
  long ops = reference_ops;
  if (async) {
    ASSERT_EQ(run_child(dir / "async", dir / "async.log", "none", "async"), 0);
    testing::ChildLog run = testing::read_child_log(dir / "async.log");
    ops = std::stol(run.last("ops"));
    expect_same_state(StateDict::from_container(load_file(dir / "async/final.ckpt")),
                      reference_final);
  }
  std::vector<std::string> plans = {
      "batch:1:3",      // before any save: the rerun starts over
      "batch:1:10",     // right after the first step save
      "batch:2:5",      // mid-epoch, five steps after a save
      "batch:2:32",     // last batch of an epoch, before its end work
      "before_save:3",  // epoch end, after the other callbacks, before auto_resume saved
      "after_save:3",   // epoch end, right after the save
      "batch:4:1",      // first batch of an epoch
      "batch:6:20",     // in the last epoch, right after a step save
      "op:4",           // inside the first save
  };
  // Inside saves spread over the run (auto_resume's and model_checkpoint's).
  for (long part : {3, 5, 7}) plans.push_back(fmt::format("op:{}", ops * part / 8));
  for (std::size_t i = 0; i < plans.size(); ++i) {
    const std::string& plan = plans[i];
    SCOPED_TRACE("kill plan " + plan);
    std::string run_dir = dir / ("run-" + std::to_string(i));
    std::string log = run_dir + ".log";
    int killed = run_child(run_dir, log, plan, saves);
    ASSERT_TRUE(WIFSIGNALED(killed) && WTERMSIG(killed) == SIGKILL) << "status " << killed;
    ASSERT_EQ(run_child(run_dir, log, "none", saves), 0) << "the rerun must finish";
    testing::ChildLog got = testing::read_child_log(log);
    EXPECT_EQ(got.count("done"), 1u);
    if (async) {
      // A kill right after a save may come before its background commit.
      EXPECT_LE(got.count("resumed"), 1u);
    } else {
      EXPECT_EQ(got.count("resumed"), plan == "batch:1:3" || plan == "op:4" ? 0u : 1u);
    }
    // Synchronous: at most the steps since the last save run twice. Asynchronous: a kill in the
    // background write of a save loses it too, and the loop runs at most 10 steps past it
    // (the next save waits for it), so at most 20.
    EXPECT_LE(got.steps.size(), static_cast<std::size_t>(kSteps + (async ? 20 : 19)))
        << "a resume must start from the newest committed save";
    for (const auto& [step, bits] : got.steps) {
      auto ref = reference.steps.find(step);
      ASSERT_NE(ref, reference.steps.end()) << "unexpected step " << step;
      EXPECT_EQ(bits, ref->second) << "loss of step " << step << " differs";
    }
    for (long s = 1; s <= kSteps; ++s) EXPECT_TRUE(got.steps.count(s)) << "step " << s;
    expect_same_state(StateDict::from_container(load_file(run_dir + "/final.ckpt")),
                      reference_final);
    EXPECT_EQ(testing::list_sorted(run_dir + "/ckpts"), reference_ckpts);
    EXPECT_FALSE(Env::posix().stat(run_dir + "/state.ckpt").exists);
    // A save cut by the kill left a temporary; the rerun's saves swept it.
    for (const std::string& where : {run_dir, run_dir + "/ckpts"}) {
      for (const std::string& name : testing::list_sorted(where)) {
        EXPECT_EQ(name.find(".tmp-"), std::string::npos) << where << "/" << name;
      }
    }
  }
}

// Two optimizers (a GAN: generator with Adam and an LR scheduler attached to it, discriminator
// with SGD and momentum) under auto_resume every 10 steps: killed at three moments drawn from a
// fixed seed (a batch, an epoch end after its save, a file-system call inside a save), each
// rerun ends with every step's losses, both optimizers' states, the model, records and
// checkpoints bit-identical to the uninterrupted run.
TEST(LearnerCrash, TwoOptimizersKilledAtSeededMomentsRerunEndBitIdentical) {
  constexpr long kSteps = 2 * 32;  // 2 epochs of 32 batches
  constexpr std::uint32_t kSeed = 20261204;
  testing::TempDir dir;
  std::string reference_dir = dir / "reference";
  ASSERT_EQ(run_gan_child(reference_dir, dir / "reference.log", "none"), 0);
  testing::ChildLog reference = testing::read_child_log(dir / "reference.log");
  ASSERT_EQ(reference.steps.size(), static_cast<std::size_t>(kSteps));
  const long ops = std::stol(reference.last("ops"));
  ASSERT_GT(ops, 20);
  StateDict reference_final = StateDict::from_container(load_file(reference_dir + "/final.ckpt"));
  ASSERT_EQ(reference_final.get<std::vector<std::string>>("learner.optimizers"),
            (std::vector<std::string>{"generator", "discriminator"}));
  ASSERT_TRUE(reference_final.contains("optimizer.generator.state.0.0.exp_avg"));
  ASSERT_TRUE(reference_final.contains("optimizer.discriminator.state.0.0.momentum_buffer"));
  std::vector<std::string> reference_ckpts = testing::list_sorted(reference_dir + "/ckpts");
  ASSERT_FALSE(reference_ckpts.empty());

  std::mt19937 random(kSeed);
  auto draw = [&](long low, long high) {
    return std::uniform_int_distribution<long>(low, high)(random);
  };
  // Past step 10, so that a save precedes every kill.
  const long epoch = draw(1, 2);
  const std::vector<std::string> plans = {
      fmt::format("batch:{}:{}", epoch, draw(epoch == 1 ? 11 : 1, 32)),
      fmt::format("after_save:{}", draw(1, 2)), fmt::format("op:{}", draw(4, ops - 1))};
  for (std::size_t i = 0; i < plans.size(); ++i) {
    SCOPED_TRACE(fmt::format("seed {}, kill plan {}", kSeed, plans[i]));
    std::string run_dir = dir / ("run-" + std::to_string(i));
    std::string log = run_dir + ".log";
    int killed = run_gan_child(run_dir, log, plans[i]);
    ASSERT_TRUE(WIFSIGNALED(killed) && WTERMSIG(killed) == SIGKILL) << "status " << killed;
    ASSERT_EQ(run_gan_child(run_dir, log, "none"), 0) << "the rerun must finish";
    testing::ChildLog got = testing::read_child_log(log);
    EXPECT_EQ(got.count("done"), 1u);
    if (plans[i].rfind("op:", 0) != 0) {
      EXPECT_EQ(got.count("resumed"), 1u);
    }
    EXPECT_LE(got.steps.size(), static_cast<std::size_t>(kSteps + 19));
    for (const auto& [step, bits] : got.steps) {
      auto ref = reference.steps.find(step);
      ASSERT_NE(ref, reference.steps.end()) << "unexpected step " << step;
      EXPECT_EQ(bits, ref->second) << "losses of step " << step << " differ";
    }
    for (long s = 1; s <= kSteps; ++s) EXPECT_TRUE(got.steps.count(s)) << "step " << s;
    expect_same_state(StateDict::from_container(load_file(run_dir + "/final.ckpt")),
                      reference_final);
    EXPECT_EQ(testing::list_sorted(run_dir + "/ckpts"), reference_ckpts);
    EXPECT_FALSE(Env::posix().stat(run_dir + "/state.ckpt").exists);
  }
}

TEST(LearnerCrash, KilledAtTwelvePointsRerunsEndBitIdentical) { kill_at_twelve_points("sync"); }

TEST(LearnerCrash, AsyncSavesKilledAtTwelvePointsRerunEndBitIdentical) {
  kill_at_twelve_points("async");
}

}  // namespace
}  // namespace torchpoint
