// torchpoint ls DIR: the checkpoints of a directory, oldest first, the latest valid marked.
#include <fmt/format.h>

#include <algorithm>

#include "torchpoint/inspect.h"
#include "commands.h"
#include "output.h"
#include "torchpoint/checkpoint_manager.h"

namespace torchpoint::tool {
namespace {

std::string metrics_text(const ListedCheckpoint& entry) {
  if (!entry.metadata.is_object()) return "-";
  auto metrics = entry.metadata.find("metrics");
  if (metrics == entry.metadata.end() || !metrics->is_object() || metrics->empty()) return "-";
  std::string text;
  for (const auto& [name, value] : metrics->items()) {
    if (!text.empty()) text += ",";
    text += name + "=" + (value.is_number() ? format_double(value.get<double>()) : value.dump());
  }
  return text;
}

Json to_json(const CheckpointListing& listing) {
  Json entries = Json::array();
  Json latest = nullptr;
  for (const ListedCheckpoint& e : listing.entries) {
    if (e.latest) latest = e.name;
    Json metrics = nullptr;
    if (e.metadata.is_object() && e.metadata.contains("metrics")) metrics = e.metadata["metrics"];
    entries.push_back({
        {"name", e.name},
        {"path", e.path},
        {"kind", e.is_directory ? "directory" : "file"},
        {"number", e.number ? Json(*e.number) : Json(nullptr)},
        {"step", e.step ? Json(*e.step) : Json(nullptr)},
        {"processes", e.is_directory ? Json(world_size_of(e.metadata)) : Json(nullptr)},
        {"size_bytes", e.size_bytes},
        {"shared_bytes", e.shared_bytes},
        {"modified_unix_ms", e.commit_time_ms},
        {"modified", iso_time(e.commit_time_ms)},
        {"status", checkpoint_status_name(e.status)},
        {"latest", e.latest},
        {"metrics", metrics},
        {"problems", e.problems},
    });
  }
  return {{"directory", listing.dir}, {"latest", latest}, {"checkpoints", entries}};
}

}  // namespace

int run_ls(const LsOptions& options, std::ostream& out) {
  CheckpointListing listing = list_checkpoints(options.dir);
  if (options.json) {
    print_json(out, to_json(listing));
    return kExitOk;
  }
  if (listing.entries.empty()) {
    out << fmt::format("no checkpoints in {}\n", listing.dir);
    return kExitOk;
  }
  out << fmt::format(
      "checkpoints in {} (* = the latest valid one, which loading the latest picks; SHARED = "
      "bytes of SIZE in files hard-linked with other checkpoints)\n",
      listing.dir);
  Table table(
      {" ", "NAME", "NUMBER", "STEP", "PROCS", "SIZE", "SHARED", "MODIFIED (UTC)", "METRICS",
       "STATUS"});
  for (const ListedCheckpoint& e : listing.entries) {
    table.add({e.latest ? "*" : " ", e.name + (e.is_directory ? "/" : ""),
               e.number ? std::to_string(*e.number) : "-", e.step ? std::to_string(*e.step) : "-",
               e.is_directory ? std::to_string(world_size_of(e.metadata)) : "-",
               std::to_string(e.size_bytes), std::to_string(e.shared_bytes),
               iso_time(e.commit_time_ms), metrics_text(e),
               checkpoint_status_name(e.status)});
  }
  table.print(out);
  for (const ListedCheckpoint& e : listing.entries) {
    if (e.status == CheckpointStatus::Corrupt && !e.problems.empty()) {
      out << fmt::format("{}: {}{}\n", e.name, e.problems.front(),
                         e.problems.size() > 1 ? fmt::format(" (and {} more: torchpoint verify {})",
                                                             e.problems.size() - 1, e.path)
                                               : "");
    }
  }
  if (!std::any_of(listing.entries.begin(), listing.entries.end(),
                   [](const ListedCheckpoint& e) { return e.latest; })) {
    out << "no valid checkpoint: there is nothing to resume from\n";
  }
  return kExitOk;
}

}  // namespace torchpoint::tool
