// Pictures of metric records: the curves of every (set, metric) over the epochs, as luz's
// plot(results) draws them.
#pragma once

#include <string>
#include <vector>

#include "torchpoint/data_position.h"
#include "torchpoint/error.h"

namespace torchpoint {

// One curve: the values of (set, metric), one per epoch.
struct PlotSeries {
  std::string set;
  std::string metric;
  std::vector<double> values;
};

// Every series of `records`, in the order first recorded.
std::vector<PlotSeries> plot_series(const MetricRecords& records);

// A self-contained SVG document: x is the epoch (1, 2, ...), y the value; one polyline per
// series (broken where a value is NaN or infinite), a point per value, axes with ticks, and a
// legend naming "set metric". All series share one y axis.
std::string render_records_svg(const std::vector<PlotSeries>& series, const std::string& title);

// The same curves, grid and axes as an 8-bit RGB PNG image (without text: use the SVG for
// labels).
std::string render_records_png(const std::vector<PlotSeries>& series);

}  // namespace torchpoint
