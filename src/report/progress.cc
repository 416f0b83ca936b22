#include "report/progress.h"

#include <fmt/format.h>
#include <sys/ioctl.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>

namespace torchpoint::detail {
namespace {

constexpr std::int64_t kMaxBar = 40, kMinBar = 6;

std::string duration(double seconds) {
  auto s = static_cast<std::int64_t>(std::max(0.0, std::round(seconds)));
  if (s >= 3600) return fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60);
  return fmt::format("{}:{:02}", s / 60, s % 60);
}

// Batches per second, or seconds per batch when slower than one a second (as tqdm shows it).
std::string rate(std::int64_t done, double elapsed) {
  if (done <= 0 || elapsed <= 0) return "? batch/s";
  double per_second = static_cast<double>(done) / elapsed;
  if (per_second >= 1) return fmt::format("{:.2f} batch/s", per_second);
  return fmt::format("{:.2f} s/batch", 1 / per_second);
}

}  // namespace

int terminal_width(int fd) {
  winsize size{};
  if (::ioctl(fd, TIOCGWINSZ, &size) == 0 && size.ws_col > 0) return size.ws_col;
  if (const char* columns = std::getenv("COLUMNS")) {
    int value = std::atoi(columns);
    if (value > 0) return value;
  }
  return 80;
}

std::string Progress::bar_line(const std::string& label, std::int64_t done, std::int64_t batches,
                               std::int64_t timed, double elapsed, double loss) const {
  double eta = timed > 0 ? elapsed / static_cast<double>(timed) *
                               static_cast<double>(std::max<std::int64_t>(0, batches - done))
                         : 0.0;
  std::string head = label;
  std::string tail = fmt::format(" {}/{} {}<{} {}", done, batches, duration(elapsed),
                                 timed > 0 ? duration(eta) : "?", rate(timed, elapsed));
  if (std::isfinite(loss)) tail += fmt::format(" loss: {:.4f}", loss);
  const auto room = static_cast<std::int64_t>(width_) - 1;
  // The bar takes the columns the text leaves, between kMinBar and kMaxBar; on a terminal too
  // narrow for it, the text alone, cut at the edge.
  std::int64_t bar_width =
      std::min(kMaxBar, room - static_cast<std::int64_t>(head.size() + tail.size()) - 3);
  std::string line = head;
  if (bar_width >= kMinBar) {
    std::int64_t filled = batches > 0 ? bar_width * std::min(done, batches) / batches : bar_width;
    std::string bar(static_cast<std::size_t>(filled), '=');
    if (filled < bar_width) bar += '>';
    bar.resize(static_cast<std::size_t>(bar_width), ' ');
    line += " [" + bar + "]";
  }
  line += tail;
  if (static_cast<std::int64_t>(line.size()) > room) {
    line.resize(static_cast<std::size_t>(std::max<std::int64_t>(0, room)));
  }
  return line;
}

void Progress::epoch_begin(std::int64_t epoch, std::int64_t epochs, std::int64_t batches,
                           std::int64_t already_done) {
  epoch_ = epoch;
  epochs_ = epochs;
  batches_ = batches;
  already_done_ = already_done;
  start_ = now_();
  last_draw_ = Clock::time_point();
}

void Progress::draw(const std::string& label, std::int64_t done, std::int64_t batches,
                    std::int64_t timed, Clock::time_point start, double loss) {
  if (out_ == nullptr || !terminal_) return;
  auto now = now_();
  // Redrawing costs more than a small batch: at most ten times a second, and at the end.
  if (done < batches && now - last_draw_ < std::chrono::milliseconds(100)) return;
  last_draw_ = now;
  double elapsed = std::chrono::duration<double>(now - start).count();
  *out_ << '\r' << bar_line(label, done, batches, timed, elapsed, loss) << "\x1b[K" << std::flush;
}

void Progress::batch(std::int64_t done, double loss) {
  draw(fmt::format("Epoch {}/{}", epoch_, epochs_), done, batches_, done - already_done_, start_,
       loss);
}

void Progress::valid_begin(std::int64_t batches) {
  valid_batches_ = batches;
  valid_start_ = now_();
  last_draw_ = Clock::time_point();
}

void Progress::valid_batch(std::int64_t done, double loss) {
  draw(fmt::format("Epoch {}/{} valid", epoch_, epochs_), done, valid_batches_, done, valid_start_,
       loss);
}

void Progress::epoch_end(const std::map<std::string, double>& metrics) {
  if (out_ == nullptr) return;
  double elapsed = std::chrono::duration<double>(now_() - start_).count();
  std::string line = fmt::format("Epoch {}/{}", epoch_, epochs_);
  // Train values first, then validation, each in name order.
  for (const char* set : {"train_", "valid_"}) {
    for (const auto& [name, value] : metrics) {
      if (name.rfind(set, 0) == 0) line += fmt::format(" {}: {:.4f}", name, value);
    }
  }
  line += fmt::format(" ({:.1f} s)", elapsed);
  if (terminal_) *out_ << "\r\x1b[K";
  *out_ << line << '\n' << std::flush;
}

void Progress::message(const std::string& text) {
  if (out_ == nullptr) return;
  if (terminal_) *out_ << "\r\x1b[K";
  *out_ << text << '\n' << std::flush;
}

}  // namespace torchpoint::detail
