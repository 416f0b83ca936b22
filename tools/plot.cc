// torchpoint plot PATH OUT: the metric curves of a checkpoint's records, as OUT's extension
// (.png, .svg or .pdf) asks.
#include <fmt/format.h>

#include <filesystem>

#include "commands.h"
#include "output.h"
#include "torchpoint/error.h"
#include "torchpoint/inspect.h"
#include "torchpoint/records_plot.h"

namespace torchpoint::tool {
namespace {

// The checkpoint's own name ("checkpoint_3", "state.ckpt"), trailing slashes aside: the title.
std::string title_of(std::string path) {
  while (path.size() > 1 && path.back() == '/') path.pop_back();
  return std::filesystem::path(path).filename().string();
}

}  // namespace

int run_plot(const PlotOptions& options, std::ostream& out) {
  // The format first: a wrong extension is reported before the checkpoint is read.
  const PlotFormat format = plot_format_for(options.output);
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
  std::vector<PlotSeries> curves;
  for (const RecordSeries& s : series) curves.push_back({s.set, s.metric, s.values});
  write_file_atomically(options.output, render_records(curves, title_of(view.path), format));
  out << fmt::format("wrote {} series to {}\n", series.size(), options.output);
  return kExitOk;
}

}  // namespace torchpoint::tool
