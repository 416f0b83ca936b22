// Child of concurrency_test: one of several writers that save into the same project at once,
// for several rounds.
//
// Usage: concurrency_child PROJECT WRITER STATUS_FD RESULT_PREFIX GO_FD RELEASE_FD
//                          [GO_FD RELEASE_FD ...]
//
// Round r (one GO_FD/RELEASE_FD pair each) builds an Accelerator over two models whose
// parameters identify WRITER, writes "R<writer>" to STATUS_FD and waits until that round's
// GO_FD reaches end of file (the parent closes it to start every writer at once). Then it saves
// checkpoint_r with Accelerator::save_state. A writer that gets the project lock writes
// "H<writer>" and keeps the lock until RELEASE_FD reaches end of file, so that the others meet
// it held. The outcome goes to RESULT_PREFIX_r.result, one line:
//   committed <path>
//   error <code> <milliseconds from GO to the error> <message>
// and "D<writer>" to STATUS_FD says the round is done. (<writer> is one byte.)
#include <poll.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>

#include "testing/fault_env.h"
#include "tests/concurrency_writer.h"
#include "torchpoint/accelerator.h"
#include "torchpoint/error.h"

namespace {

namespace tp = torchpoint;

// Waits until `fd` reaches end of file, for at most `limit`.
bool wait_for_eof(int fd, std::chrono::milliseconds limit) {
  auto deadline = std::chrono::steady_clock::now() + limit;
  char buf[64];
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd p{fd, POLLIN, 0};
    int left = static_cast<int>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                    deadline - std::chrono::steady_clock::now())
                                    .count());
    if (::poll(&p, 1, std::max(left, 1)) <= 0) continue;
    ssize_t n = ::read(fd, buf, sizeof buf);
    if (n == 0) return true;
    if (n < 0 && errno != EINTR) return false;
  }
  return false;
}

void report(int status_fd, char what, int writer) {
  char msg[2] = {what, static_cast<char>(writer)};
  [[maybe_unused]] ssize_t n = ::write(status_fd, msg, sizeof msg);  // atomic: under PIPE_BUF
}

// The posix Env, except that a writer who gets the lock announces it and holds it until the
// parent lets go.
class HoldingEnv : public tp::testing::FaultEnv {
 public:
  HoldingEnv(int status_fd, int release_fd, int writer)
      : status_fd_(status_fd), release_fd_(release_fd), writer_(writer) {}

  std::unique_ptr<tp::FileLock> lock(const std::string& path) override {
    std::unique_ptr<tp::FileLock> held = FaultEnv::lock(path);
    if (!announced_) {
      announced_ = true;
      report(status_fd_, 'H', writer_);
      wait_for_eof(release_fd_, std::chrono::seconds(30));
    }
    return held;
  }

 private:
  int status_fd_, release_fd_, writer_;
  bool announced_ = false;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc < 7 || (argc - 5) % 2 != 0) {
    std::fprintf(stderr,
                 "usage: concurrency_child PROJECT WRITER STATUS_FD RESULT_PREFIX GO_FD RELEASE_FD "
                 "[GO_FD RELEASE_FD ...]\n");
    return 2;
  }
  const std::string project = argv[1];
  const int writer = std::atoi(argv[2]);
  const int status_fd = std::atoi(argv[3]);
  const std::string result_prefix = argv[4];
  auto models = tp::testing::writer_models(writer);

  for (int round = 0; 5 + 2 * round < argc; ++round) {
    const int go_fd = std::atoi(argv[5 + 2 * round]);
    const int release_fd = std::atoi(argv[6 + 2 * round]);
    std::ofstream result(result_prefix + "_" + std::to_string(round) + ".result");
    HoldingEnv env(status_fd, release_fd, writer);
    tp::Accelerator acc(
        tp::ProjectConfiguration().project_dir(project).automatic_checkpoint_naming(true).iteration(
            round),
        env);
    acc.prepare(models.first, models.second);

    report(status_fd, 'R', writer);
    if (!wait_for_eof(go_fd, std::chrono::seconds(60))) {
      result << "error Timeout 0 the parent never started the writers\n";
      return 1;
    }
    auto start = std::chrono::steady_clock::now();
    try {
      std::string path = acc.save_state();
      result << "committed " << path << "\n";
    } catch (const tp::Error& e) {
      auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                    std::chrono::steady_clock::now() - start)
                    .count();
      result << "error " << tp::error_code_name(e.code()) << " " << ms << " " << e.what() << "\n";
    }
    result.close();
    report(status_fd, 'D', writer);
  }
  return 0;
}
