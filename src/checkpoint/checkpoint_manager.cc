#include "torchpoint/checkpoint_manager.h"

#include <fmt/args.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "checkpoint/committed.h"
#include "format/manifest.h"
#include "io/atomic_commit.h"
#include "io/filename.h"
#include "torchpoint/checkpoint_dir.h"
#include "torchpoint/tensor_file.h"

namespace torchpoint {
namespace detail {

std::vector<std::pair<std::uint64_t, std::string>> committed_checkpoints(const std::string& dir,
                                                                         Env& env, bool any_name) {
  std::vector<std::pair<std::uint64_t, std::string>> out;
  if (!env.stat(dir).is_directory) return out;
  for (const std::string& name : env.list_dir(dir)) {
    if (is_temp_name(name)) continue;
    std::optional<std::uint64_t> n =
        any_name ? checkpoint_number(name) : parse_checkpoint_name(name);
    if (!n) continue;
    std::string path = join_path(dir, name);
    if (!env.stat(join_path(path, kManifestFileName)).exists) continue;
    out.emplace_back(*n, path);
  }
  std::sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first < b.first : natural_less(a.second, b.second);
  });
  return out;
}

std::uint64_t next_checkpoint_number(const std::string& dir, Env& env) {
  std::uint64_t next = 0;
  if (!env.stat(dir).is_directory) return next;
  for (const std::string& name : env.list_dir(dir)) {
    if (std::optional<std::uint64_t> n = checkpoint_number(name)) next = std::max(next, *n + 1);
  }
  return next;
}

std::optional<std::string> newest_valid(
    const std::vector<std::pair<std::uint64_t, std::string>>& oldest_first, Env& env,
    std::vector<std::string>* skipped) {
  for (auto it = oldest_first.rbegin(); it != oldest_first.rend(); ++it) {
    VerifyReport verified = verify(it->second, env);
    if (verified.ok()) return it->second;
    if (!verified.proven_corrupt()) {
      // Unreadable (permissions, I/O error) or written by a newer torchpoint: its contents may
      // be intact. Resuming from an older one would silently lose its progress, and retention
      // could then delete it.
      throw not_passed_over(it->second, verified.problems.front(), verified.worst_code());
    }
    std::string why = fmt::format("{}: {}", it->second, verified.problems.front());
    warn_passed_over(why);
    if (skipped != nullptr) skipped->push_back(why);
  }
  return std::nullopt;
}

Error not_passed_over(const std::string& path, const std::string& problem, ErrorCode code) {
  return Error(code, fmt::format("the newest checkpoint {} cannot be loaded, and nothing shows it "
                                 "is corrupt, so it is not passed over: {}. Fix the cause (file "
                                 "permissions, the disk, a newer torchpoint) and load again; to "
                                 "resume from an older one instead, move {} aside or pass that "
                                 "one's path",
                                 path, problem, path));
}

void warn_passed_over(const std::string& why) {
  std::fprintf(stderr, "torchpoint: skipping invalid checkpoint %s\n", why.c_str());
}

void ensure_directory(Env& env, const std::string& dir) {
  if (dir.empty() || env.stat(dir).is_directory) return;
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    throw Error(ErrorCode::IOError,
                fmt::format("cannot create directory {}: {}; check the path and permissions", dir,
                            ec.message()));
  }
  std::string parent = parent_path(dir);
  env.sync_dir(parent.empty() ? "." : parent);
}

}  // namespace detail

std::vector<RetentionDecision> plan_retention(const CheckpointListing& listing,
                                              const RetentionPolicy& policy) {
  std::vector<RetentionEntry> entries;
  for (const ListedCheckpoint& e : listing.entries) {
    RetentionEntry r;
    r.name = e.name;
    r.status = e.status;
    r.step = e.step;
    if (policy.best_metric()) r.metric = e.metric(*policy.best_metric());
    r.commit_time_ms = e.commit_time_ms;
    r.pinned = e.pinned;
    entries.push_back(std::move(r));
  }
  return plan_retention(entries, policy);
}

void remove_checkpoint(const std::string& dir, const ListedCheckpoint& entry, Env& env) {
  if (!entry.is_directory) {
    env.remove_file(entry.path);
    return;
  }
  std::string doomed = join_path(dir, temp_name(entry.name));
  env.rename(entry.path, doomed, /*replace=*/false);
  env.sync_dir(dir);
  env.remove_all(doomed);
}

