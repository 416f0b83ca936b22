// The Learner's side of records_plot.h: the series of MetricRecords, and FitResult::plot
// (luz's plot(results)). Kept out of records_plot.cc, whose renderer needs no LibTorch.
#include "io/atomic_commit.h"
#include "torchpoint/data_position.h"
#include "torchpoint/env.h"
#include "torchpoint/learner.h"
#include "torchpoint/records_plot.h"

namespace torchpoint {

std::vector<PlotSeries> plot_series(const MetricRecords& records) {
  std::vector<PlotSeries> out;
  for (const auto& [set, metric] : records.series()) {
    out.push_back({set, metric, records.values(set, metric)});
  }
  return out;
}

void FitResult::plot(const std::string& path) const {
  // The format first: a wrong extension throws before anything is drawn or written.
  const PlotFormat format = plot_format_for(path);
  write_file_atomically(Env::posix(), path,
                        render_records(plot_series(records), "metrics by epoch", format));
}

}  // namespace torchpoint
