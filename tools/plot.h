// The SVG of `torchpoint plot`.
#pragma once

#include <string>
#include <vector>

#include "checkpoint_view.h"

namespace torchpoint::tool {

// A self-contained SVG document: x is the index of the value (epoch 1, 2, ...), y the value;
// one polyline per series (broken where a value is NaN or infinite), a point per value, axes
// with ticks, and a legend naming "set metric". All series share one y axis.
std::string render_svg(const std::vector<RecordSeries>& series, const std::string& title);

}  // namespace torchpoint::tool
