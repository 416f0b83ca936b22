#include "torchpoint/records_plot.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>

#include "io/atomic_commit.h"
#include "torchpoint/error.h"
#include "torchpoint/learner.h"

namespace torchpoint {
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

// Where values land in the picture: the y range rounded to ticks, and the x range in epochs.
struct Layout {
  double lo = 0, hi = 1, step = 1, x_max = 2;
  double plot_w = kWidth - kLeft - kRight, plot_h = kHeight - kTop - kBottom;
  double px(double x) const { return kLeft + (x - 1) / (x_max - 1) * plot_w; }
  double py(double y) const { return kTop + (hi - y) / (hi - lo) * plot_h; }
};

Layout layout_of(const std::vector<PlotSeries>& series) {
  std::size_t longest = 0;
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (const PlotSeries& s : series) {
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
  Layout l;
  l.step = tick_step(hi - lo, 5);
  l.lo = std::floor(lo / l.step) * l.step;
  l.hi = std::ceil(hi / l.step) * l.step;
  l.x_max = std::max<double>(2, static_cast<double>(longest));
  return l;
}

}  // namespace

std::vector<PlotSeries> plot_series(const MetricRecords& records) {
  std::vector<PlotSeries> out;
  for (const auto& [set, metric] : records.series()) {
    out.push_back({set, metric, records.values(set, metric)});
  }
  return out;
}

std::string render_records_svg(const std::vector<PlotSeries>& series, const std::string& title) {
  const Layout l = layout_of(series);
  const double lo = l.lo, hi = l.hi, step = l.step, x_max = l.x_max;
  const double plot_w = l.plot_w, plot_h = l.plot_h;
  auto px = [&](double x) { return l.px(x); };
  auto py = [&](double y) { return l.py(y); };

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
    const PlotSeries& s = series[i];
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

namespace {

// A white RGB canvas with just enough drawing for the curves.
class Canvas {
 public:
  Canvas(int width, int height)
      : width_(width),
        height_(height),
        pixels_(static_cast<std::size_t>(width) * static_cast<std::size_t>(height) * 3, 255) {}

  void dot(int x, int y, std::array<std::uint8_t, 3> rgb, int radius) {
    for (int dy = -radius; dy <= radius; ++dy) {
      for (int dx = -radius; dx <= radius; ++dx) {
        if (dx * dx + dy * dy > radius * radius) continue;
        int px = x + dx, py = y + dy;
        if (px < 0 || py < 0 || px >= width_ || py >= height_) continue;
        std::size_t at = (static_cast<std::size_t>(py) * static_cast<std::size_t>(width_) +
                          static_cast<std::size_t>(px)) *
                         3;
        for (std::size_t c = 0; c < 3; ++c) pixels_[at + c] = rgb[c];
      }
    }
  }

  void line(double x0, double y0, double x1, double y1, std::array<std::uint8_t, 3> rgb,
            int radius) {
    double steps = std::max({1.0, std::fabs(x1 - x0), std::fabs(y1 - y0)});
    for (int i = 0; i <= static_cast<int>(steps); ++i) {
      double t = i / steps;
      dot(static_cast<int>(std::lround(x0 + (x1 - x0) * t)),
          static_cast<int>(std::lround(y0 + (y1 - y0) * t)), rgb, radius);
    }
  }

  // PNG: signature, IHDR, one IDAT holding a zlib stream of stored (uncompressed) deflate
  // blocks, IEND. Plots are small, so compression is not worth the code.
  std::string png() const {
    std::string raw;
    std::size_t row = static_cast<std::size_t>(width_) * 3;
    for (std::size_t y = 0; y < static_cast<std::size_t>(height_); ++y) {
      raw += '\0';  // filter type: none
      raw.append(reinterpret_cast<const char*>(&pixels_[y * row]), row);
    }
    std::string z = "\x78\x01";
    for (std::size_t at = 0;; at += 65535) {
      std::size_t n = std::min<std::size_t>(65535, raw.size() - at);
      bool last = at + n >= raw.size();
      z += static_cast<char>(last ? 1 : 0);
      z += static_cast<char>(n & 0xff);
      z += static_cast<char>(n >> 8);
      z += static_cast<char>(~n & 0xff);
      z += static_cast<char>((~n >> 8) & 0xff);
      z.append(raw, at, n);
      if (last) break;
    }
    std::uint32_t a = 1, b = 0;
    for (unsigned char c : raw) {
      a = (a + c) % 65521;
      b = (b + a) % 65521;
    }
    append_be32(z, (b << 16) | a);

    std::string ihdr;
    append_be32(ihdr, static_cast<std::uint32_t>(width_));
    append_be32(ihdr, static_cast<std::uint32_t>(height_));
    ihdr += std::string("\x08\x02\x00\x00\x00", 5);  // 8-bit RGB, no interlace
    std::string out = "\x89PNG\r\n\x1a\n";
    chunk(out, "IHDR", ihdr);
    chunk(out, "IDAT", z);
    chunk(out, "IEND", "");
    return out;
  }

 private:
  static void append_be32(std::string& out, std::uint32_t v) {
    for (int shift = 24; shift >= 0; shift -= 8) out += static_cast<char>((v >> shift) & 0xff);
  }
  static std::uint32_t crc32(const std::string& bytes) {
    std::uint32_t crc = 0xffffffffu;
    for (unsigned char c : bytes) {
      crc ^= c;
      for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0xedb88320u & (0u - (crc & 1u)));
    }
    return ~crc;
  }
  static void chunk(std::string& out, const char* type, const std::string& data) {
    append_be32(out, static_cast<std::uint32_t>(data.size()));
    std::string body = std::string(type) + data;
    out += body;
    append_be32(out, crc32(body));
  }

  int width_, height_;
  std::vector<std::uint8_t> pixels_;
};

std::array<std::uint8_t, 3> rgb_of(const char* hex) {
  auto value = std::stoul(std::string(hex + 1), nullptr, 16);
  return {static_cast<std::uint8_t>(value >> 16), static_cast<std::uint8_t>(value >> 8),
          static_cast<std::uint8_t>(value)};
}

}  // namespace

std::string render_records_png(const std::vector<PlotSeries>& series) {
  const Layout l = layout_of(series);
  Canvas canvas(static_cast<int>(kWidth), static_cast<int>(kHeight));
  const std::array<std::uint8_t, 3> grid = {224, 224, 224}, axis = {51, 51, 51};
  for (double y = l.lo; y <= l.hi + l.step / 2; y += l.step) {
    canvas.line(kLeft, l.py(y), kLeft + l.plot_w, l.py(y), grid, 0);
  }
  canvas.line(kLeft, kTop, kLeft, kTop + l.plot_h, axis, 0);
  canvas.line(kLeft, kTop + l.plot_h, kLeft + l.plot_w, kTop + l.plot_h, axis, 0);
  for (std::size_t i = 0; i < series.size(); ++i) {
    auto color = rgb_of(kColors[i % std::size(kColors)]);
    const std::vector<double>& v = series[i].values;
    for (std::size_t j = 0; j < v.size(); ++j) {
      if (!std::isfinite(v[j])) continue;
      double x = l.px(static_cast<double>(j + 1)), y = l.py(v[j]);
      canvas.dot(static_cast<int>(std::lround(x)), static_cast<int>(std::lround(y)), color, 3);
      if (j + 1 < v.size() && std::isfinite(v[j + 1])) {
        canvas.line(x, y, l.px(static_cast<double>(j + 2)), l.py(v[j + 1]), color, 1);
      }
    }
    // Legend swatch, where the SVG has its label.
    double ly = kTop + 10 + 20 * static_cast<double>(i), lx = kLeft + l.plot_w + 20;
    canvas.line(lx, ly, lx + 20, ly, color, 1);
  }
  return canvas.png();
}

void FitResult::plot(const std::string& path) const {
  auto ends_with = [&](std::string_view suffix) {
    return path.size() >= suffix.size() &&
           path.compare(path.size() - suffix.size(), suffix.size(), suffix) == 0;
  };
  std::string bytes;
  if (ends_with(".svg")) {
    bytes = render_records_svg(plot_series(records), "metrics by epoch");
  } else if (ends_with(".png")) {
    bytes = render_records_png(plot_series(records));
  } else {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("cannot plot to {}: name the file .svg or .png", path));
  }
  write_file_atomically(Env::posix(), path, bytes);
}

}  // namespace torchpoint
