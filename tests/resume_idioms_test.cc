// The four resume idioms of Accelerate's users (issue 37), each killed with SIGKILL right after
// every save of a three-epoch run in turn — saves in an epoch's first, middle and last batch,
// after its loop ended and after its scheduler stepped — on one process with and without
// gradient accumulation, and on two under torchrun with accumulation over 2 batches (where the
// epoch's partial last update must sync on both processes; every torchrun restart costs
// seconds of CPU, so the plain case runs on one process only). Every resumed run must train
// every step once, with the uninterrupted run's loss bits, and end in its exact state:
//   registered  the guide: the position (epoch, batches done) in a registered object,
//               skip_first_batches(loader, batches_done) in the saved epoch;
//   step        Accelerate's checkpointing.py: starting_epoch = step / len(loader),
//               resume_step = step - starting_epoch * len(loader), skipped also when it is 0;
//   epoch       Accelerate's epoch_N folders: resumed at N + 1, nothing skipped;
//   stateful    Accelerate's stateful loader: no skip, the restored loader yields the rest.
#include <gtest/gtest.h>

#include <sys/wait.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <map>
#include <set>

#include "testing/test_util.h"
#include "tests/child_log.h"

namespace torchpoint {
namespace {

namespace tt = torchpoint::testing;

struct IdiomRun {
  int status = -1;
  std::vector<tt::ChildLog> logs;  // one per rank
  std::string output;
};

// One run in a fresh project: the uninterrupted one (`killed` empty), or one killed after each
// save not yet listed in the file `killed` and started again until it ends (by this test on
// one process, by torchrun's restarts on two).
IdiomRun run_idiom(const std::string& dir, const std::string& name, const std::string& idiom,
                   int accumulation, int processes, const std::string& killed, int max_attempts) {
  const std::string project = dir + "/" + name, log = dir + "/" + name + ".log";
  std::vector<std::string> args = {project, log, idiom, std::to_string(accumulation)};
  if (!killed.empty()) args.push_back(killed);
  IdiomRun run;
  if (processes == 1) {
    for (int attempt = 0; attempt < max_attempts; ++attempt) {
      run.status = tt::run_child(RESUME_IDIOMS_CHILD, args);
      if (!(WIFSIGNALED(run.status) && WTERMSIG(run.status) == SIGKILL)) break;
    }
  } else {
    std::string command = fmt::format(
        "{} -m torch.distributed.run --standalone --nproc-per-node {} --max-restarts {} "
        "--monitor-interval 0.1 --no-python {}",
        tt::python(), processes, max_attempts - 1, RESUME_IDIOMS_CHILD);
    for (const std::string& a : args) command += " " + a;
    run.status = std::system((command + " > " + log + ".out 2>&1").c_str());
    run.output = tt::read_bytes(log + ".out");
  }
  for (int r = 0; r < processes; ++r) {
    run.logs.push_back(tt::read_child_log(fmt::format("{}.{}", log, r)));
  }
  return run;
}

std::vector<std::string> lines_of(const tt::ChildLog& log, const std::string& kind) {
  auto it = log.others.find(kind);
  return it == log.others.end() ? std::vector<std::string>{} : it->second;
}

// Each killed run trained every step with the uninterrupted run's loss bits and ended in its
// state. Rank 0 kills itself right after a save, so it trains each step once; another rank may
// start the next step before torchrun stops it, and trains that one again after the restart.
void expect_same_run(const IdiomRun& killed, const IdiomRun& whole) {
  for (std::size_t r = 0; r < whole.logs.size(); ++r) {
    SCOPED_TRACE(fmt::format("rank {}", r));
    const tt::ChildLog& got = killed.logs[r];
    const tt::ChildLog& want = whole.logs[r];
    // Another rank fails its collective when rank 0 dies (torchrun then restarts both); rank 0
    // fails nothing, and the run's status says the last attempt of every rank ended well.
    if (r == 0) {
      for (const std::string& error : lines_of(got, "error")) ADD_FAILURE() << error;
    }
    std::map<long, std::string> last;
    for (const auto& [step, bits] : got.steps) {
      auto ref = want.steps.find(step);
      ASSERT_NE(ref, want.steps.end()) << "step " << step << " is not in the whole run";
      EXPECT_EQ(bits, ref->second) << "the loss of step " << step << " differs";
      last[step] = bits;
    }
    if (r == 0) {
      EXPECT_EQ(got.steps, want.steps) << "a step was trained twice or never";
    }
    EXPECT_EQ(last.size(), want.steps.size()) << "a step never ran";
    EXPECT_EQ(got.last("final"), want.last("final")) << "the final state differs";
  }
}

void expect_exact_resumes(const std::string& idiom, int processes) {
  for (int accumulation : {1, 2}) {
    if (processes > 1 && accumulation == 1) continue;
    SCOPED_TRACE(fmt::format("{} on {} process(es), gradient accumulation {}", idiom, processes,
                             accumulation));
    tt::TempDir dir;
    IdiomRun whole = run_idiom(dir.path(), "whole", idiom, accumulation, processes, "", 1);
    ASSERT_EQ(whole.status, 0) << whole.output;
    for (const tt::ChildLog& log : whole.logs) {
      ASSERT_EQ(log.steps.size(), 9u) << "three epochs of three batches";
    }
    const std::vector<std::string> saves = lines_of(whole.logs[0], "save");
    ASSERT_GE(saves.size(), 3u);
    // A resumed run need not pass every save again (one derived from the step count starts at
    // the next epoch, after the last batch's save): new runs until each save was killed after.
    const std::string killed = dir / "killed";
    auto killed_size = [&] {
      return std::filesystem::exists(killed) ? tt::file_size(killed) : std::uint64_t{0};
    };
    std::set<std::string> resumed_from;
    for (int chain = 0;; ++chain) {
      SCOPED_TRACE(fmt::format("run {}", chain));
      const std::uint64_t before = killed_size();
      IdiomRun run = run_idiom(dir.path(), fmt::format("killed-{}", chain), idiom, accumulation,
                               processes, killed, static_cast<int>(saves.size()) + 2);
      ASSERT_EQ(run.status, 0) << run.output;
      ASSERT_NO_FATAL_FAILURE(expect_same_run(run, whole));
      for (const std::string& label : lines_of(run.logs[0], "resumed")) {
        EXPECT_TRUE(resumed_from.insert(label).second) << label << " was killed after twice";
      }
      if (resumed_from.size() == saves.size()) break;
      ASSERT_GT(killed_size(), before) << "no save left to kill after";
    }
    EXPECT_EQ(resumed_from, std::set<std::string>(saves.begin(), saves.end()));
  }
}

TEST(ResumeIdioms, RegisteredPositionOneProcess) { expect_exact_resumes("registered", 1); }
TEST(ResumeIdioms, StepDerivedPositionOneProcess) { expect_exact_resumes("step", 1); }
TEST(ResumeIdioms, EpochFoldersOneProcess) { expect_exact_resumes("epoch", 1); }
TEST(ResumeIdioms, StatefulLoaderOneProcess) { expect_exact_resumes("stateful", 1); }
TEST(ResumeIdioms, RegisteredPositionTwoProcesses) { expect_exact_resumes("registered", 2); }
TEST(ResumeIdioms, StepDerivedPositionTwoProcesses) { expect_exact_resumes("step", 2); }
TEST(ResumeIdioms, EpochFoldersTwoProcesses) { expect_exact_resumes("epoch", 2); }
TEST(ResumeIdioms, StatefulLoaderTwoProcesses) { expect_exact_resumes("stateful", 2); }

}  // namespace
}  // namespace torchpoint
