// SIGKILLs a child process that saves checkpoints in a loop, at random moments, and checks
// after every kill that the newest committed checkpoint loads, verifies and holds exactly the
// state saved under its name, and that every save the child reported as committed survived.
#include <fcntl.h>
#include <poll.h>
#include <sys/stat.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <random>
#include <sstream>
#include <thread>

#include "io/filename.h"
#include "testing/test_util.h"
#include "tests/crash_state.h"
#include "torchpoint/checkpoint_dir.h"
#include "torchpoint/error.h"

namespace torchpoint {
namespace {

struct Child {
  pid_t pid;
  int out;  // read end of the child's stdout
};

Child spawn(const std::string& root, std::uint64_t first) {
  int fds[2];
  if (::pipe(fds) != 0) throw std::runtime_error("pipe failed");
  pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    ::dup2(fds[1], STDOUT_FILENO);
    ::close(fds[0]);
    ::close(fds[1]);
    std::string first_text = std::to_string(first);
    ::execl(CRASH_CHILD, CRASH_CHILD, root.c_str(), first_text.c_str(), nullptr);
    ::_exit(127);
  }
  ::close(fds[1]);
  return {pid, fds[0]};
}

// Reads the child's stdout line by line, keeping the numbers it reports committed.
class ChildOutput {
 public:
  explicit ChildOutput(int fd) : fd_(fd) {}

  // Reads until a line equal to `want`, or (with want empty) until the next "committed N"
  // line; false on EOF or after `timeout` without a line.
  bool wait_for(const std::string& want, std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    std::string line;
    char c;
    while (true) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      struct pollfd p = {fd_, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) return false;
      if (::read(fd_, &c, 1) != 1) return false;
      if (c != '\n') {
        line += c;
        continue;
      }
      bool commit = take(line);
      if (want.empty() ? commit : line == want) return true;
      line.clear();
    }
  }

  // Everything left after the child died.
  void drain() {
    std::string text;
    char buf[4096];
    ssize_t n;
    while ((n = ::read(fd_, buf, sizeof buf)) > 0) text.append(buf, n);
    std::istringstream in(text);
    std::string line;
    while (std::getline(in, line)) take(line);
  }

  const std::vector<std::uint64_t>& committed() const { return committed_; }

 private:
  bool take(const std::string& line) {
    std::istringstream in(line);
    std::string word;
    std::uint64_t i;
    if (in >> word && word == "committed" && in >> i) {
      committed_.push_back(i);
      return true;
    }
    return false;
  }

  int fd_;
  std::vector<std::uint64_t> committed_;
};

void expect_holds(const std::string& path, std::uint64_t i) {
  VerifyReport report = verify(path);
  ASSERT_TRUE(report.ok()) << path << ": " << report.problems.front();
  DirectoryCheckpoint loaded = load_directory(path);
  std::vector<Component> expected = testing::crash_state(i);
  ASSERT_EQ(loaded.components.size(), expected.size()) << path;
  EXPECT_EQ(loaded.info.step, static_cast<std::int64_t>(i));
  for (std::size_t c = 0; c < expected.size(); ++c) {
    const auto& a = expected[c].contents.tensors;
    const auto& b = loaded.components[c].contents.tensors;
    ASSERT_EQ(a.size(), b.size());
    for (std::size_t t = 0; t < a.size(); ++t) {
      EXPECT_TRUE(testing::bitwise_equal(a[t].second, b[t].second)) << path << " " << a[t].first;
    }
  }
}

