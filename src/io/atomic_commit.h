// The commit protocol of DESIGN.md: a checkpoint becomes visible whole or not at all.
//
// A file or directory is built under a temporary sibling name, made durable, and renamed into
// place; the parent directory is then synced so the new name survives a power cut. An object
// that is destroyed before commit() removes its temporary.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "torchpoint/env.h"

namespace torchpoint {

// A single file committed by rename, replacing any previous version of `final_path`.
//
// Example:
//   PendingFile pending(env, "runs/state.ckpt");
//   write_and_sync_and_close(pending.temp_path());
//   pending.commit();
class PendingFile {
 public:
  PendingFile(Env& env, std::string final_path);
  ~PendingFile();
  PendingFile(const PendingFile&) = delete;
  PendingFile& operator=(const PendingFile&) = delete;

  const std::string& temp_path() const { return temp_path_; }
  const std::string& final_path() const { return final_path_; }

  // The caller has written, synced and closed temp_path(). Renames it over final_path() and
  // syncs the parent directory. If the rename fails, the temporary is removed by the
  // destructor and the previous version of final_path(), if any, is untouched; if only the
  // final directory sync fails, the new version is in place but may not survive a power cut.
  void commit();

 private:
  Env& env_;
  std::string final_path_;
  std::string temp_path_;
  bool committed_ = false;
};

// A directory committed by a rename that never replaces an existing directory.
class PendingDir {
 public:
  // Creates the temporary directory next to `final_path`. An existing empty directory at
  // `final_path` is replaced by the commit; an existing committed checkpoint (one holding
  // manifest.json) only with `overwrite`, atomically (renameat2(RENAME_EXCHANGE), then the old
  // one is removed). Anything else there throws InvalidArgument saying what it is: a committed
  // checkpoint is never written into.
  PendingDir(Env& env, std::string final_path, bool overwrite = false);
  ~PendingDir();
  PendingDir(const PendingDir&) = delete;
  PendingDir& operator=(const PendingDir&) = delete;

  const std::string& temp_path() const { return temp_path_; }
  const std::string& final_path() const { return final_path_; }

  // Every file in temp_path() is written, synced and closed, the manifest last. Syncs the
  // directory, renames it to final_path() and syncs the parent. If only that last sync
  // fails, the checkpoint is in place but may not survive a power cut; it still throws.
  void commit();

 private:
  Env& env_;
  std::string final_path_;
  std::string temp_path_;
  bool committed_ = false;
  bool replace_empty_ = false;  // `final_path` is an empty directory, replaced by rename
  bool exchange_ = false;       // `final_path` is a checkpoint the caller asked to overwrite
};

// The lock of a project (or checkpoint parent) directory: `<dir>/.lock`, held until
// destruction. A second holder, in this process or another, gets Error(Locked).
class ProjectLock {
 public:
  ProjectLock(Env& env, const std::string& dir);

 private:
  std::unique_ptr<FileLock> lock_;
};

// Removes every temporary left in `dir` by a writer that died (names from temp_name() whose
// process no longer exists) or abandoned by a failed cleanup in this process. Call it while
// holding the directory's ProjectLock. Returns the names removed.
std::vector<std::string> remove_stale_temporaries(Env& env, const std::string& dir);
// The same, limited to the temporaries of one final name in `dir` (those of save_file(path),
// which takes no lock: another process's save of another file there is left alone).
std::vector<std::string> remove_stale_temporaries(Env& env, const std::string& dir,
                                                  const std::string& final_name);

// write_file_atomically(env, path, bytes) is public (torchpoint/env.h): it commits with
// PendingFile.

}  // namespace torchpoint