std::vector<std::string> delete_checkpoints(const CheckpointListing& listing,
                                            const std::vector<RetentionDecision>& decisions,
                                            Env& env) {
  if (decisions.size() != listing.entries.size()) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("delete_checkpoints: {} decisions for {} checkpoints of {}",
                            decisions.size(), listing.entries.size(), listing.dir));
  }
  std::vector<std::string> deleted;
  if (std::all_of(decisions.begin(), decisions.end(),
                  [](const RetentionDecision& d) { return d.keep; })) {
    return deleted;
  }
  // Saves into this directory hold its lock; deleting under a running save could race it.
  ProjectLock lock(env, listing.dir);
  for (std::size_t i = 0; i < decisions.size(); ++i) {
    if (decisions[i].keep) continue;
    remove_checkpoint(listing.dir, listing.entries[i], env);
    deleted.push_back(listing.entries[i].path);
  }
  env.sync_dir(listing.dir);
  return deleted;
}

CheckpointManager::CheckpointManager(std::string dir, CheckpointManagerOptions options, Env* env)
    : dir_(std::move(dir)), options_(std::move(options)), env_(env ? env : &Env::posix()) {
  if (dir_.empty()) {
    throw Error(ErrorCode::InvalidArgument, "CheckpointManager needs a directory");
  }
  const std::string& format = options_.name_format();
  if (format.empty() || format.find('/') != std::string::npos ||
      (format.find("{n") == std::string::npos && format.find("{step") == std::string::npos &&
       format.find("{epoch") == std::string::npos)) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("CheckpointManager: name_format '{}' must be one file name using "
                            "{{n}}, {{step}} or {{epoch}}, which order the checkpoints",
                            format));
  }
}

std::string CheckpointManager::name_for(std::uint64_t n, std::int64_t step,
                                        const std::map<std::string, double>& metrics,
                                        std::optional<std::int64_t> epoch) const {
  fmt::dynamic_format_arg_store<fmt::format_context> args;
  std::vector<std::string> fields = {"{n}", "{step}"};
  args.push_back(fmt::arg("n", n));
  args.push_back(fmt::arg("step", step));
  if (epoch) {
    args.push_back(fmt::arg("epoch", *epoch));
    fields.push_back("{epoch}");
  }
  for (const auto& [name, value] : metrics) {
    if (name == "n" || name == "step" || name == "epoch") continue;
    args.push_back(fmt::arg(name.c_str(), value));
    fields.push_back("{" + name + "}");
  }
  std::string name;
  try {
    name = fmt::vformat(options_.name_format(), args);
  } catch (const fmt::format_error& e) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("CheckpointManager: name_format '{}' cannot be formatted ({}); the "
                            "fields of this save are {}",
                            options_.name_format(), e.what(), fmt::join(fields, ", ")));
  }
  // The number listings order by must be the one that grows: a name such as "run3-step-{step}"
  // would be ordered by its 3.
  std::optional<std::uint64_t> order = checkpoint_number(name);
  auto is = [&](std::int64_t value) {
    return value >= 0 && order == static_cast<std::uint64_t>(value);
  };
  if (!order || !(order == n || is(step) || (epoch && is(*epoch)))) {
    throw Error(
        ErrorCode::InvalidArgument,
        fmt::format("CheckpointManager: checkpoints named like '{}' would be ordered by "
                    "{}, not by their {{n}}, {{step}} or {{epoch}}; put one of those "
                    "before any other number in name_format '{}'",
                    name, order ? std::to_string(*order) : "nothing", options_.name_format()));
  }
  return name;
}

CheckpointListing CheckpointManager::list() const {
  if (!env_->stat(dir_).is_directory) return {dir_, {}};
  return list_checkpoints(dir_, *env_);
}

std::optional<std::string> CheckpointManager::try_latest() const {
  return detail::newest_valid(detail::committed_checkpoints(dir_, *env_, /*any_name=*/true), *env_);
}

std::string CheckpointManager::latest() const {
  std::optional<std::string> path = try_latest();
  if (!path) {
    throw Error(ErrorCode::NotFound,
                fmt::format("no valid checkpoint under {}; save one first (or use try_latest() "
                            "to start fresh when there is none)",
                            dir_));
  }
  return *path;
}