void sigkill_at_random_moments(int default_kills) {
  const char* kills_env = std::getenv("TORCHPOINT_CRASH_KILLS");
  const int kills = kills_env ? std::atoi(kills_env) : default_kills;
  const char* seed_env = std::getenv("TORCHPOINT_CRASH_SEED");
  const std::uint64_t seed =
      seed_env ? std::strtoull(seed_env, nullptr, 10) : std::random_device{}();
  std::printf("crash test: %d kills, seed %llu (replay with TORCHPOINT_CRASH_SEED)\n", kills,
              static_cast<unsigned long long>(seed));
  std::mt19937_64 rng(seed);
  testing::TempDir dir;
  std::string root = dir / "checkpoints";
  std::uint64_t next = 0;
  std::uint64_t total_commits = 0;
  std::uint64_t newest_reported = 0;
  bool any_reported = false;
  std::uint64_t window_us = 40'000;
  for (int k = 0; k < kills; ++k) {
    SCOPED_TRACE(fmt::format("kill {} of {}, seed {}", k + 1, kills, seed));
    Child child = spawn(root, next);
    ChildOutput out(child.out);
    ASSERT_TRUE(out.wait_for("ready", std::chrono::seconds(120))) << "the child did not start";
    // Every other kill waits for the child's first commit of this run, so that half the kills
    // land in a loop that has committed and is saving again, however slow the build (the
    // sanitized one) or the machine; the others may also land before the first commit.
    if (k % 2 == 1) {
      ASSERT_TRUE(out.wait_for("", std::chrono::seconds(120))) << "the child committed nothing";
    }
    // Then 0–40 ms more: mid-file, mid-rename, after commit. On a loaded machine saves are
    // slower; the window widens while kills find no commit.
    std::this_thread::sleep_for(std::chrono::microseconds(rng() % window_us));
    ::kill(child.pid, SIGKILL);
    int status = 0;
    ::waitpid(child.pid, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "status " << status;
    out.drain();
    const std::vector<std::uint64_t>& reported = out.committed();
    ::close(child.out);
    total_commits += reported.size();
    if (reported.empty()) window_us = std::min<std::uint64_t>(window_us * 3 / 2, 1'000'000);
    if (!reported.empty()) {
      newest_reported = reported.back();
      any_reported = true;
    }

    // Committed checkpoints present now, by number.
    std::vector<std::uint64_t> present;
    if (Env::posix().stat(root).exists) {
      for (const std::string& name : Env::posix().list_dir(root)) {
        if (auto n = parse_checkpoint_name(name)) present.push_back(*n);
      }
    }
    std::sort(present.begin(), present.end());
    if (any_reported) {
      // Retention keeps the newest three, so every reported save newer than that survives.
      ASSERT_FALSE(present.empty());
      EXPECT_GE(present.back(), newest_reported);
      for (std::uint64_t i = newest_reported >= 2 ? newest_reported - 2 : 0; i <= newest_reported;
           ++i) {
        EXPECT_TRUE(std::binary_search(present.begin(), present.end(), i))
            << "checkpoint_" << i << " was reported committed but is gone";
      }
    }
    if (!present.empty()) {
      expect_holds(join_path(root, checkpoint_name(present.back())), present.back());
      next = present.back() + 1;
    }
    if (::testing::Test::HasFatalFailure()) return;
  }
  std::printf("crash test: %d kills, %llu commits observed, newest checkpoint_%llu\n", kills,
              static_cast<unsigned long long>(total_commits),
              static_cast<unsigned long long>(next == 0 ? 0 : next - 1));
  // The next writer sweeps what the killed ones left behind.
  save_directory(join_path(root, checkpoint_name(next)), testing::crash_state(next), {},
                 Env::posix(),
                 testing::crash_options(next > 0 ? join_path(root, checkpoint_name(next - 1))
                                                  : std::string()));
  for (const std::string& name : Env::posix().list_dir(root)) {
    EXPECT_FALSE(is_temp_name(name)) << name << " was left behind";
  }
  if (testing::crash_sharded()) {
    // The saves did link: the last one shares its frozen shards with the one before.
    struct ::stat st;
    std::string shard = join_path(join_path(root, checkpoint_name(next)),
                                  "model-00001-of-00003.safetensors");
    ASSERT_EQ(::stat(shard.c_str(), &st), 0) << shard;
    EXPECT_GE(st.st_nlink, 2u) << shard;
  }
}

TEST(Crash, SigkillAtRandomMomentsNeverLosesOrTearsACommittedCheckpoint) {
  ::unsetenv("TORCHPOINT_CRASH_SHARDED");
  sigkill_at_random_moments(100);
}

// Kills during saves that hard-link the frozen shards of the previous checkpoint while
// retention deletes the oldest: every committed checkpoint stays whole on its own.
TEST(Crash, SigkillDuringIncrementalShardedSavesNeverTearsACommittedCheckpoint) {
  ::setenv("TORCHPOINT_CRASH_SHARDED", "1", 1);
  sigkill_at_random_moments(60);
  ::unsetenv("TORCHPOINT_CRASH_SHARDED");
}

}  // namespace
}  // namespace torchpoint
