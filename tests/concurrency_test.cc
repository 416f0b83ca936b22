// R14: several processes save into one project directory at the same moment. Exactly one gets
// the project lock; the others fail within a second with Locked; every checkpoint that appears
// verifies and holds the tensors of exactly one writer.
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
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

// Starts writer `id` for as many rounds as there are go/release pipes, handing it the pipe ends
// it uses (everything else is close-on-exec).
pid_t spawn(const std::string& project, int id, const Pipe& status,
            const std::vector<std::unique_ptr<Pipe>>& go,
            const std::vector<std::unique_ptr<Pipe>>& release, const std::string& result_prefix) {
  std::vector<std::string> args = {CONCURRENCY_CHILD, project, std::to_string(id),
                                   std::to_string(status.write), result_prefix};
  std::vector<int> inherited = {status.write};
  for (std::size_t r = 0; r < go.size(); ++r) {
    args.push_back(std::to_string(go[r]->read));
    args.push_back(std::to_string(release[r]->read));
    inherited.push_back(go[r]->read);
    inherited.push_back(release[r]->read);
  }
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("fork failed");
  if (pid == 0) {
    // Only async-signal-safe calls between fork and exec.
    for (int fd : inherited) ::fcntl(fd, F_SETFD, 0);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  return pid;
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

// The two-byte messages of the writers ("R", "H" or "D" and a writer number). take() waits for
// messages of one kind and leaves the others for later: a quick writer may already announce the
// next round while the parent is still collecting this one.
class Inbox {
 public:
  explicit Inbox(int fd) : fd_(fd) {}

  // Waits until `want` messages of `kind` arrived or `limit` passed; removes and returns the
  // writers that sent them.
  std::vector<int> take(char kind, std::size_t want, std::chrono::milliseconds limit) {
    auto deadline = Clock::now() + limit;
    while (count(kind) < want && Clock::now() < deadline) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
      std::string two = read_within(fd_, 2, std::max(left, std::chrono::milliseconds(1)));
      if (two.size() != 2) break;
      pending_.emplace_back(two[0], two[1]);
    }
    std::vector<int> out;
    for (auto it = pending_.begin(); it != pending_.end() && out.size() < want;) {
      if (it->first == kind) {
        out.push_back(it->second);
        it = pending_.erase(it);
      } else {
        ++it;
      }
    }
    return out;
  }

 private:
  std::size_t count(char kind) const {
    return static_cast<std::size_t>(std::count_if(pending_.begin(), pending_.end(),
                                                  [&](const auto& m) { return m.first == kind; }));
  }

  int fd_;
  std::vector<std::pair<char, int>> pending_;
};

TEST(Concurrency, OneWriterHoldsTheLockTheOthersFailFastAndNothingMixes) {
  constexpr int kRounds = 3;
  int processes = 0, rounds = 0, locked = 0;
  std::int64_t slowest_ms = 0;
  for (int writers : {2, 3, 4}) {
    TempDir dir;
    const std::string project = dir / "proj";
    Pipe status;
    std::vector<std::unique_ptr<Pipe>> go, release;
    for (int r = 0; r < kRounds; ++r) {
      go.push_back(std::make_unique<Pipe>());
      release.push_back(std::make_unique<Pipe>());
    }
    std::vector<pid_t> pids;
    for (int id = 0; id < writers; ++id) {
      pids.push_back(spawn(project, id, status, go, release, dir / fmt::format("writer_{}", id)));
    }
    processes += writers;
    // The parent's copies of the children's ends must go, or end of file never comes.
    status.close_write();
    for (int r = 0; r < kRounds; ++r) {
      go[r]->close_read();
      release[r]->close_read();
    }
    Inbox inbox(status.read);

    for (int round = 0; round < kRounds; ++round) {
      SCOPED_TRACE(
          fmt::format("{} writers, round {} (all save checkpoint_{})", writers, round, round));
      ++rounds;
      // Everyone is loaded and waiting: start them together.
      ASSERT_EQ(inbox.take('R', writers, std::chrono::seconds(60)).size(),
                static_cast<std::size_t>(writers));
      go[round]->close_write();

      // One writer announces the lock; the others finish while it still holds it (a second
      // holder would wait for the release too, and never finish).
      std::vector<int> holders = inbox.take('H', 1, std::chrono::seconds(10));
      ASSERT_EQ(holders.size(), 1u) << "no writer reported holding the lock";
      const int holder = holders[0];
      ASSERT_GE(holder, 0);
      ASSERT_LT(holder, writers);
      std::vector<int> done = inbox.take('D', writers - 1, std::chrono::seconds(10));
      EXPECT_EQ(done.size(), static_cast<std::size_t>(writers - 1))
          << "a writer neither failed nor got the lock";
      EXPECT_EQ(std::count(done.begin(), done.end(), holder), 0)
          << "the holder finished while holding the lock";
      EXPECT_EQ(inbox.take('H', 1, std::chrono::milliseconds(50)), std::vector<int>{})
          << "a second writer got the lock";
      release[round]->close_write();
      EXPECT_EQ(inbox.take('D', 1, std::chrono::seconds(30)), std::vector<int>{holder});

      for (int id = 0; id < writers; ++id) {
        Outcome o = read_outcome(dir / fmt::format("writer_{}_{}.result", id, round));
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
    for (pid_t pid : pids) EXPECT_TRUE(reap(pid, std::chrono::seconds(10)));

    // Every checkpoint in the project verifies and holds exactly one writer's state.
    int checkpoints = 0;
    for (const std::string& name : testing::list_sorted(project + "/checkpoints")) {
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
      "concurrency: %d writer processes, %d rounds (2, 3 and 4 writers released together); one "
      "lock holder per round, %d refused with Locked (slowest refusal %lld ms), 0 mixed "
      "checkpoints\n",
      processes, rounds, locked, static_cast<long long>(slowest_ms));
}

}  // namespace
}  // namespace torchpoint
