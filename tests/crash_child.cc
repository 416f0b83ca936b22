// Child of crash_test: saves checkpoints in a loop until it is killed.
//
// Usage: crash_child ROOT FIRST. Saves ROOT/checkpoint_FIRST, checkpoint_FIRST+1, ... each
// holding crash_state(i), prints "ready" once started and "committed i" after each save
// returns, and keeps the newest three (deleting older ones after each commit). With
// TORCHPOINT_CRASH_SHARDED=1, sharded and linking from the previous checkpoint (crash_state.h).
#include <cstdio>
#include <cstdlib>
#include <string>

#include "io/filename.h"
#include "tests/crash_state.h"
#include "torchpoint/checkpoint_dir.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: crash_child ROOT FIRST\n");
    return 2;
  }
  std::string root = argv[1];
  std::uint64_t i = std::strtoull(argv[2], nullptr, 10);
  std::printf("ready\n");
  std::fflush(stdout);
  for (;; ++i) {
    torchpoint::CheckpointInfo info;
    info.step = static_cast<std::int64_t>(i);
    std::string previous =
        i > 0 ? torchpoint::join_path(root, torchpoint::checkpoint_name(i - 1)) : std::string();
    torchpoint::save_directory(torchpoint::join_path(root, torchpoint::checkpoint_name(i)),
                               torchpoint::testing::crash_state(i), info,
                               torchpoint::Env::posix(),
                               torchpoint::testing::crash_options(previous));
    std::printf("committed %llu\n", static_cast<unsigned long long>(i));
    std::fflush(stdout);
    if (i >= 3) {
      torchpoint::Env::posix().remove_all(
          torchpoint::join_path(root, torchpoint::checkpoint_name(i - 3)));
    }
  }
}
