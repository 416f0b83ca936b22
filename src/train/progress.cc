#include "train/progress.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace torchpoint::detail {
namespace {

std::string duration(double seconds) {
  auto s = static_cast<std::int64_t>(std::max(0.0, std::round(seconds)));
  if (s >= 3600) return fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60);
  return fmt::format("{}:{:02}", s / 60, s % 60);
}

}  // namespace

void Progress::epoch_begin(std::int64_t epoch, std::int64_t epochs, std::int64_t batches) {
  epoch_ = epoch;
  epochs_ = epochs;
  batches_ = batches;
  start_ = Clock::now();
  last_draw_ = Clock::time_point();
}

void Progress::batch(std::int64_t done, double loss) {
  if (out_ == nullptr || !terminal_) return;
  auto now = Clock::now();
  // Redrawing costs more than a small batch: at most ten times a second, and at the end.
  if (done < batches_ && now - last_draw_ < std::chrono::milliseconds(100)) return;
  last_draw_ = now;
  double elapsed = std::chrono::duration<double>(now - start_).count();
  double eta = done > 0 ? elapsed / static_cast<double>(done) *
                              static_cast<double>(std::max<std::int64_t>(0, batches_ - done))
                        : 0.0;
  constexpr int kWidth = 30;
  int filled = batches_ > 0 ? static_cast<int>(kWidth * done / batches_) : kWidth;
  std::string bar(static_cast<std::size_t>(filled), '=');
  if (filled < kWidth) bar += '>';
  bar.resize(kWidth, ' ');
  *out_ << fmt::format("\rEpoch {}/{} [{}] {}/{} ETA {} loss: {:.4f}\x1b[K", epoch_, epochs_, bar,
                       done, batches_, duration(eta), loss)
        << std::flush;
}

void Progress::epoch_end(const std::map<std::string, double>& metrics) {
  if (out_ == nullptr) return;
  double elapsed = std::chrono::duration<double>(Clock::now() - start_).count();
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
  *out_ << text << '\n' << std::flush;
}

}  // namespace torchpoint::detail
