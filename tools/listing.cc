#include "listing.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>

#include "checkpoint_view.h"
#include "format/container.h"
#include "format/manifest.h"
#include "io/filename.h"
#include "torchpoint/error.h"

namespace torchpoint::tool {
namespace {

std::int64_t modified_ms(const std::string& path) {
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) return 0;
  return static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1000 + st.st_mtim.tv_nsec / 1'000'000;
}

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

bool is_file_checkpoint_name(const std::string& name) {
  return ends_with(name, ".ckpt") || ends_with(name, kContainerExtension);
}

// The final name a temporary stands for ("checkpoint_3" for "checkpoint_3.tmp-12-ab").
std::string final_name_of_temp(const std::string& name) {
  return name.substr(0, name.rfind(".tmp-"));
}

void describe_directory(Env& env, ListedCheckpoint& entry) {
  std::string manifest_path = join_path(entry.path, kManifestFileName);
  FileInfo manifest = env.stat(manifest_path);
  entry.modified_unix_ms = modified_ms(manifest.exists ? manifest_path : entry.path);
  try {
    for (const std::string& name : env.list_dir(entry.path)) {
      FileInfo info = env.stat(join_path(entry.path, name));
      if (!info.is_directory) entry.size_bytes += info.size;
    }
  } catch (const Error& e) {
    entry.problems.push_back(e.what());
  }
  if (entry.status == Status::Uncommitted) return;
  if (!manifest.exists) return;  // never committed
  try {
    Problems throwing;
    Manifest parsed = parse_manifest(env.read_file(manifest_path), manifest_path, throwing);
    entry.step = parsed.info.step;
    entry.metadata = parsed.info.metadata;
  } catch (const Error&) {
    // The manifest is damaged: verify() below reports why, and the entry shows no step.
  }
  VerifyReport report = verify(entry.path, env);
  entry.status = report.ok() ? Status::Valid : Status::Corrupt;
  for (std::string& p : report.problems) entry.problems.push_back(std::move(p));
}

void describe_file(Env& env, ListedCheckpoint& entry) {
  entry.size_bytes = env.stat(entry.path).size;
  entry.modified_unix_ms = modified_ms(entry.path);
  if (entry.status == Status::Uncommitted) return;
  VerifyReport report = verify(entry.path, env);
  entry.status = report.ok() ? Status::Valid : Status::Corrupt;
  entry.problems = std::move(report.problems);
  if (entry.status != Status::Valid) return;
  entry.step = file_checkpoint_step(entry.path);
  // A learner checkpoint's metrics, as a directory checkpoint's manifest metadata has them.
  if (std::optional<Json> metrics = file_checkpoint_metrics(entry.path)) {
    entry.metadata = Json{{"metrics", *metrics}};
  }
}

}  // namespace

const char* status_name(Status status) {
  switch (status) {
    case Status::Valid:
      return "valid";
    case Status::Corrupt:
      return "corrupt";
    case Status::Uncommitted:
      return "uncommitted";
  }
  return "?";
}

Listing list_checkpoints(const std::string& dir, Env& env) {
  FileInfo info = env.stat(dir);
  if (!info.exists) throw Error(ErrorCode::NotFound, fmt::format("{} does not exist", dir));
  if (!info.is_directory) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("{} is a file, not a directory of checkpoints: inspect it with "
                            "`torchpoint show {}`",
                            dir, dir));
  }
  if (env.stat(join_path(dir, kManifestFileName)).exists) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("{} is a checkpoint, not a directory of checkpoints: inspect it "
                            "with `torchpoint show {}`, or list its parent",
                            dir, dir));
  }
  Listing listing;
  listing.dir = dir;
  std::string nested = join_path(dir, "checkpoints");
  if (env.stat(nested).is_directory) listing.dir = nested;

  for (const std::string& name : env.list_dir(listing.dir)) {
    ListedCheckpoint entry;
    entry.name = name;
    entry.path = join_path(listing.dir, name);
    FileInfo entry_info = env.stat(entry.path);
    entry.is_directory = entry_info.is_directory;
    bool temp = is_temp_name(name);
    std::string final_name = temp ? final_name_of_temp(name) : name;
    if (entry.is_directory) {
      entry.number = parse_checkpoint_name(final_name);
      bool has_manifest = env.stat(join_path(entry.path, kManifestFileName)).exists;
      if (!entry.number && !has_manifest && !(temp && is_file_checkpoint_name(final_name))) {
        continue;  // not ours
      }
      entry.status = temp || !has_manifest ? Status::Uncommitted : Status::Valid;
      describe_directory(env, entry);
    } else {
      if (!is_file_checkpoint_name(final_name)) continue;
      entry.number = parse_checkpoint_name(final_name);
      if (!entry.number) entry.number = first_number(final_name);
      entry.status = temp ? Status::Uncommitted : Status::Valid;
      describe_file(env, entry);
    }
    // Gone since it was listed: a checkpoint being deleted (renamed to a temporary name
    // first) fails verification only because it is no longer there. Not corrupt, not listed.
    if (!entry.problems.empty() && !env.stat(entry.path).exists) continue;
    listing.entries.push_back(std::move(entry));
  }
  std::sort(listing.entries.begin(), listing.entries.end(),
            [](const ListedCheckpoint& a, const ListedCheckpoint& b) {
              // Entries without a number first; numbers compared as numbers, never as text.
              if (a.number.has_value() != b.number.has_value()) return !a.number.has_value();
              if (a.number != b.number) return *a.number < *b.number;
              return a.name < b.name;
            });
  for (auto it = listing.entries.rbegin(); it != listing.entries.rend(); ++it) {
    if (it->status == Status::Valid) {
      it->latest = true;
      break;
    }
  }
  return listing;
}

std::optional<double> manifest_metric(const ListedCheckpoint& entry, const std::string& metric) {
  if (!entry.metadata.is_object()) return std::nullopt;
  auto metrics = entry.metadata.find("metrics");
  if (metrics == entry.metadata.end() || !metrics->is_object()) return std::nullopt;
  auto value = metrics->find(metric);
  if (value == metrics->end() || !value->is_number()) return std::nullopt;
  return value->get<double>();
}

}  // namespace torchpoint::tool