std::string CheckpointManager::save(const StatefulSet& state, std::int64_t step,
                                    const std::map<std::string, double>& metrics,
                                    std::optional<std::int64_t> epoch) {
  wait_for_checkpoint();
  return save_with(state, step, metrics, epoch, nullptr);
}

SaveHandle CheckpointManager::save_async(const StatefulSet& state, std::int64_t step,
                                         const std::map<std::string, double>& metrics,
                                         std::optional<std::int64_t> epoch) {
  if (!async_) async_ = std::make_unique<AsyncCheckpointer>(*env_);
  // First the previous save: its error, if nobody took it, and its checkpoint, which the next
  // number must count.
  async_->wait();
  SaveHandle handle;
  save_with(state, step, metrics, epoch, &handle);
  return handle;
}

void CheckpointManager::wait_for_checkpoint() {
  if (async_) async_->wait();
}

CheckpointManager::~CheckpointManager() = default;

std::string CheckpointManager::save_with(const StatefulSet& state, std::int64_t step,
                                         const std::map<std::string, double>& metrics,
                                         std::optional<std::int64_t> epoch, SaveHandle* handle) {
  detail::ensure_directory(*env_, dir_);
  const std::uint64_t number = detail::next_checkpoint_number(dir_, *env_);
  const std::string path = join_path(dir_, name_for(number, step, metrics, epoch));
  StateDict all = state.state_dict();
  std::vector<Component> components;
  for (const std::string& name : state.names()) {
    components.push_back({name, all.child(name).to_container()});
  }
  CheckpointInfo info;
  info.step = step;
  info.iteration = static_cast<std::int64_t>(number);
  Json recorded = Json::object();
  for (const auto& [name, value] : metrics) {
    // JSON has no NaN or infinity: such a value is left out (it can never be the best).
    if (std::isfinite(value)) recorded[name] = value;
  }
  info.metadata = {{"metrics", recorded}};
  if (epoch) info.metadata["epoch"] = *epoch;
  if (handle != nullptr) {
    // Retention runs on the background thread, after the commit.
    *handle = async_->save_directory(path, components, info, {}, [this] { retain(); });
    return path;
  }
  save_directory(path, components, info, *env_);
  retain();
  return path;
}

CheckpointManager::Restored CheckpointManager::restore(StatefulSet& state,
                                                       const std::string& path) {
  wait_for_checkpoint();
  Restored out;
  out.path = path.empty() ? latest() : path;
  DirectoryCheckpoint checkpoint = load_directory(out.path, *env_);
  StateDict all;
  for (const Component& c : checkpoint.components) {
    all.set_child(c.name, StateDict::from_container(c.contents));
  }
  out.report = state.restore(all);
  out.step = checkpoint.info.step;
  restored_from_ = base_name(out.path);
  return out;
}

CheckpointManager::Restored CheckpointManager::restore(StatefulSet& state, std::uint64_t number) {
  CheckpointListing listing = list();
  std::vector<std::string> numbers;
  for (const ListedCheckpoint& e : listing.entries) {
    if (e.temporary || !e.number) continue;
    if (*e.number == number) return restore(state, e.path);
    numbers.push_back(std::to_string(*e.number));
  }
  throw Error(ErrorCode::NotFound,
              fmt::format("CheckpointManager: no checkpoint numbered {} in {} (there {}: {})",
                          number, dir_, numbers.size() == 1 ? "is" : "are",
                          numbers.empty() ? "none" : fmt::format("{}", fmt::join(numbers, ", "))));
}

std::vector<std::string> CheckpointManager::apply_retention() {
  wait_for_checkpoint();
  return retain();
}

std::vector<std::string> CheckpointManager::retain() {
  const RetentionPolicy& policy = options_.retention();
  if (!policy.has_rule()) return {};  // nothing to decide: skip the listing
  // Not verified: reading every checkpoint at each save would cost more than the save. A
  // committed checkpoint counts as valid here; the newest valid one is what try_latest() finds.
  CheckpointListing listing = list_checkpoints(dir_, *env_, /*verify=*/false);
  for (ListedCheckpoint& e : listing.entries) {
    if (!restored_from_.empty() && e.name == restored_from_ && !e.temporary) {
      e.pinned = "the checkpoint this run resumed from";
    }
  }
  return delete_checkpoints(listing, plan_retention(listing, policy), *env_);
}

}  // namespace torchpoint
