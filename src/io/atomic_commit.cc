#include "io/atomic_commit.h"

#include <fmt/format.h>

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

}  // namespace

PendingFile::PendingFile(Env& env, std::string final_path)
    : env_(env),
      final_path_(std::move(final_path)),
      temp_path_(join_path(parent_path(final_path_), temp_name(base_name(final_path_)))) {}

PendingFile::~PendingFile() {
  if (!committed_) remove_quietly(env_, temp_path_);
}

void PendingFile::commit() {
  // The caller synced the file before this rename, so the new name never points at data that
  // is not on disk yet.
  env_.rename(temp_path_, final_path_, /*replace=*/true);
  committed_ = true;
  // The rename itself is durable only once the directory holding it is synced.
  env_.sync_dir(parent_path(final_path_));
}

PendingDir::PendingDir(Env& env, std::string final_path)
    : env_(env),
      final_path_(std::move(final_path)),
      temp_path_(join_path(parent_path(final_path_), temp_name(base_name(final_path_)))) {
  if (env_.stat(final_path_).exists) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("{} already exists: a committed checkpoint is never overwritten; "
                            "choose a new directory or remove the old one",
                            final_path_));
  }
  env_.mkdir(temp_path_);
}

PendingDir::~PendingDir() {
  if (!committed_) remove_quietly(env_, temp_path_);
}

void PendingDir::commit() {
  // Entries of the files written inside are durable only after the directory itself is synced.
  env_.sync_dir(temp_path_);
  // RENAME_NOREPLACE: if another writer committed the same name meanwhile, fail rather than
  // replace (or nest inside) its checkpoint.
  env_.rename(temp_path_, final_path_, /*replace=*/false);
  committed_ = true;
  // Makes the new name durable.
  env_.sync_dir(parent_path(final_path_));
}

ProjectLock::ProjectLock(Env& env, const std::string& dir)
    : lock_(env.lock(join_path(dir, kLockFileName))) {}

std::vector<std::string> remove_stale_temporaries(Env& env, const std::string& dir) {
  std::vector<std::string> removed;
  for (const std::string& name : env.list_dir(dir)) {
    if (!is_temp_name(name)) continue;
    env.remove_all(join_path(dir, name));
    removed.push_back(name);
  }
  return removed;
}

}  // namespace torchpoint
