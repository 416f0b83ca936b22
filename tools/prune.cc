// torchpoint prune DIR --keep-last N [--keep-best METRIC --mode min|max] [--dry-run]
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <memory>

#include "commands.h"
#include "io/atomic_commit.h"
#include "io/filename.h"
#include "listing.h"
#include "output.h"
#include "torchpoint/env.h"
#include "torchpoint/error.h"

namespace torchpoint::tool {
namespace {

struct Decision {
  const ListedCheckpoint* entry;
  bool keep;
  std::vector<std::string> reasons;
};

// The retention rule, a pure function of the listing (oldest first):
// - the newest valid checkpoint is always kept;
// - the last `keep_last` valid ones are kept;
// - with a metric, the valid one with the best manifest metadata["metrics"][metric] is kept
//   (the earliest of equals; NaN never wins);
// - corrupt and uncommitted entries are never deleted and never counted: a corrupt one may be
//   a newer format or a transient read error, a temporary may belong to a save in progress;
// - every other valid checkpoint is deleted.
std::vector<Decision> plan(const Listing& listing, const PruneOptions& options) {
  std::vector<Decision> decisions;
  for (const ListedCheckpoint& e : listing.entries) decisions.push_back({&e, false, {}});
  std::size_t valid_seen = 0;
  for (auto it = decisions.rbegin(); it != decisions.rend(); ++it) {
    if (it->entry->status != Status::Valid) continue;
    if (valid_seen == 0) it->reasons.push_back("newest valid");
    if (valid_seen < options.keep_last) {
      it->reasons.push_back(fmt::format("last {}", options.keep_last));
    }
    if (valid_seen == 0 || valid_seen < options.keep_last) it->keep = true;
    ++valid_seen;
  }
  if (options.keep_best) {
    Decision* best = nullptr;
    double best_value = 0;
    for (Decision& d : decisions) {
      if (d.entry->status != Status::Valid) continue;
      std::optional<double> v = manifest_metric(*d.entry, *options.keep_best);
      if (!v || std::isnan(*v)) continue;
      bool better = options.mode == "max" ? *v > best_value : *v < best_value;
      if (!best || better) {
        best = &d;
        best_value = *v;
      }
    }
    if (!best) {
      throw Error(ErrorCode::NotFound,
                  fmt::format("no valid checkpoint in {} records the metric '{}' (read from "
                              "manifest metadata[\"metrics\"][\"{}\"]): nothing deleted, as the "
                              "best one cannot be told",
                              listing.dir, *options.keep_best, *options.keep_best));
    }
    best->keep = true;
    best->reasons.push_back(
        fmt::format("best {} {}={}", options.mode, *options.keep_best, format_double(best_value)));
  }
  for (Decision& d : decisions) {
    if (d.entry->status == Status::Corrupt) {
      d.keep = true;
      d.reasons.push_back("corrupt: not counted, not deleted (see torchpoint verify)");
    } else if (d.entry->status == Status::Uncommitted) {
      d.keep = true;
      d.reasons.push_back(
          is_temp_name(d.entry->name)
              ? "uncommitted: a save in progress, or a dead one's leftover that the next save "
                "removes"
              : "uncommitted (no manifest.json): not deleted; remove it by hand if no save is "
                "running");
    } else if (!d.keep) {
      d.reasons.push_back(options.keep_best
                              ? fmt::format("not in the last {}, not the best", options.keep_last)
                              : fmt::format("not in the last {}", options.keep_last));
    }
  }
  return decisions;
}

// Deletes one checkpoint so that a crash midway never leaves a damaged checkpoint under its
// name: a directory is first renamed to a temporary name (which a later save sweeps away).
void remove_checkpoint(Env& env, const Listing& listing, const ListedCheckpoint& entry) {
  if (!entry.is_directory) {
    env.remove_file(entry.path);
    return;
  }
  std::string doomed = join_path(listing.dir, temp_name(entry.name));
  env.rename(entry.path, doomed, /*replace=*/false);
  env.sync_dir(listing.dir);
  env.remove_all(doomed);
}

}  // namespace

int run_prune(const PruneOptions& options, std::ostream& out) {
  Env& env = Env::posix();
  Listing listing = list_checkpoints(options.dir);
  std::vector<Decision> decisions = plan(listing, options);
  if (options.dry_run) out << "dry run: nothing is deleted\n";
  if (decisions.empty()) {
    out << fmt::format("no checkpoints in {}\n", listing.dir);
    return kExitOk;
  }
  std::unique_ptr<ProjectLock> lock;
  // Saves into this directory hold its lock; deleting under a running save could race it.
  if (!options.dry_run) lock = std::make_unique<ProjectLock>(env, listing.dir);
  Table table({"ACTION", "NAME", "STATUS", "WHY"});
  std::size_t deleted = 0;
  for (const Decision& d : decisions) {
    table.add({d.keep ? "KEEP" : "DELETE", d.entry->name, status_name(d.entry->status),
               fmt::format("{}", fmt::join(d.reasons, "; "))});
  }
  table.print(out);
  if (!options.dry_run) {
    for (const Decision& d : decisions) {
      if (d.keep) continue;
      remove_checkpoint(env, listing, *d.entry);
      ++deleted;
    }
    if (deleted > 0) env.sync_dir(listing.dir);
  }
  std::size_t to_delete =
      std::count_if(decisions.begin(), decisions.end(), [](const Decision& d) { return !d.keep; });
  out << fmt::format("{} kept, {} {}\n", decisions.size() - to_delete, to_delete,
                     options.dry_run ? "would be deleted" : "deleted");
  return kExitOk;
}

}  // namespace torchpoint::tool
