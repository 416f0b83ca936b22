#include "testing/fault_env.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <iterator>
#include <random>

#include "io/filename.h"
#include "io/posix_error.h"
#include "torchpoint/error.h"

namespace torchpoint::testing {

const char* op_name(Op op) {
  switch (op) {
    case Op::Open:
      return "open";
    case Op::Write:
      return "write";
    case Op::Read:
      return "read";
    case Op::Sync:
      return "sync";
    case Op::Truncate:
      return "truncate";
    case Op::Close:
      return "close";
    case Op::Size:
      return "size";
    case Op::Map:
      return "map";
    case Op::SyncDir:
      return "sync_dir";
    case Op::Rename:
      return "rename";
    case Op::Mkdir:
      return "mkdir";
    case Op::RemoveFile:
      return "remove_file";
    case Op::RemoveDir:
      return "remove_dir";
    case Op::List:
      return "list";
    case Op::Stat:
      return "stat";
    case Op::Lock:
      return "lock";
    case Op::Link:
      return "link";
  }
  return "?";
}

const std::set<Op>& all_ops() {
  static const std::set<Op> ops = {Op::Open,      Op::Write,  Op::Read,  Op::Sync,
                                   Op::Truncate,  Op::Close,  Op::Size,  Op::Map,
                                   Op::SyncDir,   Op::Rename, Op::Mkdir, Op::RemoveFile,
                                   Op::RemoveDir, Op::List,   Op::Stat,  Op::Lock,
                                   Op::Link};
  return ops;
}

const char* power_cut_mode_name(PowerCutMode mode) {
  switch (mode) {
    case PowerCutMode::DropUnsynced:
      return "drop-unsynced";
    case PowerCutMode::RandomPrefix:
      return "random-prefix";
    case PowerCutMode::Garbage:
      return "garbage";
  }
  return "?";
}

namespace {

class FaultFile final : public File {
 public:
  FaultFile(FaultEnv& env, std::unique_ptr<File> base)
      : File(base->path(), base->direct()), env_(env), base_(std::move(base)) {}

  std::size_t write_at(const void* data, std::size_t size, std::uint64_t offset) override {
    env_.before(Op::Write, path());
    std::size_t n = size;
    // Halving keeps O_DIRECT writes aligned as long as they are multiples of 8 KiB.
    if (env_.short_writes() && size > 1) {
      n = direct() ? std::max<std::size_t>(4096, size / 2 / 4096 * 4096) : size / 2;
      n = std::min(n, size);
    }
    std::size_t allowed = env_.reserve_budget(path(), n, direct());
    std::size_t written = 0;
    try {
      written = base_->write_at(data, allowed, offset);
    } catch (...) {
      env_.give_back_budget(allowed);
      throw;
    }
    env_.give_back_budget(allowed - written);
    env_.note_write(path(), offset + written);
    return written;
  }
  std::size_t read_at(void* data, std::size_t size, std::uint64_t offset) override {
    env_.before(Op::Read, path());
    const std::size_t got = base_->read_at(data, size, offset);
    env_.note_read(got);
    return got;
  }
  void sync() override {
    env_.before(Op::Sync, path());
    if (env_.take_dropped_barrier(Op::Sync, path())) return;
    if (env_.real_syncs()) base_->sync();
    env_.note_sync(path());
  }
  void truncate(std::uint64_t size) override {
    env_.before(Op::Truncate, path());
    base_->truncate(size);
  }
  void close() override {
    // The descriptor is released even when the injected close error fires, as on Linux.
    std::unique_ptr<File> base = std::move(base_);
    env_.before(Op::Close, path());
    base->close();
  }
  std::uint64_t size() override {
    env_.before(Op::Size, path());
    return base_->size();
  }
  double cached_fraction(std::uint64_t offset, std::uint64_t size) override {
    return base_->cached_fraction(offset, size);
  }
  std::shared_ptr<MappedRegion> map() override {
    env_.before(Op::Map, path());
    return base_->map();
  }

