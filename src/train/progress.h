// What fit() prints: a progress bar with ETA and the current loss on a terminal, one line per
// epoch otherwise, nothing when verbose is off.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <ostream>
#include <string>

namespace torchpoint::detail {

class Progress {
 public:
  // `out` null: print nothing. `terminal`: redraw one line in place.
  Progress(std::ostream* out, bool terminal) : out_(out), terminal_(terminal) {}

  void epoch_begin(std::int64_t epoch, std::int64_t epochs, std::int64_t batches);
  // `done` batches of the epoch's training finished; `loss` is the running mean.
  void batch(std::int64_t done, double loss);
  void epoch_end(const std::map<std::string, double>& metrics);
  void message(const std::string& text);

 private:
  using Clock = std::chrono::steady_clock;
  std::ostream* out_;
  bool terminal_;
  std::int64_t epoch_ = 0, epochs_ = 0, batches_ = 0;
  Clock::time_point start_;
  Clock::time_point last_draw_;
};

}  // namespace torchpoint::detail
