// Saves under injected I/O faults and simulated power cuts: a failed save throws a clear error,
// keeps every committed checkpoint, leaves no temporary, and never trusts a failed fsync.
#include <cerrno>

#include "io/filename.h"
#include "testing/fault_env.h"
#include "testing/test_util.h"
#include "torchpoint/checkpoint_dir.h"
#include "torchpoint/error.h"
#include "torchpoint/tensor_file.h"

namespace torchpoint {
namespace {

using testing::FaultEnv;
using testing::Op;
using testing::PowerCutMode;
using testing::TempDir;

// Big enough for the threaded O_DIRECT pipeline (over one 8 MiB chunk), plus small files.
std::vector<Component> components(int seed) {
  return {
      {"model",
       {{{"big", testing::make_tensor(at::kFloat, {9, 256, 1024}, seed)},
         {"bias", testing::make_tensor(at::kFloat, {17}, seed + 1)}},
        {{"seed", seed}}}},
      {"optimizer", {{{"step", at::tensor(int64_t{seed})}}, {{"lr", 0.5}}}},
  };
}

void expect_valid(const std::string& path, int seed) {
  ASSERT_TRUE(verify(path).ok()) << path;
  DirectoryCheckpoint c = load_directory(path);
  ASSERT_EQ(c.components.size(), 2u);
  EXPECT_EQ(c.components[0].contents.state["seed"], seed);
  EXPECT_TRUE(testing::bitwise_equal(c.components[0].contents.tensors[0].second,
                                     components(seed)[0].contents.tensors[0].second));
}

std::vector<std::string> temporaries(const std::string& dir) {
  std::vector<std::string> out;
  for (const std::string& name : testing::list_sorted(dir)) {
    if (is_temp_name(name)) out.push_back(name);
  }
  return out;
}

// After "sync X -> injected", X is never synced again: a failed fsync is final.
void expect_no_fsync_retry(const std::vector<std::string>& log) {
  std::set<std::string> failed;
  for (const std::string& line : log) {
    bool injected = line.find(" -> injected") != std::string::npos;
    std::string call = line.substr(0, line.find(" -> injected"));
    if (!call.starts_with("sync ") && !call.starts_with("sync_dir ")) continue;
    EXPECT_FALSE(failed.count(call)) << "retried after a failed fsync: " << call;
    if (injected) failed.insert(call);
  }
}

struct FaultCase {
  int err;
  bool persistent;
};

class EveryCallFails : public ::testing::TestWithParam<FaultCase> {};

TEST_P(EveryCallFails, SaveThrowsAndKeepsTheCommittedCheckpoint) {
  const FaultCase fc = GetParam();
  TempDir dir;
  std::string root = dir / "checkpoints";
  save_directory(root + "/checkpoint_0", components(0));
  std::uint64_t failures = 0;
  for (std::uint64_t n = 1;; ++n) {
    SCOPED_TRACE(fmt::format("errno {} at call {} ({})", fc.err, n,
                             fc.persistent ? "persistent" : "transient"));
    FaultEnv env;
    env.fail_nth(testing::all_ops(), n, fc.err, fc.persistent);
    bool threw = false;
    try {
      save_directory(root + "/checkpoint_1", components(1), {}, env);
    } catch (const Error& e) {
      threw = true;
      EXPECT_TRUE(e.code() == ErrorCode::IOError || e.code() == ErrorCode::NotFound) << e.what();
      EXPECT_NE(std::string(e.what()).find("injected"), std::string::npos) << e.what();
    }
    expect_no_fsync_retry(env.log());
    expect_valid(root + "/checkpoint_0", 0);
    if (env.faults_fired() == 0) {
      ASSERT_FALSE(threw);
      expect_valid(root + "/checkpoint_1", 1);
      EXPECT_GT(failures, 20u) << "too few I/O calls were exercised";
      break;
    }
    ++failures;
    if (threw) {
      // A rename that went through before a later call failed has committed the checkpoint.
      if (Env::posix().stat(root + "/checkpoint_1").exists) {
        expect_valid(root + "/checkpoint_1", 1);
        Env::posix().remove_all(root + "/checkpoint_1");
      }
      if (!fc.persistent) {
        EXPECT_EQ(temporaries(root), std::vector<std::string>{});
      }
    } else {
      expect_valid(root + "/checkpoint_1", 1);
      Env::posix().remove_all(root + "/checkpoint_1");
    }
    // Once the fault clears, the next save succeeds and sweeps what a persistent fault left.
    if (fc.persistent) {
      save_directory(root + "/checkpoint_2", components(2));
      EXPECT_EQ(temporaries(root), std::vector<std::string>{});
      Env::posix().remove_all(root + "/checkpoint_2");
    }
    ASSERT_LT(n, 1000u);
  }
}

// The full-disk kinds EDQUOT and EFBIG take the paths of ENOSPC: swept once each, transient
// (a persistent fault differs from a transient one in what the next save sweeps, which EIO and
// ENOSPC cover).
INSTANTIATE_TEST_SUITE_P(Errnos, EveryCallFails,
                         ::testing::Values(FaultCase{EIO, false}, FaultCase{ENOSPC, false},
                                           FaultCase{EIO, true}, FaultCase{ENOSPC, true},
                                           FaultCase{EDQUOT, false}, FaultCase{EFBIG, false}),
                         [](const auto& info) {
                           return fmt::format("errno{}_{}", info.param.err,
                                              info.param.persistent ? "persistent" : "transient");
                         });

TEST(Faults, ShortWritesStillProduceCompleteFiles) {
  TempDir dir;
  FaultEnv env;
  env.set_short_writes(true);
  save_directory(dir / "checkpoint_0", components(5), {}, env);
  save_file(dir / "state.ckpt", components(6)[0].contents, env);
  expect_valid(dir / "checkpoint_0", 5);
  EXPECT_EQ(load_file(dir / "state.ckpt").state["seed"], 6);
}

TEST(Faults, RenameAcrossFileSystemsExplainsItself) {
  TempDir dir;
  FaultEnv env;
  env.fail_nth({Op::Rename}, 1, EXDEV);
  try {
    save_directory(dir / "checkpoint_0", components(0), {}, env);
    FAIL() << "the save must fail";
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::IOError);
    EXPECT_NE(std::string(e.what()).find("same file system"), std::string::npos) << e.what();
  }
  EXPECT_EQ(testing::list_sorted(dir.path()), std::vector<std::string>{".lock"});
}

// The same sweep over a file checkpoint (save_file replaces state.ckpt by rename): after each
// fault the file holds the old or the new version whole, never anything else.
TEST(Faults, EveryCallOfAFileSaveFailsInTurn) {
  TempDir dir;
  std::string path = dir / "state.ckpt";
  auto contents = [](int seed) { return components(seed)[0].contents; };
  save_file(path, contents(0));
  for (bool persistent : {false, true}) {
    std::uint64_t failures = 0;
    for (std::uint64_t n = 1;; ++n) {
      SCOPED_TRACE(fmt::format("EIO at call {} ({})", n, persistent ? "persistent" : "transient"));
      FaultEnv env;
      env.fail_nth(testing::all_ops(), n, EIO, persistent);
      try {
        save_file(path, contents(1), env);
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::IOError) << e.what();
        EXPECT_NE(std::string(e.what()).find("injected"), std::string::npos) << e.what();
      }
      expect_no_fsync_retry(env.log());
      Container now = load_file(path);
      int seed = now.state["seed"].get<int>();
      ASSERT_TRUE(seed == 0 || seed == 1);
      EXPECT_TRUE(testing::bitwise_equal(now.tensors[0].second, contents(seed).tensors[0].second));
      // The next save without a fault succeeds and leaves no temporary behind.
      save_file(path, contents(0));
      EXPECT_EQ(temporaries(dir.path()), std::vector<std::string>{});
      if (env.faults_fired() == 0) {
        EXPECT_GE(failures, 8u) << "too few I/O calls were exercised";
        break;
      }
      ++failures;
      ASSERT_LT(n, 1000u);
    }
  }
}