 private:
  FaultEnv& env_;
  std::unique_ptr<File> base_;
};

}  // namespace

FaultEnv::FaultEnv(Env& base) : base_(base) {}

void FaultEnv::fail_nth(std::set<Op> ops, std::uint64_t n, int err, bool persistent) {
  std::lock_guard<std::mutex> lock(mutex_);
  fail_ops_ = std::move(ops);
  fail_countdown_ = n;
  fail_errno_ = err;
  fail_persistent_ = persistent;
  failing_ = false;
}

void FaultEnv::clear_faults() {
  std::lock_guard<std::mutex> lock(mutex_);
  fail_ops_.clear();
  fail_countdown_ = 0;
  failing_ = false;
  short_writes_ = false;
  drop_countdown_.clear();
  budget_.reset();
}

void FaultEnv::drop_nth_barrier(Op op, std::uint64_t n) {
  if (op != Op::Sync && op != Op::SyncDir) {
    throw Error(
        ErrorCode::InvalidArgument,
        fmt::format("drop_nth_barrier: {} is not a barrier; use sync or sync_dir", op_name(op)));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  drop_countdown_[op] = n;
}

void FaultEnv::set_real_syncs(bool on) { real_syncs_ = on; }

void FaultEnv::set_byte_budget(std::optional<std::uint64_t> bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  budget_ = bytes;
}

bool FaultEnv::take_dropped_barrier(Op op, const std::string& path) {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = drop_countdown_.find(op);
  if (it == drop_countdown_.end() || it->second == 0 || --it->second > 0) return false;
  log_.push_back(fmt::format("{} {} -> dropped", op_name(op), path));
  return true;
}

std::size_t FaultEnv::reserve_budget(const std::string& path, std::size_t size, bool direct) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!budget_) return size;
  std::uint64_t fits = std::min<std::uint64_t>(size, *budget_);
  // An O_DIRECT write moves whole blocks only.
  if (direct) fits = fits / 4096 * 4096;
  if (fits == 0 && size > 0) {
    ++fired_;
    log_.push_back(fmt::format("write {} -> injected {} (byte budget spent)", path, ENOSPC));
    throw posix_error(fmt::format("write of {} (injected: byte budget spent)", path), ENOSPC);
  }
  *budget_ -= fits;
  return static_cast<std::size_t>(fits);
}

void FaultEnv::give_back_budget(std::size_t unused) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (budget_) *budget_ += unused;
}

void FaultEnv::set_short_writes(bool on) { short_writes_ = on; }

void FaultEnv::set_before_op(std::function<void(Op, const std::string&)> hook) {
  std::lock_guard<std::mutex> lock(mutex_);
  before_op_ = std::move(hook);
}

std::uint64_t FaultEnv::calls() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return calls_;
}

std::uint64_t FaultEnv::faults_fired() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return fired_;
}

std::vector<std::string> FaultEnv::log() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return log_;
}

void FaultEnv::clear_log() {
  std::lock_guard<std::mutex> lock(mutex_);
  log_.clear();
}

void FaultEnv::before(Op op, const std::string& path) {
  std::function<void(Op, const std::string&)> hook;
  int err = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++calls_;
    log_.push_back(fmt::format("{} {}", op_name(op), path));
    hook = before_op_;
    if (fail_ops_.count(op)) {
      if (failing_) {
        err = fail_errno_;
      } else if (fail_countdown_ > 0 && --fail_countdown_ == 0) {
        err = fail_errno_;
        failing_ = fail_persistent_;
      }
    }
    if (err != 0) {
      ++fired_;
      log_.back() += fmt::format(" -> injected {}", err);
    }
  }
  if (hook) hook(op, path);
  if (err != 0) throw posix_error(fmt::format("{} of {} (injected)", op_name(op), path), err);
}

void FaultEnv::note_write(const std::string& path, std::uint64_t end) {
  std::lock_guard<std::mutex> lock(mutex_);
  Tracked& t = files_[path];
  t.written = std::max(t.written, end);
}

void FaultEnv::note_sync(const std::string& path) {
  std::lock_guard<std::mutex> lock(mutex_);
  Tracked& t = files_[path];
  t.synced = t.written;
}

void FaultEnv::record_dir_op(DirOp op) {
  std::lock_guard<std::mutex> lock(mutex_);
  pending_.push_back(std::move(op));
}

void FaultEnv::move_tracking(const std::string& from, const std::string& to) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::map<std::string, Tracked> moved;
  for (auto it = files_.begin(); it != files_.end();) {
    const std::string& p = it->first;
    if (p == from || p.starts_with(from + "/")) {
      moved[to + p.substr(from.size())] = it->second;
      it = files_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto& [p, t] : moved) files_[p] = t;
}

std::unique_ptr<File> FaultEnv::open(const std::string& path, OpenMode mode) {
  before(Op::Open, path);
  std::unique_ptr<File> file = base_.open(path, mode);
  if (mode != OpenMode::Read && mode != OpenMode::ReadDirect) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      files_[path] = Tracked{};
    }
    record_dir_op({DirOp::Create, path, "", parent_path(path), std::nullopt});
  }
  return std::make_unique<FaultFile>(*this, std::move(file));
}

void FaultEnv::sync_dir(const std::string& dir) {
  before(Op::SyncDir, dir);
  if (take_dropped_barrier(Op::SyncDir, dir)) return;
  if (real_syncs_) base_.sync_dir(dir);
  std::lock_guard<std::mutex> lock(mutex_);
  // Entries in `dir` are durable now. Creations inside a directory that is itself still
  // pending stay undoable through that directory's own entry.
  std::erase_if(pending_, [&](const DirOp& op) { return op.parent == dir; });
}

