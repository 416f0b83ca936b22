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
#include "torchpoint/state_dict.h"
#include "torchpoint/tensor_file.h"

namespace torchpoint {
namespace {

int run_child(const std::string& dir, const std::string& log, const std::string& kill) {
  pid_t pid = ::fork();
  if (pid == 0) {
    ::execl(LEARNER_CHILD, LEARNER_CHILD, dir.c_str(), log.c_str(), kill.c_str(), nullptr);
    ::_exit(127);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

struct Log {
  std::multimap<long, std::string> steps;
  int resumes = 0;
  int done = 0;
  long ops = 0;  // file-system calls of the last run that finished
};

Log read_log(const std::string& path) {
  Log out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string kind;
    words >> kind;
    if (kind == "step") {
      long step;
      std::string bits;
      words >> step >> bits;
      out.steps.emplace(step, bits);
    } else if (kind == "resumed") {
      ++out.resumes;
    } else if (kind == "ops") {
      words >> out.ops;
    } else if (kind == "done") {
      ++out.done;
    }
  }
  return out;
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

TEST(LearnerCrash, KilledAtTwelvePointsRerunsEndBitIdentical) {
  constexpr long kSteps = 6 * 32;  // 6 epochs of 32 batches
  testing::TempDir dir;
  std::string reference_dir = dir / "reference";
  ASSERT_EQ(run_child(reference_dir, dir / "reference.log", "none"), 0);
  Log reference = read_log(dir / "reference.log");
  ASSERT_EQ(reference.steps.size(), static_cast<std::size_t>(kSteps));
  ASSERT_EQ(reference.done, 1);
  StateDict reference_final = StateDict::from_container(load_file(reference_dir + "/final.ckpt"));
  std::vector<std::string> reference_ckpts = testing::list_sorted(reference_dir + "/ckpts");
  ASSERT_FALSE(reference_ckpts.empty());
  EXPECT_FALSE(Env::posix().stat(reference_dir + "/state.ckpt").exists);

  ASSERT_GT(reference.ops, 100);
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
  for (long part : {3, 5, 7}) plans.push_back(fmt::format("op:{}", reference.ops * part / 8));
  for (std::size_t i = 0; i < plans.size(); ++i) {
    const std::string& plan = plans[i];
    SCOPED_TRACE("kill plan " + plan);
    std::string run_dir = dir / ("run-" + std::to_string(i));
    std::string log = run_dir + ".log";
    int killed = run_child(run_dir, log, plan);
    ASSERT_TRUE(WIFSIGNALED(killed) && WTERMSIG(killed) == SIGKILL) << "status " << killed;
    ASSERT_EQ(run_child(run_dir, log, "none"), 0) << "the rerun must finish";
    Log got = read_log(log);
    EXPECT_EQ(got.done, 1);
    EXPECT_EQ(got.resumes, plan == "batch:1:3" || plan == "op:4" ? 0 : 1);
    EXPECT_LT(got.steps.size(), static_cast<std::size_t>(kSteps + 20))
        << "at most the steps since the last save run twice";
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
  }
}

}  // namespace
}  // namespace torchpoint