// mkdir and rename refusing with EEXIST (a name that appeared under us): a clear error, the
// committed checkpoint kept, no temporary left, and the next save works.
TEST(Faults, MkdirAndRenameRefusingWithEexist) {
  for (Op op : {Op::Mkdir, Op::Rename}) {
    SCOPED_TRACE(testing::op_name(op));
    TempDir dir;
    std::string root = dir / "checkpoints";
    save_directory(root + "/checkpoint_0", components(0));
    FaultEnv env;
    env.fail_nth({op}, 1, EEXIST);
    testing::expect_error([&] { save_directory(root + "/checkpoint_1", components(1), {}, env); },
                          ErrorCode::IOError, {"checkpoint_1"});
    EXPECT_EQ(env.faults_fired(), 1u);
    expect_valid(root + "/checkpoint_0", 0);
    EXPECT_FALSE(Env::posix().stat(root + "/checkpoint_1").exists);
    EXPECT_EQ(temporaries(root), std::vector<std::string>{});
    save_directory(root + "/checkpoint_1", components(1));
    expect_valid(root + "/checkpoint_1", 1);
  }
}

// Thrown by the hook to stop a save dead at a chosen call, as a power cut would.
struct PowerCut {};

TEST(PowerCuts, AtEveryCallOnlyCommittedCheckpointsSurvive) {
  std::uint64_t cuts = 0;
  for (PowerCutMode mode :
       {PowerCutMode::DropUnsynced, PowerCutMode::RandomPrefix, PowerCutMode::Garbage}) {
    TempDir dir;
    std::string root = dir / "checkpoints";
    save_directory(root + "/checkpoint_0", components(0));
    for (std::uint64_t k = 1;; ++k) {
      SCOPED_TRACE(fmt::format("power cut ({}) before call {}", power_cut_mode_name(mode), k));
      FaultEnv env;
      std::uint64_t seen = 0;
      bool cut = false;
      env.set_before_op([&](Op, const std::string&) {
        if (++seen >= k) {
          cut = true;
          throw PowerCut{};
        }
      });
      bool committed = false;
      try {
        save_directory(root + "/checkpoint_1", components(1), {}, env);
        committed = true;
      } catch (const PowerCut&) {
      }
      env.set_before_op(nullptr);
      env.simulate_power_cut(mode, k);
      ++cuts;
      expect_valid(root + "/checkpoint_0", 0);
      if (committed) expect_valid(root + "/checkpoint_1", 1);
      if (Env::posix().stat(root + "/checkpoint_1").exists) {
        // Whatever survived under the final name must be complete.
        expect_valid(root + "/checkpoint_1", 1);
        Env::posix().remove_all(root + "/checkpoint_1");
      }
      if (!cut) break;
      ASSERT_LT(k, 1000u);
    }
  }
  EXPECT_GT(cuts, 60u);
  std::printf("power cuts simulated: %llu\n", static_cast<unsigned long long>(cuts));
}

}  // namespace
}  // namespace torchpoint
