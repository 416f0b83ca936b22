// The cairo renderer of records_plot.h. It needs neither LibTorch nor the rest of torchpoint:
// plot_series() and FitResult::plot() live in fit_plot.cc.
#include "torchpoint/records_plot.h"

#include <cairo-pdf.h>
#include <cairo-svg.h>
#include <cairo.h>
#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <exception>
#include <iterator>
#include <limits>
#include <memory>
#include <new>
#include <numbers>
#include <string>
#include <string_view>
#include <vector>

#include "torchpoint/error.h"

namespace torchpoint {
namespace {

// Geometry in px; records_plot.h states the canvas size these make.
constexpr double kWidth = 800, kWideWidth = 1000;  // one or two columns; three columns
constexpr double kRowHeight = 300;
constexpr double kTitleBand = 36;   // the title's baseline is at 24
constexpr double kLegendLine = 22;  // one line of legend entries
constexpr double kHeaderGap = 6;    // between the legend and the first row of panels
constexpr double kMargin = 16;      // left and right of the title and legend
constexpr double kPdfPointsPerPx = 0.75;
constexpr std::size_t kMaxPanels = 200;

struct Rgb {
  double r, g, b;
};

constexpr Rgb rgb(std::uint32_t hex) {
  return {static_cast<double>((hex >> 16) & 0xff) / 255,
          static_cast<double>((hex >> 8) & 0xff) / 255, static_cast<double>(hex & 0xff) / 255};
}

// Matplotlib's "tab10"; the 11th set and later reuse them, dashed, then dotted.
constexpr Rgb kPalette[] = {rgb(0x1f77b4), rgb(0xff7f0e), rgb(0x2ca02c), rgb(0xd62728),
                            rgb(0x9467bd), rgb(0x8c564b), rgb(0xe377c2), rgb(0x7f7f7f),
                            rgb(0xbcbd22), rgb(0x17becf)};
constexpr Rgb kText = rgb(0x222222), kTickText = rgb(0x444444), kGrid = rgb(0xe6e6e6),
              kFrame = rgb(0x888888), kNote = rgb(0x999999);

// ---------------------------------------------------------------------------------------------
// Text

// `text` as valid UTF-8 without control characters: anything else becomes U+FFFD, so cairo can
// draw it and XML can hold it.
std::string clean_text(std::string_view text) {
  static constexpr char32_t kSmallest[] = {0, 0, 0x80, 0x800, 0x10000};  // by sequence length
  std::string out;
  std::size_t i = 0;
  while (i < text.size()) {
    const auto lead = static_cast<unsigned char>(text[i]);
    const std::size_t length = lead < 0x80           ? 1
                               : (lead >> 5) == 0x6  ? 2
                               : (lead >> 4) == 0xe  ? 3
                               : (lead >> 3) == 0x1e ? 4
                                                     : 0;
    bool ok = length != 0 && i + length <= text.size();
    char32_t code = length == 1 ? lead : lead & (0x7fu >> length);
    for (std::size_t k = 1; ok && k < length; ++k) {
      const auto next = static_cast<unsigned char>(text[i + k]);
      ok = (next & 0xc0) == 0x80;
      code = (code << 6) | (next & 0x3f);
    }
    ok = ok && code >= kSmallest[length] && code <= 0x10ffff &&
         !(code >= 0xd800 && code <= 0xdfff) && code >= 0x20 && code != 0x7f && code != 0xfffe &&
         code != 0xffff;
    if (ok) {
      out.append(text.substr(i, length));
      i += length;
    } else {
      out += "\xef\xbf\xbd";
      ++i;
    }
  }
  return out;
}

std::string xml_escape(std::string_view text) {
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

enum class Font { Title, Heading, Legend, AxisName, Tick, Note };

void use_font(cairo_t* cr, Font font) {
  const bool bold = font == Font::Title || font == Font::Heading;
  cairo_select_font_face(cr, "sans-serif",
                         font == Font::Note ? CAIRO_FONT_SLANT_ITALIC : CAIRO_FONT_SLANT_NORMAL,
                         bold ? CAIRO_FONT_WEIGHT_BOLD : CAIRO_FONT_WEIGHT_NORMAL);
  double size = 12;
  switch (font) {
    case Font::Title:
      size = 16;
      break;
    case Font::Heading:
      size = 13;
      break;
    case Font::Tick:
      size = 11;
      break;
    default:
      break;
  }
  cairo_set_font_size(cr, size);
}

double text_width(cairo_t* cr, const std::string& text) {
  cairo_text_extents_t extents;
  cairo_text_extents(cr, text.c_str(), &extents);
  return extents.x_advance;
}

// `text` (clean UTF-8), cut at a character boundary and ended with an ellipsis when it is
// wider than `width` in the current font.
std::string fit_text(cairo_t* cr, std::string text, double width) {
  if (text_width(cr, text) <= width) return text;
  const std::string ellipsis = "\xe2\x80\xa6";
  while (!text.empty()) {
    text.pop_back();
    while (!text.empty() && (static_cast<unsigned char>(text.back()) & 0xc0) == 0x80) {
      text.pop_back();  // a continuation byte: drop the rest of the character
    }
    if (!text.empty() && (static_cast<unsigned char>(text.back()) & 0xc0) == 0xc0) {
      text.pop_back();  // a lead byte whose continuation bytes are gone
    }
    if (text_width(cr, text + ellipsis) <= width) break;
  }
  return text + ellipsis;
}

enum class Align { Left, Center, Right };

void show_text(cairo_t* cr, const std::string& text, double x, double baseline, Align align) {
  if (align != Align::Left) {
    const double width = text_width(cr, text);
    x -= align == Align::Center ? width / 2 : width;
  }
  cairo_move_to(cr, x, baseline);
  cairo_show_text(cr, text.c_str());
}

void set_color(cairo_t* cr, Rgb color) { cairo_set_source_rgb(cr, color.r, color.g, color.b); }

// The centre of the pixel `v` falls in: 1 px lines there are crisp in the PNG.
double snap(double v) { return std::floor(v) + 0.5; }

// ---------------------------------------------------------------------------------------------
// Axes

// The round step nearest `raw`: 1, 2 or 5 times a power of ten (so between 2/3 and 3/2 of it).
double nice_step(double raw) {
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  const double fraction = raw / magnitude;
  return (fraction < 1.5 ? 1 : fraction < 3.5 ? 2 : fraction < 7.5 ? 5 : 10) * magnitude;
}

// Labels for `ticks`, multiples of `step`, that differ from each other: as many decimals as the
// step needs (step 0.0001: 4; 1 or more: none), or scientific notation when fixed decimals
// would be long (values of a million and more, steps under 0.00001).
std::vector<std::string> tick_labels(const std::vector<double>& ticks, double step) {
  // step = m * 10^exponent with m in {1, 2, 5}; the epsilon absorbs pow()'s rounding.
  const int exponent = static_cast<int>(std::floor(std::log10(step) + 1e-9));
  double biggest = 0;
  for (double t : ticks) biggest = std::max(biggest, std::fabs(t));
  const bool fixed = exponent >= -5 && biggest < 1e6;
  // Scientific: enough digits after the point to reach the step's digit.
  const int leading = biggest > 0 ? static_cast<int>(std::floor(std::log10(biggest))) : exponent;
  int precision = std::max(0, fixed ? -exponent : leading - exponent);
  std::vector<std::string> labels;
  for (;; ++precision) {
    labels.clear();
    for (double t : ticks) {
      labels.push_back(fixed    ? fmt::format("{:.{}f}", t, precision)
                       : t == 0 ? std::string("0")
                                : fmt::format("{:.{}e}", t, precision));
    }
    // Rounding can still make two alike (steps near the precision of a double): add digits.
    if (std::adjacent_find(labels.begin(), labels.end()) == labels.end() || precision >= 17) {
      return labels;
    }
  }
}

// An axis: the range shown and its ticks.
struct Axis {
  double lo = 0, hi = 1;
  std::vector<double> ticks;
  std::vector<std::string> labels;
  // Where `v` lies from lo (0) to hi (1). Halves keep ranges near +-DBL_MAX finite.
  double fraction(double v) const { return (v / 2 - lo / 2) / (hi / 2 - lo / 2); }
};

// The y axis of values in [lo, hi] (finite; `any` false when there is none): the range with 5%
// to spare on each side, ticks about a fifth of it apart.
Axis value_axis(double lo, double hi, bool any) {
  constexpr double kMax = std::numeric_limits<double>::max();
  Axis axis;
  if (!any) {
    lo = 0;
    hi = 1;
  } else {
    // 5% of the span on each side. A span of (almost) nothing, or too small for a double's
    // digits to tell apart (1e-12 of the values), gets 10% of the value instead, or 1 around 0;
    // never less than 1e-300, so the step below is a normal positive double.
    const double half_span = hi / 2 - lo / 2, middle = lo / 2 + hi / 2;
    const bool flat = half_span < 1e-300 || half_span < std::fabs(middle) * 1e-12;
    const double pad = !flat                ? half_span / 10
                       : lo == 0 && hi == 0 ? 1
                                            : std::max(std::fabs(middle) / 10, 1e-300);
    lo = std::max(lo - pad, -kMax);
    hi = std::min(hi + pad, kMax);
  }
  axis.lo = lo;
  axis.hi = hi;
  const double step = nice_step((hi / 2 - lo / 2) / 2.5);
  // Three to eight multiples of the step lie in the range; the bound on k only guards against
  // rounding.
  const double first = std::ceil(lo / step), last = std::floor(hi / step);
  for (int k = 0; k < 20 && first + k <= last; ++k) {
    double t = (first + k) * step;
    if (std::fabs(t) < step * 1e-9) t = 0;  // not -0 or 1e-17 from rounding
    if (axis.ticks.empty() || t != axis.ticks.back()) axis.ticks.push_back(t);
  }
  axis.labels = tick_labels(axis.ticks, step);
  return axis;
}

// The x axis of epochs 1..`epochs`, with integer ticks about `count` of them.
Axis epoch_axis(std::size_t epochs, int count) {
  Axis axis;
  const double last = static_cast<double>(std::max<std::size_t>(epochs, 1));
  const double pad = last == 1 ? 0.5 : (last - 1) * 0.04;
  axis.lo = 1 - pad;
  axis.hi = last + pad;
  const double step = std::max(1.0, nice_step(std::max(last - 1, 1.0) / count));
  for (double t = step == 1 ? 1 : step; t <= last; t += step) {
    axis.ticks.push_back(t);
    axis.labels.push_back(fmt::format("{:.0f}", t));
  }
  return axis;
}

// ---------------------------------------------------------------------------------------------
// Layout

struct Panel {
  std::string heading;              // the metric's name, clean and fitted
  std::vector<std::size_t> series;  // indices into the input
  bool any_finite = false;
  Axis y;
  double x0 = 0, y0 = 0, width = 0, height = 0;     // the cell
  double left = 0, top = 0, right = 0, bottom = 0;  // the frame of the curves
};

struct LegendEntry {
  std::string text;
  std::size_t set = 0;
  double x = 0, y = 0;  // the start of the swatch; y is its middle
};

struct Figure {
  double width = kWidth, height = 0;
  std::size_t columns = 1;
  std::string title;                // clean and fitted
  std::vector<std::size_t> set_of;  // each input series' set: an index into the palette order
  std::vector<LegendEntry> legend;
  Axis epochs;
  std::vector<Panel> panels;
};

// A set's line: its colour, and after the first ten a dash pattern.
void use_set_style(cairo_t* cr, std::size_t set) {
  set_color(cr, kPalette[set % std::size(kPalette)]);
  static constexpr double kDashed[] = {7, 4}, kDotted[] = {2, 3};
  switch (set / std::size(kPalette) % 3) {
    case 0:
      cairo_set_dash(cr, nullptr, 0, 0);
      break;
    case 1:
      cairo_set_dash(cr, kDashed, 2, 0);
      break;
    default:
      cairo_set_dash(cr, kDotted, 2, 0);
  }
}

// Where everything goes. `cr` measures text; it draws nothing.
Figure lay_out(cairo_t* cr, const std::vector<PlotSeries>& series, const std::string& title) {
  Figure figure;
  std::vector<const std::string*> sets, metrics;
  auto index_of = [](std::vector<const std::string*>& names, const std::string& name) {
    auto it = std::find_if(names.begin(), names.end(),
                           [&](const std::string* known) { return *known == name; });
    if (it != names.end()) return static_cast<std::size_t>(it - names.begin());
    names.push_back(&name);
    return names.size() - 1;
  };
  std::size_t epochs = 1;
  for (std::size_t i = 0; i < series.size(); ++i) {
    figure.set_of.push_back(index_of(sets, series[i].set));
    const std::size_t metric = index_of(metrics, series[i].metric);
    if (metric == figure.panels.size()) {
      if (figure.panels.size() == kMaxPanels) {
        throw Error(ErrorCode::InvalidArgument,
                    fmt::format("cannot plot \"{}\": its series have more than {} metrics, which "
                                "makes too big a picture; plot fewer metrics at a time",
                                clean_text(title), kMaxPanels));
      }
      figure.panels.emplace_back().heading = clean_text(series[i].metric);
    }
    figure.panels[metric].series.push_back(i);
    epochs = std::max(epochs, series[i].values.size());
  }
  if (figure.panels.empty()) figure.panels.emplace_back().heading = "no metrics";

  const std::size_t count = figure.panels.size();
  figure.columns = count == 1 ? 1 : count <= 4 ? 2 : 3;
  figure.width = figure.columns == 3 ? kWideWidth : kWidth;
  const double cell_width = figure.width / static_cast<double>(figure.columns);

  use_font(cr, Font::Title);
  figure.title = fit_text(cr, clean_text(title), figure.width - 2 * kMargin);

  // Legend: a swatch and the set's name per set, in lines as wide as the canvas, each centred.
  use_font(cr, Font::Legend);
  constexpr double kSwatch = 24, kSwatchGap = 6, kEntryGap = 18;
  const double line_width = figure.width - 2 * kMargin;
  std::vector<std::vector<std::size_t>> lines(1);  // entries by line
  std::vector<double> line_widths(1, 0), entry_widths;
  for (std::size_t s = 0; s < sets.size(); ++s) {
    const std::string text = fit_text(cr, clean_text(*sets[s]), line_width / 2);
    const double width = kSwatch + kSwatchGap + text_width(cr, text);
    if (!lines.back().empty() && line_widths.back() + kEntryGap + width > line_width) {
      lines.emplace_back();
      line_widths.push_back(0);
    }
    line_widths.back() += (lines.back().empty() ? 0 : kEntryGap) + width;
    lines.back().push_back(s);
    entry_widths.push_back(width);
    figure.legend.push_back({text, s});
  }
  for (std::size_t l = 0; l < lines.size(); ++l) {
    double x = (figure.width - line_widths[l]) / 2;
    for (std::size_t e : lines[l]) {
      figure.legend[e].x = x;
      figure.legend[e].y = kTitleBand + kLegendLine * (static_cast<double>(l) + 0.5);
      x += entry_widths[e] + kEntryGap;
    }
  }
  const double header = kTitleBand + kLegendLine * static_cast<double>(lines.size()) + kHeaderGap;
  const std::size_t rows = (count + figure.columns - 1) / figure.columns;
  figure.height = header + kRowHeight * static_cast<double>(rows);

  figure.epochs = epoch_axis(epochs, std::max(2, static_cast<int>(cell_width / 70)));
  for (std::size_t p = 0; p < count; ++p) {
    Panel& panel = figure.panels[p];
    double lo = std::numeric_limits<double>::infinity(), hi = -lo;
    for (std::size_t i : panel.series) {
      for (double v : series[i].values) {
        if (!std::isfinite(v)) continue;
        lo = std::min(lo, v);
        hi = std::max(hi, v);
      }
    }
    panel.any_finite = lo <= hi;
    panel.y = value_axis(lo, hi, panel.any_finite);
    panel.x0 = cell_width * static_cast<double>(p % figure.columns);
    panel.y0 = header + kRowHeight * static_cast<double>(p / figure.columns);
    panel.width = cell_width;
    panel.height = kRowHeight;
    use_font(cr, Font::Tick);
    double labels = 0;
    for (const std::string& label : panel.y.labels) {
      labels = std::max(labels, text_width(cr, label));
    }
    panel.left = panel.x0 + 12 + labels + 7;
    panel.right = panel.x0 + panel.width - 16;
    panel.top = panel.y0 + 28;
    panel.bottom = panel.y0 + panel.height - 46;
    use_font(cr, Font::Heading);
    panel.heading = fit_text(cr, panel.heading, panel.right - panel.left);
  }
  return figure;
}

// ---------------------------------------------------------------------------------------------
// Drawing: one code path for every surface

void draw_panel(cairo_t* cr, const Figure& figure, const Panel& panel,
                const std::vector<PlotSeries>& series) {
  const double left = snap(panel.left), right = snap(panel.right);
  const double top = snap(panel.top), bottom = snap(panel.bottom);
  auto x_of = [&](double epoch) {
    return panel.left + figure.epochs.fraction(epoch) * (panel.right - panel.left);
  };
  auto y_of = [&](double v) {
    return panel.bottom - panel.y.fraction(v) * (panel.bottom - panel.top);
  };

  set_color(cr, kText);
  use_font(cr, Font::Heading);
  show_text(cr, panel.heading, (left + right) / 2, panel.y0 + 18, Align::Center);

  // Grid lines, ticks and their labels, then the frame over them.
  cairo_set_line_width(cr, 1);
  use_font(cr, Font::Tick);
  // A line in `color` from (x0, y0) to (x1, y1).
  auto line = [&](Rgb color, double x0, double y0, double x1, double y1) {
    set_color(cr, color);
    cairo_move_to(cr, x0, y0);
    cairo_line_to(cr, x1, y1);
    cairo_stroke(cr);
  };
  for (std::size_t i = 0; i < panel.y.ticks.size(); ++i) {
    const double y = snap(y_of(panel.y.ticks[i]));
    line(kGrid, left, y, right, y);
    line(kFrame, left - 4, y, left, y);
    set_color(cr, kTickText);
    show_text(cr, panel.y.labels[i], left - 7, y + 4, Align::Right);
  }
  for (std::size_t i = 0; i < figure.epochs.ticks.size(); ++i) {
    const double x = snap(x_of(figure.epochs.ticks[i]));
    line(kGrid, x, top, x, bottom);
    line(kFrame, x, bottom, x, bottom + 4);
    set_color(cr, kTickText);
    show_text(cr, figure.epochs.labels[i], x, bottom + 17, Align::Center);
  }
  set_color(cr, kFrame);
  cairo_rectangle(cr, left, top, right - left, bottom - top);
  cairo_stroke(cr);
  set_color(cr, kText);
  use_font(cr, Font::AxisName);
  show_text(cr, "epoch", (left + right) / 2, bottom + 36, Align::Center);
  if (!panel.any_finite) {
    set_color(cr, kNote);
    use_font(cr, Font::Note);
    show_text(cr, "no finite values", (left + right) / 2, (top + bottom) / 2 + 4, Align::Center);
  }

  // The curves: lines through runs of finite values, then a point per value.
  cairo_save(cr);
  cairo_rectangle(cr, left - 4, top - 4, right - left + 8, bottom - top + 8);
  cairo_clip(cr);
  cairo_set_line_width(cr, 2);
  cairo_set_line_join(cr, CAIRO_LINE_JOIN_ROUND);
  // Points shrink when epochs are close together, so that they do not hide the lines.
  const double per_epoch = (panel.right - panel.left) / (figure.epochs.hi - figure.epochs.lo);
  const double radius = std::clamp(per_epoch / 4, 1.5, 3.0);
  for (std::size_t i : panel.series) {
    const std::vector<double>& values = series[i].values;
    use_set_style(cr, figure.set_of[i]);
    bool drawing = false;
    for (std::size_t j = 0; j < values.size(); ++j) {
      if (!std::isfinite(values[j])) {
        drawing = false;
        continue;
      }
      const double x = x_of(static_cast<double>(j + 1)), y = y_of(values[j]);
      if (drawing) {
        cairo_line_to(cr, x, y);
      } else {
        cairo_move_to(cr, x, y);
      }
      drawing = true;
    }
    cairo_stroke(cr);
    for (std::size_t j = 0; j < values.size(); ++j) {
      if (!std::isfinite(values[j])) continue;
      cairo_new_sub_path(cr);
      cairo_arc(cr, x_of(static_cast<double>(j + 1)), y_of(values[j]), radius, 0,
                2 * std::numbers::pi);
    }
    cairo_fill(cr);
  }
  cairo_restore(cr);
}

void draw(cairo_t* cr, const Figure& figure, const std::vector<PlotSeries>& series) {
  set_color(cr, rgb(0xffffff));
  cairo_paint(cr);
  set_color(cr, kText);
  use_font(cr, Font::Title);
  show_text(cr, figure.title, figure.width / 2, 24, Align::Center);

  use_font(cr, Font::Legend);
  cairo_set_line_width(cr, 2);
  for (const LegendEntry& entry : figure.legend) {
    use_set_style(cr, entry.set);
    cairo_move_to(cr, entry.x, entry.y);
    cairo_line_to(cr, entry.x + 24, entry.y);
    cairo_stroke(cr);
    cairo_arc(cr, entry.x + 12, entry.y, 3, 0, 2 * std::numbers::pi);
    cairo_fill(cr);
    set_color(cr, kText);
    show_text(cr, entry.text, entry.x + 30, entry.y + 4, Align::Left);
  }
  cairo_set_dash(cr, nullptr, 0, 0);
  for (const Panel& panel : figure.panels) draw_panel(cr, figure, panel, series);
}

// ---------------------------------------------------------------------------------------------
// Surfaces and output

struct SurfaceDeleter {
  void operator()(cairo_surface_t* surface) const noexcept { cairo_surface_destroy(surface); }
};
struct ContextDeleter {
  void operator()(cairo_t* cr) const noexcept { cairo_destroy(cr); }
};
using Surface = std::unique_ptr<cairo_surface_t, SurfaceDeleter>;
using Context = std::unique_ptr<cairo_t, ContextDeleter>;

// Where cairo's stream functions write. It must outlive the surface: destroying an unfinished
// surface still writes.
struct PlotSink {
  std::string bytes;
  std::exception_ptr error;  // what appending threw (bad_alloc); cairo only sees WRITE_ERROR
};

cairo_status_t append_to_sink(void* closure, const unsigned char* data,
                              unsigned int length) noexcept {
  auto* sink = static_cast<PlotSink*>(closure);
  try {
    sink->bytes.append(reinterpret_cast<const char*>(data), length);
    return CAIRO_STATUS_SUCCESS;
  } catch (...) {
    sink->error = std::current_exception();
    return CAIRO_STATUS_WRITE_ERROR;
  }
}

const char* format_name(PlotFormat format) {
  switch (format) {
    case PlotFormat::Png:
      return "PNG";
    case PlotFormat::Svg:
      return "SVG";
    case PlotFormat::Pdf:
      return "PDF";
  }
  return "?";
}

// Throws for a failed cairo call: the sink's own exception first, bad_alloc for cairo's
// NO_MEMORY, else IOError with cairo's message.
void check(cairo_status_t status, const PlotSink& sink, const std::string& title, PlotFormat format) {
  if (sink.error) std::rethrow_exception(sink.error);
  if (status == CAIRO_STATUS_SUCCESS) return;
  if (status == CAIRO_STATUS_NO_MEMORY) throw std::bad_alloc();
  const char* what_to_do = status == CAIRO_STATUS_INVALID_SIZE
                               ? "the picture is too big: plot fewer series at a time"
                               : "check that a font is installed (Debian: fonts-dejavu-core)";
  throw Error(
      ErrorCode::IOError,
      fmt::format("cannot draw the plot \"{}\" as {}: cairo says \"{}\"; {}", clean_text(title),
                  format_name(format), cairo_status_to_string(status), what_to_do));
}

// Font settings every context gets: metrics unhinted, so text measures the same on every surface.
void set_font_options(cairo_t* cr) {
  std::unique_ptr<cairo_font_options_t, decltype(&cairo_font_options_destroy)> options(
      cairo_font_options_create(), &cairo_font_options_destroy);
  cairo_font_options_set_hint_metrics(options.get(), CAIRO_HINT_METRICS_OFF);
  cairo_set_font_options(cr, options.get());
}

Surface open_surface(PlotFormat format, const Figure& figure, const std::string& title,
                     PlotSink& sink) {
  switch (format) {
    case PlotFormat::Png:
      return Surface(cairo_image_surface_create(CAIRO_FORMAT_RGB24,
                                                static_cast<int>(std::lround(figure.width)),
                                                static_cast<int>(std::lround(figure.height))));
    case PlotFormat::Svg: {
      Surface surface(
          cairo_svg_surface_create_for_stream(append_to_sink, &sink, figure.width, figure.height));
      cairo_svg_surface_set_document_unit(surface.get(), CAIRO_SVG_UNIT_PX);
      return surface;
    }
    case PlotFormat::Pdf: {
      Surface surface(cairo_pdf_surface_create_for_stream(
          append_to_sink, &sink, figure.width * kPdfPointsPerPx, figure.height * kPdfPointsPerPx));
      cairo_pdf_surface_set_metadata(surface.get(), CAIRO_PDF_METADATA_TITLE,
                                     clean_text(title).c_str());
      cairo_pdf_surface_set_metadata(surface.get(), CAIRO_PDF_METADATA_CREATOR, "torchpoint");
      // No creation date (cairo would add the clock's): the same series give the same bytes.
      cairo_pdf_surface_set_metadata(surface.get(), CAIRO_PDF_METADATA_CREATE_DATE, "");
      return surface;
    }
  }
  throw Error(ErrorCode::InvalidArgument,
              fmt::format("cannot plot \"{}\": PlotFormat {} is none of Png, Svg, Pdf",
                          clean_text(title), static_cast<int>(format)));
}

// The records_plot.h metadata, placed as the first children of the <svg> element.
void add_svg_metadata(std::string& svg, const Figure& figure, const std::vector<PlotSeries>& series,
                      const std::string& title) {
  const std::string escaped_title = xml_escape(clean_text(title));
  std::string metadata = fmt::format(
      "<title>{}</title>\n<metadata>\n<plot xmlns=\"urn:torchpoint:records-plot\" title=\"{}\" "
      "width=\"{}\" height=\"{}\" panels=\"{}\" columns=\"{}\">\n",
      escaped_title, escaped_title, figure.width, figure.height, figure.panels.size(),
      figure.columns);
  for (const PlotSeries& s : series) {
    std::size_t points = 0, runs = 0;
    for (std::size_t j = 0; j < s.values.size(); ++j) {
      if (!std::isfinite(s.values[j])) continue;
      ++points;
      if (j == 0 || !std::isfinite(s.values[j - 1])) ++runs;
    }
    metadata += fmt::format(
        "<series data-set=\"{}\" data-metric=\"{}\" values=\"{}\" points=\"{}\" runs=\"{}\"/>\n",
        xml_escape(clean_text(s.set)), xml_escape(clean_text(s.metric)), s.values.size(), points,
        runs);
  }
  metadata += "</plot>\n</metadata>\n";
  const std::size_t start = svg.find("<svg");
  const std::size_t end = start == std::string::npos ? start : svg.find('>', start);
  if (end == std::string::npos) {
    throw Error(ErrorCode::IOError,
                fmt::format("cannot draw the plot \"{}\" as SVG: cairo wrote no <svg> element",
                            clean_text(title)));
  }
  svg.insert(end + 1, "\n" + metadata);
}

}  // namespace

PlotFormat plot_format_for(const std::string& path) {
  const std::size_t dot = path.rfind('.');
  std::string extension = dot == std::string::npos ? "" : path.substr(dot + 1);
  for (char& c : extension) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (extension == "png") return PlotFormat::Png;
  if (extension == "svg") return PlotFormat::Svg;
  if (extension == "pdf") return PlotFormat::Pdf;
  throw Error(ErrorCode::InvalidArgument,
              fmt::format("cannot plot to {}: its extension names no picture format; name the "
                          "file .png, .svg or .pdf",
                          path));
}

std::string render_records(const std::vector<PlotSeries>& series, const std::string& title,
                           PlotFormat format) {
  Figure figure;
  {
    Surface scratch(cairo_image_surface_create(CAIRO_FORMAT_RGB24, 1, 1));
    Context measure(cairo_create(scratch.get()));
    set_font_options(measure.get());
    figure = lay_out(measure.get(), series, title);
    check(cairo_status(measure.get()), PlotSink(), title, format);
  }

  PlotSink sink;  // declared before the surface, which may write to it until destroyed
  Surface surface = open_surface(format, figure, title, sink);
  check(cairo_surface_status(surface.get()), sink, title, format);
  {
    Context cr(cairo_create(surface.get()));
    set_font_options(cr.get());
    if (format == PlotFormat::Pdf) cairo_scale(cr.get(), kPdfPointsPerPx, kPdfPointsPerPx);
    draw(cr.get(), figure, series);
    check(cairo_status(cr.get()), sink, title, format);
  }
  if (format == PlotFormat::Png) {
    check(cairo_surface_write_to_png_stream(surface.get(), append_to_sink, &sink), sink, title,
          format);
  }
  cairo_surface_finish(surface.get());  // SVG and PDF write their last bytes here
  check(cairo_surface_status(surface.get()), sink, title, format);
  if (format == PlotFormat::Svg) add_svg_metadata(sink.bytes, figure, series, title);
  return std::move(sink.bytes);
}

}  // namespace torchpoint
