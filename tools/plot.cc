// torchpoint plot PATH OUT.svg: the metric curves of a checkpoint's records.
#include "plot.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>

#include "commands.h"
#include "io/filename.h"
#include "output.h"
#include "torchpoint/error.h"

namespace torchpoint::tool {
namespace {

constexpr double kWidth = 760, kHeight = 440;
constexpr double kLeft = 70, kRight = 200, kTop = 40, kBottom = 50;
constexpr const char* kColors[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                   "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};

std::string escape(const std::string& text) {
  std::string out;
  for (char c : text) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

// A round step giving about `count` ticks over `span`.
double tick_step(double span, int count) {
  double raw = span / count;
  double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  double fraction = raw / magnitude;
  double nice = fraction <= 1 ? 1 : fraction <= 2 ? 2 : fraction <= 5 ? 5 : 10;
  return nice * magnitude;
}

}  // namespace

std::string render_svg(const std::vector<RecordSeries>& series, const std::string& title) {
  std::size_t longest = 0;
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (const RecordSeries& s : series) {
    longest = std::max(longest, s.values.size());
    for (double v : s.values) {
      if (std::isfinite(v)) {
        lo = std::min(lo, v);
        hi = std::max(hi, v);
      }
    }
  }
  if (!std::isfinite(lo)) {  // no finite value at all: an empty frame
    lo = 0;
    hi = 1;
  }
  if (lo == hi) {
    double pad = lo == 0 ? 1 : std::fabs(lo) * 0.1;
    lo -= pad;
    hi += pad;
  }
  double step = tick_step(hi - lo, 5);
  lo = std::floor(lo / step) * step;
  hi = std::ceil(hi / step) * step;
  double x_max = std::max<double>(2, static_cast<double>(longest));
  double plot_w = kWidth - kLeft - kRight, plot_h = kHeight - kTop - kBottom;
  auto px = [&](double x) { return kLeft + (x - 1) / (x_max - 1) * plot_w; };
  auto py = [&](double y) { return kTop + (hi - y) / (hi - lo) * plot_h; };

  std::string svg = fmt::format(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" "
      "viewBox=\"0 0 {0} {1}\" font-family=\"sans-serif\" font-size=\"12\">\n"
      "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
      "<text x=\"{2}\" y=\"24\" font-size=\"14\">{3}</text>\n",
      kWidth, kHeight, kLeft, escape(title));
  // Grid, ticks and labels.
  for (double y = lo; y <= hi + step / 2; y += step) {
    svg += fmt::format(
        "<line x1=\"{0}\" y1=\"{1:.2f}\" x2=\"{2}\" y2=\"{1:.2f}\" stroke=\"#e0e0e0\"/>\n"
        "<text x=\"{3}\" y=\"{4:.2f}\" text-anchor=\"end\">{5:.4g}</text>\n",
        kLeft, py(y), kLeft + plot_w, kLeft - 6, py(y) + 4, std::fabs(y) < step / 1e6 ? 0.0 : y);
  }
  double x_step = std::max(1.0, tick_step(x_max - 1, 8));
  for (double x = 1; x <= x_max + 1e-9; x += x_step) {
    svg += fmt::format(
        "<line x1=\"{0:.2f}\" y1=\"{1}\" x2=\"{0:.2f}\" y2=\"{2}\" stroke=\"#333\"/>\n"
        "<text x=\"{0:.2f}\" y=\"{3}\" text-anchor=\"middle\">{4}</text>\n",
        px(x), kTop + plot_h, kTop + plot_h + 5, kTop + plot_h + 19, x);
  }
  svg += fmt::format(
      "<line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\" stroke=\"#333\"/>\n"
      "<line x1=\"{0}\" y1=\"{2}\" x2=\"{3}\" y2=\"{2}\" stroke=\"#333\"/>\n"
      "<text x=\"{4}\" y=\"{5}\" text-anchor=\"middle\">epoch</text>\n"
      "<text x=\"16\" y=\"{6}\" text-anchor=\"middle\" transform=\"rotate(-90 16 {6})\">value"
      "</text>\n",
      kLeft, kTop, kTop + plot_h, kLeft + plot_w, kLeft + plot_w / 2, kHeight - 10,
      kTop + plot_h / 2);

  for (std::size_t i = 0; i < series.size(); ++i) {
    const RecordSeries& s = series[i];
    const char* color = kColors[i % std::size(kColors)];
    std::string label = s.set + " " + s.metric;
    svg += fmt::format("<g class=\"series\" data-set=\"{}\" data-metric=\"{}\">\n", escape(s.set),
                       escape(s.metric));
    // One polyline per run of finite values.
    std::string points;
    auto flush = [&] {
      if (!points.empty()) {
        svg += fmt::format(
            "<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"2\" points=\"{}\"/>\n", color,
            points);
      }
      points.clear();
    };
    for (std::size_t j = 0; j < s.values.size(); ++j) {
      double v = s.values[j];
      if (!std::isfinite(v)) {
        flush();
        continue;
      }
      if (!points.empty()) points += ' ';
      points += fmt::format("{:.2f},{:.2f}", px(static_cast<double>(j + 1)), py(v));
    }
    flush();
    for (std::size_t j = 0; j < s.values.size(); ++j) {
      if (!std::isfinite(s.values[j])) continue;
      svg += fmt::format("<circle cx=\"{:.2f}\" cy=\"{:.2f}\" r=\"2.5\" fill=\"{}\"/>\n",
                         px(static_cast<double>(j + 1)), py(s.values[j]), color);
    }
    double ly = kTop + 10 + 20 * static_cast<double>(i);
    double lx = kLeft + plot_w + 20;
    svg += fmt::format(
        "<line x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\" stroke=\"{3}\" stroke-width=\"2\"/>\n"
        "<text x=\"{4}\" y=\"{5}\">{6}</text>\n</g>\n",
        lx, ly, lx + 20, color, lx + 26, ly + 4, escape(label));
  }
  svg += "</svg>\n";
  return svg;
}

int run_plot(const PlotOptions& options, std::ostream& out) {
  CheckpointView view = open_checkpoint(options.path);
  std::vector<std::string> problems;
  std::vector<RecordSeries> series = metric_records(view, &problems);
  if (series.empty()) {
    std::string why = problems.empty() ? "" : ": " + problems.front();
    throw Error(ErrorCode::NotFound,
                fmt::format("{} holds no metric records (a 'records' component or 'records.' "
                            "keys with MetricRecords' state){}",
                            view.path, why));
  }
  std::string svg = render_svg(series, base_name(view.path));
  write_file_atomically(options.output, svg);
  out << fmt::format("wrote {} series to {}\n", series.size(), options.output);
  return kExitOk;
}

}  // namespace torchpoint::tool
