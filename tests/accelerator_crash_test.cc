// A training loop (MLP with Dropout, Adam, StepLR, GradScaler, shuffled data, save_state every
// 5 steps, not aligned with the 13-batch epochs) runs in a child process that is SIGKILLed at
// planned points — mid-epoch, at epoch ends, right after a save, during a save — and rerun
// with load_state(). Every step's loss and the final model, optimizer and RNG state must be
// bit-identical to the uninterrupted run.
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include "testing/test_util.h"
#include "tests/child_log.h"
#include "torchpoint/checkpoint_manager.h"

namespace torchpoint {
namespace {

int run_child(const std::string& project, const std::string& log, const std::string& kill,
              const std::string& saver = "accelerator") {
  return testing::run_child(ACCELERATOR_CHILD, {project, log, kill, saver});
}

// Every step the rerun logged has the uninterrupted run's loss bits, none of the 39 is missing,
// and the final state is the same.
void expect_same_run(const testing::ChildLog& got, const testing::ChildLog& reference) {
  for (const auto& [step, bits] : got.steps) {
    auto ref = reference.steps.find(step);
    ASSERT_NE(ref, reference.steps.end()) << "unexpected step " << step;
    EXPECT_EQ(bits, ref->second) << "loss of step " << step << " differs";
  }
  for (long s = 1; s <= 39; ++s) EXPECT_TRUE(got.steps.count(s)) << "step " << s << " never ran";
  EXPECT_EQ(got.last("final"), reference.last("final")) << "final state differs";
}

// The valid checkpoints under `dir`; none may be corrupt.
std::size_t count_valid_expecting_none_corrupt(const std::string& dir) {
  std::size_t valid = 0;
  for (const ListedCheckpoint& e : CheckpointManager(dir).list().entries) {
    EXPECT_NE(e.status, CheckpointStatus::Corrupt) << e.name;
    if (e.status == CheckpointStatus::Valid) ++valid;
  }
  return valid;
}

TEST(AcceleratorCrash, KilledAtTenPointsResumesBitIdentically) {
  testing::TempDir dir;
  ASSERT_EQ(run_child(dir / "reference", dir / "reference.log", "none"), 0);
  testing::ChildLog reference = testing::read_child_log(dir / "reference.log");
  ASSERT_EQ(reference.steps.size(), 39u);
  ASSERT_FALSE(reference.last("final").empty());

  const std::vector<std::string> plans = {
      "step:1",        // before any save
      "step:7",        // mid-epoch, two steps after a save
      "step:13",       // last batch of epoch 0, before the epoch's end work
      "step:14",       // first batch of epoch 1
      "step:26",       // end of epoch 1
      "step:33",       // mid-epoch 2
      "after_save:1",  // right after the first save (step 5)
      "after_save:5",  // right after the save at step 25
      "save:2:op:3",   // early in the second save
      "save:3:op:12",  // mid-file in the third save
      "save:4:op:30",  // late in the fourth save (around the commit rename)
      "save:6:op:45",  // at retention after the sixth save
  };
  for (const std::string& plan : plans) {
    SCOPED_TRACE("kill plan " + plan);
    std::string project = dir / ("p-" + std::to_string(&plan - plans.data()));
    std::string log = project + ".log";
    int killed = run_child(project, log, plan);
    ASSERT_TRUE(WIFSIGNALED(killed) && WTERMSIG(killed) == SIGKILL) << "status " << killed;
    ASSERT_EQ(run_child(project, log, "none"), 0) << "the rerun must finish";
    testing::ChildLog got = testing::read_child_log(log);
    // Every plan but the first kills after a checkpoint exists, so the rerun must resume.
    EXPECT_EQ(got.count("resumed"), plan == "step:1" ? 0u : 1u);
    EXPECT_LT(got.steps.size(), 39u + 39u) << "a resume must not start over";
    ASSERT_NO_FATAL_FAILURE(expect_same_run(got, reference));
  }
}

// The same job saved by a CheckpointManager of the user's own loop (keep the last 2 and the best
// by loss; try_latest() and restore() on start), killed at points including inside the save
// and inside its retention: it resumes bit-identically, and the directory never holds a
// corrupt checkpoint or more than the policy allows (last 2, best 1, the one resumed from).
// `saver`: "manager" or "manager-async"; `plans`: the kill plans.
void kill_manager_runs(const std::string& saver, const std::vector<std::string>& plans) {
  testing::TempDir dir;
  ASSERT_EQ(run_child(dir / "reference", dir / "reference.log", "none", "manager"), 0);
  testing::ChildLog reference = testing::read_child_log(dir / "reference.log");
  ASSERT_EQ(reference.steps.size(), 39u);
  // The uninterrupted manager run trains exactly as the Accelerator's run does.
  ASSERT_EQ(run_child(dir / "acc", dir / "acc.log", "none"), 0);
  EXPECT_EQ(testing::read_child_log(dir / "acc.log").last("final"), reference.last("final"));

  for (const std::string& plan : plans) {
    SCOPED_TRACE("kill plan " + plan);
    std::string project = dir / ("m-" + std::to_string(&plan - plans.data()));
    std::string log = project + ".log";
    int killed = run_child(project, log, plan, saver);
    ASSERT_TRUE(WIFSIGNALED(killed) && WTERMSIG(killed) == SIGKILL) << "status " << killed;
    EXPECT_LE(count_valid_expecting_none_corrupt(project + "/checkpoints"), 4u)
        << "last 2, the best, and one committed before its retention ran";

    ASSERT_EQ(run_child(project, log, "none", saver), 0) << "the rerun must finish";
    testing::ChildLog got = testing::read_child_log(log);
    EXPECT_LT(got.steps.size(), 39u + 39u) << "a resume must not start over";
    ASSERT_NO_FATAL_FAILURE(expect_same_run(got, reference));

    const std::size_t valid = count_valid_expecting_none_corrupt(project + "/checkpoints");
    EXPECT_GE(valid, 2u);
    EXPECT_LE(valid, 4u) << "last 2, the best, the one resumed from";
    CheckpointListing end = CheckpointManager(project + "/checkpoints").list();
    ASSERT_FALSE(end.entries.empty());
    EXPECT_EQ(end.entries.back().step, 35) << "the last save (step 35) is the newest";
  }
}

TEST(CheckpointManagerCrash, KilledInsideSavesAndRetentionResumesBitIdentically) {
  // A save here is 82 file-system calls with nothing to delete (the second) and 135 with
  // retention deleting (the fifth): listing and deleting are its last ~50.
  kill_manager_runs("manager", {"step:7", "step:14", "after_save:3", "save:1:op:2", "save:2:op:30",
                                "save:3:op:60", "save:3:op:78", "save:4:op:81", "save:5:op:100",
                                "save:5:op:125", "save:6:op:134"});
}

// save_async(): killed before the N-th of the run's 794 file-system calls, which the background
// writer and its retention make while the loop trains on.
TEST(CheckpointManagerCrash, AsyncSavesKilledInTheBackgroundResumeBitIdentically) {
  kill_manager_runs("manager-async", {"op:4", "op:60", "op:150", "op:240", "op:330", "op:420",
                                      "op:510", "op:600", "op:690", "op:780"});
}

// The Accelerator job with save_state_async(), SIGKILLed before the N-th file-system call of
// the process, which the background writer makes while the loop trains on: every rerun ends
// bit-identical to an uninterrupted run with synchronous saves, and no kill leaves a corrupt
// checkpoint.
TEST(AcceleratorCrash, AsyncSavesKilledInTheBackgroundWriteResumeBitIdentically) {
  testing::TempDir dir;
  ASSERT_EQ(run_child(dir / "reference", dir / "reference.log", "none"), 0);
  testing::ChildLog reference = testing::read_child_log(dir / "reference.log");
  ASSERT_EQ(reference.steps.size(), 39u);
  ASSERT_EQ(run_child(dir / "async", dir / "async.log", "none", "async"), 0);
  EXPECT_EQ(testing::read_child_log(dir / "async.log").last("final"), reference.last("final"))
      << "async saves change nothing in the run";

  // The run makes 442 calls in 7 saves (about 63 each): these fall early, mid-file, around the
  // commit and in total_limit's deletions, of the first to the last save.
  const std::vector<int> kill_ops = {3, 25, 50, 90, 140, 190, 250, 300, 370, 430};
  for (int op : kill_ops) {
    const std::string plan = "op:" + std::to_string(op);
    SCOPED_TRACE("kill plan " + plan);
    std::string project = dir / ("a-" + std::to_string(op));
    std::string log = project + ".log";
    int killed = run_child(project, log, plan, "async");
    ASSERT_TRUE(WIFSIGNALED(killed) && WTERMSIG(killed) == SIGKILL) << "status " << killed;
    if (std::filesystem::exists(project + "/checkpoints")) {
      count_valid_expecting_none_corrupt(project + "/checkpoints");
    }
    ASSERT_EQ(run_child(project, log, "none", "async"), 0) << "the rerun must finish";
    testing::ChildLog got = testing::read_child_log(log);
    EXPECT_LT(got.steps.size(), 39u + 39u) << "a resume must not start over";
    ASSERT_NO_FATAL_FAILURE(expect_same_run(got, reference));
  }
}

}  // namespace
}  // namespace torchpoint
