#include "io/atomic_commit.h"

#include <fmt/format.h>
#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <mutex>
#include <set>

#include "io/filename.h"
#include "torchpoint/error.h"

namespace torchpoint {
namespace {

// Cleanup on an error path: the error being reported matters more than a failure to tidy up,
// and whatever is left is a temporary that remove_stale_temporaries() deletes later.
void remove_quietly(Env& env, const std::string& path) noexcept {
  try {
    env.remove_all(path);
  } catch (...) {  // swallowed on purpose, see above
  }
}

// Temporaries that a live PendingFile or PendingDir of this process owns. Any other temporary
// of this process was abandoned by a cleanup that failed, and is stale.
std::mutex live_mutex;
std::set<std::string>& live_temporaries() {
  static std::set<std::string> live;
  return live;
}

void register_live(const std::string& path) {
  std::lock_guard<std::mutex> lock(live_mutex);
  live_temporaries().insert(path);
}

void unregister_live(const std::string& path) noexcept {
  std::lock_guard<std::mutex> lock(live_mutex);
  live_temporaries().erase(path);
}

bool is_live(const std::string& path) {
  std::lock_guard<std::mutex> lock(live_mutex);
  return live_temporaries().count(path) > 0;
}

}  // namespace

PendingFile::PendingFile(Env& env, std::string final_path)
    : env_(env),
      final_path_(std::move(final_path)),
      temp_path_(join_path(parent_path(final_path_), temp_name(base_name(final_path_)))) {
  register_live(temp_path_);
}

PendingFile::~PendingFile() {
  if (!committed_) remove_quietly(env_, temp_path_);
  unregister_live(temp_path_);
}

void PendingFile::commit() {
  // The caller synced the file before this rename, so the new name never points at data that
  // is not on disk yet.
  env_.rename(temp_path_, final_path_, /*replace=*/true);
  committed_ = true;
  // The rename itself is durable only once the directory holding it is synced.
  env_.sync_dir(parent_path(final_path_));
}

PendingDir::PendingDir(Env& env, std::string final_path, bool overwrite)
    : env_(env),
      final_path_(std::move(final_path)),
      temp_path_(join_path(parent_path(final_path_), temp_name(base_name(final_path_)))) {
  FileInfo existing = env_.stat(final_path_);
  if (existing.exists) {
    if (!existing.is_directory || existing.is_symlink) {
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("{} exists and is {}, not a directory: choose another path",
                              final_path_, existing.is_symlink ? "a symbolic link" : "a file"));
    }
    std::vector<std::string> entries = env_.list_dir(final_path_);
    bool committed = env_.stat(join_path(final_path_, "manifest.json")).exists;
    if (entries.empty()) {
      replace_empty_ = true;
    } else if (committed && overwrite) {
      exchange_ = true;
    } else if (committed) {
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("{} is a committed checkpoint, which is never overwritten unless "
                              "asked: pass overwrite (save_state(dir, /*overwrite=*/true)) to "
                              "replace it atomically, or choose a new directory",
                              final_path_));
    } else {
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("{} exists and holds {} entr{} but no manifest.json, so it is not "
                              "a committed checkpoint (it may be one whose save died, or another "
                              "program's files): choose a new or empty directory, or remove it",
                              final_path_, entries.size(), entries.size() == 1 ? "y" : "ies"));
    }
  }
  register_live(temp_path_);
  try {
    env_.mkdir(temp_path_);
  } catch (...) {
    unregister_live(temp_path_);
    throw;
  }
}

PendingDir::~PendingDir() {
  if (!committed_) remove_quietly(env_, temp_path_);
  unregister_live(temp_path_);
}

void PendingDir::commit() {
  // Entries of the files written inside are durable only after the directory itself is synced.
  env_.sync_dir(temp_path_);
  if (exchange_) {
    // The old checkpoint stays whole at final_path_ until this instant, when the two swap; it
    // is then removed from the temporary name (or, after a crash, swept away as stale).
    env_.exchange(temp_path_, final_path_);
    committed_ = true;
    env_.sync_dir(parent_path(final_path_));
    remove_quietly(env_, temp_path_);
    return;
  }
  // An empty directory is replaced by rename(2), which fails (ENOTEMPTY) should something be
  // written into it meanwhile. Otherwise RENAME_NOREPLACE: if another writer committed the same
  // name meanwhile, fail rather than replace (or nest inside) its checkpoint.
  env_.rename(temp_path_, final_path_, /*replace=*/replace_empty_);
  committed_ = true;
  // Makes the new name durable.
  env_.sync_dir(parent_path(final_path_));
}

ProjectLock::ProjectLock(Env& env, const std::string& dir)
    : lock_(env.lock(join_path(dir, kLockFileName))) {}

std::vector<std::string> remove_stale_temporaries(Env& env, const std::string& dir) {
  return remove_stale_temporaries(env, dir, "");
}

std::vector<std::string> remove_stale_temporaries(Env& env, const std::string& dir,
                                                  const std::string& final_name) {
  std::vector<std::string> removed;
  for (const std::string& name : env.list_dir(dir)) {
    if (!is_temp_name(name)) continue;
    if (!final_name.empty() && name.rfind(final_name + ".tmp-", 0) != 0) continue;
    // A temporary of another live process may belong to a save in progress (a single-file save
    // takes no lock); one of this process is stale unless a live Pending* object owns it.
    std::optional<int> pid = temp_name_pid(name);
    if (!pid) continue;
    if (*pid == ::getpid()) {
      if (is_live(join_path(dir, name))) continue;
    } else if (::kill(*pid, 0) == 0 || errno == EPERM) {
      continue;
    }
    env.remove_all(join_path(dir, name));
    removed.push_back(name);
  }
  return removed;
}

void write_file_atomically(Env& env, const std::string& path, std::string_view bytes) {
  PendingFile pending(env, path);
  std::unique_ptr<File> file = env.open(pending.temp_path(), OpenMode::CreateExclusive);
  file->write_all(bytes.data(), bytes.size(), 0);
  // Why before commit: the rename must not publish bytes that are not yet durable.
  file->sync();
  file->close();
  pending.commit();
}

}  // namespace torchpoint
