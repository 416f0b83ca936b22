// torchpoint verify PATH...: every problem of every checkpoint named.
#include <fmt/format.h>

#include "torchpoint/inspect.h"
#include "commands.h"
#include "output.h"
#include "torchpoint/accelerate_interop.h"
#include "torchpoint/env.h"
#include "torchpoint/tensor_file.h"

namespace torchpoint::tool {

int run_verify(const VerifyOptions& options, std::ostream& out, std::ostream& err) {
  int status = kExitOk;
  std::size_t valid = 0, invalid = 0, missing = 0;
  Json results = Json::array();
  for (const std::string& path : options.paths) {
    if (!Env::posix().stat(path).exists) {
      // Not a check that failed: there is nothing to check. Reported, and the others go on.
      std::string message = fmt::format("{} does not exist", path);
      err << "torchpoint verify: error: " << message << '\n';
      results.push_back({{"path", path}, {"ok", false}, {"error", message}});
      status = kExitError;
      ++missing;
      continue;
    }
    VerifyReport report;
    const bool accelerate = is_accelerate_checkpoint(path);
    if (accelerate) {
      // Python Accelerate writes no checksums: what can be checked is each file's structure,
      // its zip CRCs and its pickle's globals.
      report = verify_accelerate(path);
    } else {
      report = verify(path);
      // A checkpoint of several processes holds every rank's RNG states.
      for (std::string& p : missing_rank_files(path)) {
        report.add(std::move(p), ErrorCode::Corruption);
      }
    }
    results.push_back({{"path", path}, {"ok", report.ok()}, {"problems", report.problems}});
    if (report.ok()) {
      ++valid;
    } else {
      ++invalid;
      if (status == kExitOk) status = kExitCheckFailed;
    }
    if (options.json) continue;
    if (report.ok()) {
      out << fmt::format("valid    {}{}\n", path,
                         accelerate ? " (Python Accelerate: structure, zip CRCs and pickle "
                                      "globals checked; it has no checksums of its own)"
                                    : "");
    } else {
      out << fmt::format("INVALID  {} ({} problem{})\n", path, report.problems.size(),
                         report.problems.size() == 1 ? "" : "s");
      for (const std::string& p : report.problems) out << "  - " << p << '\n';
    }
  }
  if (options.json) {
    print_json(out, {{"ok", status == kExitOk}, {"results", results}});
  } else if (options.paths.size() > 1) {
    out << fmt::format("{} checked: {} valid, {} invalid{}\n", options.paths.size(), valid, invalid,
                       missing ? fmt::format(", {} missing", missing) : "");
  }
  return status;
}

}  // namespace torchpoint::tool
