// torchpoint prune DIR --keep-last N [--keep-best METRIC --mode min|max] [--dry-run]
#include <fmt/format.h>

#include <algorithm>

#include "commands.h"
#include "output.h"
#include "torchpoint/checkpoint_manager.h"
#include "torchpoint/env.h"
#include "torchpoint/error.h"

namespace torchpoint::tool {
namespace {

// The library's retention policy over the listing (oldest first): the last `keep_last` valid
// checkpoints and, with a metric, the best one by manifest metadata["metrics"][metric]; the
// newest valid one always; corrupt and uncommitted entries are never deleted (a corrupt one
// may be a newer format or a transient read error, a temporary may belong to a save in
// progress).
std::vector<RetentionDecision> plan(const CheckpointListing& listing, const PruneOptions& options) {
  RetentionPolicy policy = RetentionPolicy().keep_last(options.keep_last);
  if (options.keep_best) {
    policy.best_metric(*options.keep_best).best_mode_max(options.mode == "max");
  }
  std::vector<RetentionDecision> decided;
  try {
    decided = plan_retention(listing, policy);
  } catch (const Error& e) {
    if (e.code() != ErrorCode::NotFound || !options.keep_best) throw;
    throw Error(ErrorCode::NotFound,
                fmt::format("no valid checkpoint in {} records the metric '{}' (read from "
                            "manifest metadata[\"metrics\"][\"{}\"]): nothing deleted, as the "
                            "best one cannot be told",
                            listing.dir, *options.keep_best, *options.keep_best));
  }
  for (std::size_t i = 0; i < decided.size(); ++i) {
    const ListedCheckpoint& e = listing.entries[i];
    if (e.status == CheckpointStatus::Uncommitted && !e.temporary) {
      // Not a temporary: no save will sweep it away.
      decided[i].reasons = {
          "uncommitted (no manifest.json): not deleted; remove it by hand if no save is "
          "running"};
    }
  }
  return decided;
}

}  // namespace

int run_prune(const PruneOptions& options, std::ostream& out) {
  CheckpointListing listing = list_checkpoints(options.dir);
  std::vector<RetentionDecision> decisions = plan(listing, options);
  if (options.dry_run) out << "dry run: nothing is deleted\n";
  if (decisions.empty()) {
    out << fmt::format("no checkpoints in {}\n", listing.dir);
    return kExitOk;
  }
  Table table({"ACTION", "NAME", "STATUS", "WHY"});
  for (std::size_t i = 0; i < decisions.size(); ++i) {
    const ListedCheckpoint& e = listing.entries[i];
    table.add({decisions[i].keep ? "KEEP" : "DELETE", e.name, checkpoint_status_name(e.status),
               fmt::format("{}", fmt::join(decisions[i].reasons, "; "))});
  }
  table.print(out);
  if (!options.dry_run) delete_checkpoints(listing, decisions);
  std::size_t to_delete = std::count_if(decisions.begin(), decisions.end(),
                                        [](const RetentionDecision& d) { return !d.keep; });
  out << fmt::format("{} kept, {} {}\n", decisions.size() - to_delete, to_delete,
                     options.dry_run ? "would be deleted" : "deleted");
  return kExitOk;
}

}  // namespace torchpoint::tool
