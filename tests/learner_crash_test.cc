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

TEST(LearnerCrash, KilledAtTwelvePointsRerunsEndBitIdentical) { kill_at_twelve_points("sync"); }

TEST(LearnerCrash, AsyncSavesKilledAtTwelvePointsRerunEndBitIdentical) {
  kill_at_twelve_points("async");
}

}  // namespace
}  // namespace torchpoint
