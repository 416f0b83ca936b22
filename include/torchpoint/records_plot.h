// Pictures of metric records, as luz's plot(results) draws them: one panel per metric, each
// with its own y scale, one curve per set (train, valid, ...) over the epochs. Drawn with cairo
// as PNG, SVG or PDF.
#pragma once

#include <string>
#include <vector>

#include "torchpoint/error.h"

namespace torchpoint {

class MetricRecords;

// One curve: the values of (set, metric), one per epoch.
struct PlotSeries {
  std::string set;
  std::string metric;
  std::vector<double> values;
};

enum class PlotFormat { Png, Svg, Pdf };

// The format a file name asks for by its extension: .png, .svg or .pdf, in any case. Throws
// InvalidArgument naming `path` and the three extensions otherwise.
PlotFormat plot_format_for(const std::string& path);

// The picture of `series` as the bytes of a file of `format`; nothing is written anywhere.
//
// One panel per metric, in the order the metrics first appear, laid out in a grid: one column
// for one metric, two for up to four, three for more. The canvas is 800 px wide (1000 px with
// three columns) and 64 + 300 x rows px tall, plus 22 px for each extra line the legend needs
// when the set names do not fit on one. No series at all make one empty panel. A PNG is 8-bit RGB
// of that many pixels, an SVG has that many CSS px, a PDF page 0.75 pt per px (the same size at 96
// dpi).
//
// The title is at the top, under it a legend naming the sets; a set has the same colour in
// every panel. A panel is headed by its metric's name; x is the epoch (1, 2, ...: integer
// ticks), y the value, with tick labels whose decimals follow the tick step so that no two are
// the same (scientific notation for huge or tiny values). Each value is a point; consecutive
// finite values are joined by a line, which NaN and infinite values break. A metric without
// any finite value gets an empty, labelled panel. Names that are not valid UTF-8, and control
// characters, are shown as U+FFFD; names too long for their place end in an ellipsis.
//
// The SVG draws text as glyph outlines, so for programs that read it the first children of
// its <svg> element are <title> with the title, and
//   <metadata><plot xmlns="urn:torchpoint:records-plot" title="..." width="800" height="364"
//       panels="1" columns="1">
//     <series data-set="train" data-metric="loss" values="4" points="3" runs="2"/> ...
//   </plot></metadata>
// with one <series> per element of `series`, in order: `values` is the number of values,
// `points` the number of finite ones (the points drawn), `runs` the number of runs of
// consecutive finite values (each drawn as one line; a run of one value is a lone point).
// Texts there are XML-escaped after the U+FFFD replacement above.
//
// The bytes depend only on the arguments (and cairo and the fonts installed): the PDF has no
// creation date. Throws InvalidArgument for more than 200 metrics, std::bad_alloc when memory
// runs out, and IOError with cairo's own message when cairo cannot draw otherwise (no usable
// font). Thread-safe: calls share no state.
//
// Example:
//   std::string png = render_records({{"train", "loss", {0.9, 0.5, 0.4}}}, "run 7",
//                                    PlotFormat::Png);
std::string render_records(const std::vector<PlotSeries>& series, const std::string& title,
                           PlotFormat format);

// Every series of `records`, in the order first recorded.
std::vector<PlotSeries> plot_series(const MetricRecords& records);

}  // namespace torchpoint
