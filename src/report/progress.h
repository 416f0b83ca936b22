// What fit() prints: on a terminal, a progress bar redrawn in place for the training and the
// validation pass of each epoch (batches done, elapsed time, ETA, rate, running loss), fitted
// to the terminal's width; one line per epoch otherwise; nothing when verbose is off.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <ostream>
#include <string>

namespace torchpoint::detail {

// The width of the terminal on file descriptor `fd` (TIOCGWINSZ), else the COLUMNS variable,
// else 80.
int terminal_width(int fd);

class Progress {
 public:
  using Clock = std::chrono::steady_clock;

  // `out` null: print nothing. `terminal`: redraw one line in place, at most `width` - 1
  // columns wide (the last column is left free so that no terminal wraps the line). `now`
  // is the clock (tests pass their own).
  Progress(std::ostream* out, bool terminal, int width = 80,
           std::function<Clock::time_point()> now = &Clock::now)
      : out_(out), terminal_(terminal), width_(width), now_(std::move(now)) {}

  // An epoch of `batches` training batches begins, or continues after `already_done` of them
  // (a resumed fit): the rate and ETA count only the batches timed here.
  void epoch_begin(std::int64_t epoch, std::int64_t epochs, std::int64_t batches,
                   std::int64_t already_done = 0);
  // `done` batches of the epoch's training finished; `loss` is the running mean.
  void batch(std::int64_t done, double loss);
  // The validation pass of the epoch begins, with `batches` batches.
  void valid_begin(std::int64_t batches);
  // `done` batches of the validation pass finished.
  void valid_batch(std::int64_t done, double loss);
  void epoch_end(const std::map<std::string, double>& metrics);
  void message(const std::string& text);

  // The line drawn for `done` of `batches` batches, of which the last `timed` took `elapsed`
  // seconds, with the running `loss` (left out when NaN); exposed for tests.
  std::string bar_line(const std::string& label, std::int64_t done, std::int64_t batches,
                       std::int64_t timed, double elapsed, double loss) const;

 private:
  void draw(const std::string& label, std::int64_t done, std::int64_t batches, std::int64_t timed,
            Clock::time_point start, double loss);

  std::ostream* out_;
  bool terminal_;
  int width_;
  std::function<Clock::time_point()> now_;
  std::int64_t epoch_ = 0, epochs_ = 0, batches_ = 0, already_done_ = 0, valid_batches_ = 0;
  Clock::time_point start_, valid_start_, last_draw_;
};

}  // namespace torchpoint::detail
