#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>

#include "checkpoint/file_metadata.h"
#include "format/container.h"
#include "format/manifest.h"
#include "io/filename.h"
#include "torchpoint/checkpoint_manager.h"
#include "torchpoint/error.h"

namespace torchpoint {
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

void describe_directory(Env& env, ListedCheckpoint& entry, bool check) {
  std::string manifest_path = join_path(entry.path, kManifestFileName);
  FileInfo manifest = env.stat(manifest_path);
  entry.commit_time_ms = modified_ms(manifest.exists ? manifest_path : entry.path);
  try {
    for (const std::string& name : env.list_dir(entry.path)) {
      FileInfo info = env.stat(join_path(entry.path, name));
      if (!info.is_directory) entry.size_bytes += info.size;
      if (info.is_regular && !info.is_symlink && info.links > 1) entry.shared_bytes += info.size;
    }
  } catch (const Error& e) {
    entry.problems.push_back(e.what());
  }
  if (entry.status == CheckpointStatus::Uncommitted) return;
  if (!manifest.exists) return;  // never committed
  try {
    Problems throwing;
    Manifest parsed = parse_manifest(env.read_file(manifest_path), manifest_path, throwing);
    entry.step = parsed.info.step;
    entry.metadata = parsed.info.metadata;
  } catch (const Error&) {
    // The manifest is damaged: verify() below reports why, and the entry shows no step.
  }
  if (!check) return;  // committed: valid as far as this listing looked
  VerifyReport report = verify(entry.path, env);
  entry.status = report.ok() ? CheckpointStatus::Valid : CheckpointStatus::Corrupt;
  for (std::string& p : report.problems) entry.problems.push_back(std::move(p));
}

void describe_file(Env& env, ListedCheckpoint& entry, bool check) {
  entry.size_bytes = env.stat(entry.path).size;
  entry.commit_time_ms = modified_ms(entry.path);
  if (entry.status == CheckpointStatus::Uncommitted) return;
  if (check) {
    VerifyReport report = verify(entry.path, env);
    entry.status = report.ok() ? CheckpointStatus::Valid : CheckpointStatus::Corrupt;
    entry.problems = std::move(report.problems);
    if (entry.status != CheckpointStatus::Valid) return;
  }
  entry.step = detail::file_checkpoint_step(entry.path);
  // A learner checkpoint's metrics, as a directory checkpoint's manifest metadata has them.
  if (std::optional<Json> metrics = detail::file_checkpoint_metrics(entry.path)) {
    entry.metadata = Json{{"metrics", *metrics}};
  }
}

}  // namespace

CheckpointListing list_checkpoints(const std::string& dir, Env& env, bool check) {
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
  CheckpointListing listing;
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
    entry.temporary = temp;
    std::string final_name = temp ? final_name_of_temp(name) : name;
    if (entry.is_directory) {
      entry.number = checkpoint_number(final_name);
      bool has_manifest = env.stat(join_path(entry.path, kManifestFileName)).exists;
      if (!entry.number && !has_manifest && !(temp && is_file_checkpoint_name(final_name))) {
        continue;  // not ours
      }
      entry.status =
          temp || !has_manifest ? CheckpointStatus::Uncommitted : CheckpointStatus::Valid;
      describe_directory(env, entry, check);
    } else {
      if (!is_file_checkpoint_name(final_name)) continue;
      entry.number = checkpoint_number(final_name);
      entry.status = temp ? CheckpointStatus::Uncommitted : CheckpointStatus::Valid;
      describe_file(env, entry, check);
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
              return natural_less(a.name, b.name);
            });
  for (auto it = listing.entries.rbegin(); it != listing.entries.rend(); ++it) {
    if (it->status == CheckpointStatus::Valid) {
      it->latest = true;
      break;
    }
  }
  return listing;
}

std::optional<std::uint64_t> checkpoint_number(const std::string& name) {
  const std::string final_name = is_temp_name(name) ? final_name_of_temp(name) : name;
  if (auto n = parse_checkpoint_name(final_name)) return n;
  std::size_t at = final_name.find("epoch");
  return first_number(final_name, at == std::string::npos ? 0 : at);
}

std::optional<double> ListedCheckpoint::metric(const std::string& metric) const {
  if (!metadata.is_object()) return std::nullopt;
  auto metrics = metadata.find("metrics");
  if (metrics == metadata.end() || !metrics->is_object()) return std::nullopt;
  auto value = metrics->find(metric);
  if (value == metrics->end() || !value->is_number()) return std::nullopt;
  return value->get<double>();
}

}  // namespace torchpoint
