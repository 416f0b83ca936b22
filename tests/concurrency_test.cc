// R14: several processes save into one project directory at the same moment. Exactly one gets
// the project lock; the others fail within a second with Locked; every checkpoint that appears
// verifies and holds the tensors of exactly one writer.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <optional>
#include <sstream>
#include <thread>

#include "io/filename.h"
#include "testing/test_util.h"
#include "tests/concurrency_writer.h"
#include "torchpoint/checkpoint_dir.h"
#include "torchpoint/error.h"

namespace torchpoint {
namespace {

using testing::TempDir;
using Clock = std::chrono::steady_clock;

struct Pipe {
  int read = -1, write = -1;
  Pipe() {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
    read = fds[0];
    write = fds[1];
  }
  ~Pipe() {
    close_read();
    close_write();
  }
  void close_read() {
    if (read >= 0) ::close(read);
    read = -1;
  }
  void close_write() {
    if (write >= 0) ::close(write);
    write = -1;
  }
};

// Reads exactly `n` bytes from `fd` within `limit`; returns what arrived.
std::string read_within(int fd, std::size_t n, std::chrono::milliseconds limit) {
  std::string out;
  auto deadline = Clock::now() + limit;
  while (out.size() < n && Clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (::poll(&p, 1, static_cast<int>(std::max<std::int64_t>(left.count(), 1))) <= 0) continue;
    char buf[64];
    ssize_t got = ::read(fd, buf, std::min(sizeof buf, n - out.size()));
    if (got <= 0) break;
    out.append(buf, static_cast<std::size_t>(got));
  }
  return out;
}

// Waits for `pid` to exit within `limit`; kills it otherwise. Returns whether it exited by
// itself with status 0.
bool reap(pid_t pid, std::chrono::milliseconds limit) {
  auto deadline = Clock::now() + limit;
  int status = 0;
  while (Clock::now() < deadline) {
    if (::waitpid(pid, &status, WNOHANG) == pid)
      return WIFEXITED(status) && WEXITSTATUS(status) == 0;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ::kill(pid, SIGKILL);
  ::waitpid(pid, &status, 0);
  return false;
}

struct Writer {
  pid_t pid = -1;
  std::string result_file;
};

// Starts writer `id`, handing it the ends of the pipes it uses (everything else is close-on-exec).
Writer spawn(const std::string& project, int id, std::int64_t iteration, const Pipe& status,
             const Pipe& go, const Pipe& release, const std::string& result_file) {
  std::vector<std::string> args = {CONCURRENCY_CHILD,
                                   project,
                                   std::to_string(id),
                                   std::to_string(iteration),
                                   std::to_string(status.write),
                                   std::to_string(go.read),
                                   std::to_string(release.read),
                                   result_file};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    // Only async-signal-safe calls between fork and exec.
    for (int fd : {status.write, go.read, release.read}) ::fcntl(fd, F_SETFD, 0);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  return {pid, result_file};
}

struct Outcome {
  std::string kind;  // "committed" or "error"
  std::string code;
  std::int64_t ms = -1;
  std::string text;  // the path, or the message
};

Outcome read_outcome(const std::string& file) {
  Outcome o;
  std::istringstream in(testing::read_bytes(file));
  in >> o.kind;
  if (o.kind == "error") in >> o.code >> o.ms;
  in >> std::ws;
  std::getline(in, o.text);
  return o;
}

// The writer whose tensors `c` holds, when every tensor of every component is that writer's.
std::optional<int> sole_writer(const DirectoryCheckpoint& c, int writers) {
  const std::vector<std::pair<std::string, std::vector<std::int64_t>>> expected[2] = {
      {{"weight", {8, 16}}, {"bias", {8}}}, {{"weight", {2, 8}}, {"bias", {2}}}};
  for (int w = 0; w < writers; ++w) {
    bool all = true;
    int which = 0;
    for (int m = 0; m < 2; ++m) {
      const std::string name = m == 0 ? "model" : "model_1";
      const Container* found = nullptr;
      for (const auto& comp : c.components) {
        if (comp.name == name) found = &comp.contents;
      }
      if (found == nullptr || found->tensors.size() != expected[m].size()) return std::nullopt;
      for (std::size_t t = 0; t < expected[m].size(); ++t, ++which) {
        all = all && found->tensors[t].first == expected[m][t].first &&
              testing::bitwise_equal(found->tensors[t].second,
                                     testing::writer_tensor(w, which, expected[m][t].second));
      }
    }
    if (all) return w;
  }
  return std::nullopt;
}

TEST(Concurrency, OneWriterHoldsTheLockTheOthersFailFastAndNothingMixes) {
  constexpr int kRounds = 2;
  int processes = 0, locked = 0;
  std::int64_t slowest_ms = 0;
  for (int writers : {2, 3, 4}) {
    TempDir dir;
    const std::string project = dir / "proj";
    for (int round = 0; round < kRounds; ++round) {
      SCOPED_TRACE(
          fmt::format("{} writers, round {} (all save checkpoint_{})", writers, round, round));
      Pipe status, go, release;
      std::vector<Writer> procs;
      for (int id = 0; id < writers; ++id) {
        procs.push_back(spawn(project, id, round, status, go, release,
                              dir / fmt::format("writer_{}_{}.result", round, id)));
      }
      processes += writers;
      // The parent's copies of the children's ends must go, or end of file never comes.
      status.close_write();
      go.close_read();
      release.close_read();

      // Everyone is loaded and waiting: start them together.
      std::string ready =
          read_within(status.read, static_cast<std::size_t>(writers), std::chrono::seconds(60));
      ASSERT_EQ(ready, std::string(static_cast<std::size_t>(writers), 'R'));
      go.close_write();

      std::string held = read_within(status.read, 2, std::chrono::seconds(10));
      ASSERT_EQ(held.size(), 2u) << "no writer reported holding the lock";
      ASSERT_EQ(held[0], 'H');
      const int holder = held[1];
      ASSERT_GE(holder, 0);
      ASSERT_LT(holder, writers);
      // The others finish while the holder still holds the lock.
      for (int id = 0; id < writers; ++id) {
        if (id != holder) {
          EXPECT_TRUE(reap(procs[id].pid, std::chrono::seconds(10))) << id;
        }
      }
      std::string more = read_within(status.read, 2, std::chrono::milliseconds(50));
      EXPECT_EQ(more, "") << "a second writer got the lock";
      release.close_write();
      EXPECT_TRUE(reap(procs[holder].pid, std::chrono::seconds(30)));

      for (int id = 0; id < writers; ++id) {
        Outcome o = read_outcome(procs[id].result_file);
        if (id == holder) {
          EXPECT_EQ(o.kind, "committed") << o.code << " " << o.text;
          EXPECT_EQ(o.text, project + "/checkpoints/" + checkpoint_name(round));
        } else {
          EXPECT_EQ(o.kind, "error") << "writer " << id << ": " << o.text;
          EXPECT_EQ(o.code, "Locked") << "writer " << id << ": " << o.text;
          EXPECT_NE(o.text.find("/checkpoints/.lock is held by another writer"), std::string::npos)
              << o.text;
          EXPECT_LT(o.ms, 1000) << "writer " << id << " waited before failing";
          slowest_ms = std::max(slowest_ms, o.ms);
          if (o.code == "Locked") ++locked;
        }
      }
    }
    // Every checkpoint in the project verifies and holds exactly one writer's state.
    std::vector<std::string> names = testing::list_sorted(project + "/checkpoints");
    int checkpoints = 0;
    for (const std::string& name : names) {
      EXPECT_FALSE(is_temp_name(name)) << name;
      if (!parse_checkpoint_name(name)) continue;
      ++checkpoints;
      const std::string path = project + "/checkpoints/" + name;
      EXPECT_TRUE(verify(path).ok()) << path;
      EXPECT_TRUE(sole_writer(load_directory(path), writers).has_value())
          << path << " does not hold the state of exactly one writer";
    }
    EXPECT_EQ(checkpoints, kRounds);
  }
  std::printf(
      "concurrency: %d writer processes in %d rounds of 2, 3 and 4; one lock holder per "
      "round, %d refused with Locked (slowest refusal %lld ms), 0 mixed checkpoints\n",
      processes, 3 * kRounds, locked, static_cast<long long>(slowest_ms));
}

}  // namespace
}  // namespace torchpoint
