// FaultEnv: an Env for tests that fails chosen calls, shortens writes, and simulates power cuts.
//
// Every call is counted and logged. fail_nth() makes the Nth matching call (1-based, counted
// from the call to fail_nth) throw the error a real system would give for an errno, once
// (transient) or from then on (persistent). The env also tracks what a power cut would keep:
// file bytes up to the last successful sync, and directory entries made durable by a directory
// sync; simulate_power_cut() rewinds the real files to that state.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "torchpoint/env.h"

namespace torchpoint::testing {

enum class Op {
  Open,
  Write,
  Read,
  Sync,
  Truncate,
  Close,
  Size,
  Map,
  SyncDir,
  Rename,
  Mkdir,
  RemoveFile,
  RemoveDir,
  List,
  Stat,
  Lock,
  Link,
};
const char* op_name(Op op);
// Every op.
const std::set<Op>& all_ops();

enum class PowerCutMode {
  DropUnsynced,  // unsynced bytes vanish (files shrink to their synced length)
  RandomPrefix,  // a random prefix of the unsynced bytes survives
  Garbage,       // unsynced bytes keep their place but hold random garbage
};
const char* power_cut_mode_name(PowerCutMode mode);

class FaultEnv : public Env {
 public:
  explicit FaultEnv(Env& base = Env::posix());

  // The nth call (from now, 1-based) of any op in `ops` fails with `err`; with `persistent`,
  // every later matching call fails too.
  void fail_nth(std::set<Op> ops, std::uint64_t n, int err, bool persistent = false);
  void clear_faults();
  // Each write writes at most half of what was asked (at least one byte).
  void set_short_writes(bool on);
  // Called before every op; a test may throw from it or _exit() to crash at that point.
  void set_before_op(std::function<void(Op, const std::string&)> hook);
  // The nth call (from now, 1-based) of `op`, which is Op::Sync or Op::SyncDir, reports success
  // without syncing anything, as if that barrier were missing from the code: a later power cut
  // loses what it should have made durable. Counted apart from fail_nth().
  void drop_nth_barrier(Op op, std::uint64_t n);
  // With `on` false, sync and sync_dir are tracked as done but never reach the disk: for tests
  // whose durability comes from simulate_power_cut() alone, which then run many times faster.
  void set_real_syncs(bool on);
  // A disk with `bytes` free from now on: writes through this env's files use them up; a write
  // that does not fit writes what still fits (a short write) and the next one fails with ENOSPC.
  // Removing files frees nothing. nullopt: no limit (the default).
  void set_byte_budget(std::optional<std::uint64_t> bytes);

  // Number of calls so far and whether any injected fault fired.
  std::uint64_t calls() const;
  std::uint64_t faults_fired() const;
  // Bytes the files of this env have returned from reads so far (every thread's).
  std::uint64_t bytes_read() const { return bytes_read_.load(); }
  // "op path" for every call, in order.
  std::vector<std::string> log() const;
  void clear_log();

  // Rewinds the files and directories this env touched to what a power cut would leave:
  // undoes directory entries (creations and renames) not yet made durable by a directory sync,
  // newest first, and cuts each file's unsynced bytes according to `mode`. The env then
  // forgets its tracking, as a machine that rebooted would.
  void simulate_power_cut(PowerCutMode mode, std::uint64_t seed);

  // Env
  std::unique_ptr<File> open(const std::string& path, OpenMode mode) override;
  void sync_dir(const std::string& dir) override;
  // Not modelled by simulate_power_cut(): the tests of overwriting do not cut power.
  void exchange(const std::string& a, const std::string& b) override;
  void link(const std::string& existing, const std::string& new_path) override;
  void rename(const std::string& from, const std::string& to, bool replace) override;
  void mkdir(const std::string& path) override;
  void remove_file(const std::string& path) override;
  void remove_dir(const std::string& path) override;
  std::vector<std::string> list_dir(const std::string& dir) override;
  FileInfo stat(const std::string& path) override;
  std::unique_ptr<FileLock> lock(const std::string& path) override;

  // Used by the files this env opens.
  void before(Op op, const std::string& path);
  bool short_writes() const { return short_writes_; }
  bool real_syncs() const { return real_syncs_; }
  // True (and counted as used) when this call of `op` is the barrier to drop.
  bool take_dropped_barrier(Op op, const std::string& path);
  // How many of `size` bytes a write may write under the byte budget, reserving them; throws
  // ENOSPC when none fit. give_back_budget() returns what the write did not use.
  std::size_t reserve_budget(const std::string& path, std::size_t size, bool direct);
  void give_back_budget(std::size_t unused);
  void note_write(const std::string& path, std::uint64_t end);
  void note_read(std::size_t bytes) { bytes_read_.fetch_add(bytes); }
  void note_sync(const std::string& path);
  Env& base() { return base_; }

 private:
  struct Tracked {
    std::uint64_t synced = 0;   // bytes known durable
    std::uint64_t written = 0;  // highest byte written
  };
  struct DirOp {
    enum Kind { Create, Rename } kind;
    std::string path;  // created path, or rename target
    std::string from;  // rename source
    std::string parent;
    std::optional<std::string> replaced;  // contents of the file a rename replaced
  };

  void record_dir_op(DirOp op);
  void move_tracking(const std::string& from, const std::string& to);

  Env& base_;
  mutable std::mutex mutex_;
  std::set<Op> fail_ops_;
  std::uint64_t fail_countdown_ = 0;
  int fail_errno_ = 0;
  bool fail_persistent_ = false;
  bool failing_ = false;  // a persistent fault fired
  bool short_writes_ = false;
  bool real_syncs_ = true;
  std::uint64_t calls_ = 0;
  std::atomic<std::uint64_t> bytes_read_{0};
  std::uint64_t fired_ = 0;
  std::vector<std::string> log_;
  std::map<Op, std::uint64_t> drop_countdown_;
  std::optional<std::uint64_t> budget_;
  std::function<void(Op, const std::string&)> before_op_;
  std::map<std::string, Tracked> files_;
  std::vector<DirOp> pending_;
};

}  // namespace torchpoint::testing