void FaultEnv::rename(const std::string& from, const std::string& to, bool replace) {
  before(Op::Rename, from);
  // A power cut that undoes a replacing rename brings the replaced file back: keep its bytes.
  std::optional<std::string> replaced;
  if (replace) {
    FileInfo target = base_.stat(to);
    if (target.exists && !target.is_directory) replaced = base_.read_file(to);
  }
  base_.rename(from, to, replace);
  move_tracking(from, to);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (DirOp& op : pending_) {
      if (op.path == from || op.path.starts_with(from + "/")) {
        op.path = to + op.path.substr(from.size());
        op.parent = parent_path(op.path);
      }
    }
  }
  record_dir_op({DirOp::Rename, to, from, parent_path(to), std::move(replaced)});
}

void FaultEnv::exchange(const std::string& a, const std::string& b) {
  before(Op::Rename, a);
  base_.exchange(a, b);
}

void FaultEnv::link(const std::string& existing, const std::string& new_path) {
  before(Op::Link, new_path);
  base_.link(existing, new_path);
  // The file's bytes were durable under `existing`; the new name is a directory entry, undone by
  // a power cut until its directory is synced.
  record_dir_op({DirOp::Create, new_path, "", parent_path(new_path), std::nullopt});
}

void FaultEnv::mkdir(const std::string& path) {
  before(Op::Mkdir, path);
  base_.mkdir(path);
  record_dir_op({DirOp::Create, path, "", parent_path(path), std::nullopt});
}

void FaultEnv::remove_file(const std::string& path) {
  before(Op::RemoveFile, path);
  base_.remove_file(path);
  std::lock_guard<std::mutex> lock(mutex_);
  files_.erase(path);
  std::erase_if(pending_, [&](const DirOp& op) { return op.path == path; });
}

void FaultEnv::remove_dir(const std::string& path) {
  before(Op::RemoveDir, path);
  base_.remove_dir(path);
  std::lock_guard<std::mutex> lock(mutex_);
  std::erase_if(pending_, [&](const DirOp& op) { return op.path == path; });
}

std::vector<std::string> FaultEnv::list_dir(const std::string& dir) {
  before(Op::List, dir);
  return base_.list_dir(dir);
}

FileInfo FaultEnv::stat(const std::string& path) {
  before(Op::Stat, path);
  return base_.stat(path);
}

std::unique_ptr<FileLock> FaultEnv::lock(const std::string& path) {
  before(Op::Lock, path);
  return base_.lock(path);
}

namespace {

// Writes `bytes` to a new file at `path` with plain POSIX calls (no tracking, no faults).
void restore_file(const std::string& path, const std::string& bytes) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
  if (fd < 0) return;
  [[maybe_unused]] ssize_t n = ::pwrite(fd, bytes.data(), bytes.size(), 0);
  ::close(fd);
}

}  // namespace

void FaultEnv::simulate_power_cut(PowerCutMode mode, std::uint64_t seed) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::mt19937_64 rng(seed);
  // File contents first, while the paths are still where the tracking says.
  for (const auto& [path, t] : files_) {
    FileInfo info = base_.stat(path);
    if (!info.exists || info.is_directory || info.size <= t.synced) continue;
    std::uint64_t keep = t.synced;
    if (mode == PowerCutMode::RandomPrefix) keep += rng() % (info.size - t.synced + 1);
    if (mode == PowerCutMode::Garbage) {
      int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
      if (fd < 0) continue;
      std::vector<std::uint8_t> junk(info.size - t.synced);
      for (auto& b : junk) b = static_cast<std::uint8_t>(rng());
      [[maybe_unused]] ssize_t n = ::pwrite(fd, junk.data(), junk.size(), t.synced);
      ::close(fd);
    } else {
      [[maybe_unused]] int rc = ::truncate(path.c_str(), static_cast<off_t>(keep));
    }
  }
  // Then the directory entries that were never made durable, newest first.
  for (auto it = pending_.rbegin(); it != pending_.rend(); ++it) {
    try {
      if (it->kind == DirOp::Rename) {
        if (base_.stat(it->path).exists) base_.rename(it->path, it->from, /*replace=*/false);
        if (it->replaced) restore_file(it->path, *it->replaced);
        // Older entries were renamed along with it: they are back under the old name.
        for (auto older = std::next(it); older != pending_.rend(); ++older) {
          if (older->path == it->path || older->path.starts_with(it->path + "/")) {
            older->path = it->from + older->path.substr(it->path.size());
            older->parent = parent_path(older->path);
          }
        }
      } else {
        base_.remove_all(it->path);
      }
    } catch (const Error&) {  // swallowed: an entry already gone is what a power cut leaves
    }
  }
  pending_.clear();
  files_.clear();
}

}  // namespace torchpoint::testing
