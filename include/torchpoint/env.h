// Env: the one door through which torchpoint touches the file system.
//
// Every open, write, fsync, rename, mkdir, listing, removal, read, mapping and lock that
// torchpoint performs goes through an Env, so tests can substitute one that injects faults
// (see testing/fault_env.h) and users can route I/O elsewhere. All methods throw
// torchpoint::Error on failure (code NotFound for a missing path, IOError otherwise, with the
// errno text and a hint); none retries a failed fsync.
//
// Thread safety: Env::posix() may be used from any thread; a File must not be used by two
// threads at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "torchpoint/error.h"

namespace torchpoint {

// A read-only mapping of a whole file. Unmapped on destruction.
class MappedRegion {
 public:
  virtual ~MappedRegion() = default;
  const std::uint8_t* data() const { return data_; }
  std::size_t size() const { return size_; }

 protected:
  const std::uint8_t* data_ = nullptr;
  std::size_t size_ = 0;
};

enum class OpenMode {
  Read,                   // O_RDONLY
  ReadDirect,             // as Read, plus O_DIRECT: reads go to the device, not the page cache
  CreateExclusive,        // O_WRONLY | O_CREAT | O_EXCL: never reuses an existing file
  CreateExclusiveDirect,  // as CreateExclusive, plus O_DIRECT (bypass the page cache)
};

// An open file. The destructor closes it if close() was not called, ignoring errors: call
// close() to learn about deferred write errors.
class File {
 public:
  virtual ~File() = default;

  // One positioned write; returns how many bytes were written, which may be fewer than asked.
  virtual std::size_t write_at(const void* data, std::size_t size, std::uint64_t offset) = 0;
  // One positioned read; returns the bytes read, 0 at end of file.
  virtual std::size_t read_at(void* data, std::size_t size, std::uint64_t offset) = 0;
  // fsync(2). After a failure the file's contents are unknown: never retry and trust it.
  virtual void sync() = 0;
  virtual void truncate(std::uint64_t size) = 0;
  // close(2), checked. The file is closed afterwards even when it throws.
  virtual void close() = 0;
  virtual std::uint64_t size() = 0;
  // Maps the whole file copy-on-write (MAP_PRIVATE): writes to the mapping never reach the file.
  virtual std::shared_ptr<MappedRegion> map() = 0;
  // The share of the bytes [offset, offset + size) held in the page cache now, from 0 to 1:
  // an estimate that may choose how to read, never what is read. The default answers 1.
  virtual double cached_fraction(std::uint64_t offset, std::uint64_t size);

  const std::string& path() const { return path_; }
  // True when opened with O_DIRECT: buffers, offsets and sizes must be 4096-aligned.
  bool direct() const { return direct_; }

  // Writes all of `data`, looping over short writes; throws on error or on a write of 0 bytes.
  void write_all(const void* data, std::size_t size, std::uint64_t offset);
  // Reads exactly `size` bytes; throws Corruption naming the file if it ends first.
  void read_exact(void* data, std::size_t size, std::uint64_t offset);

 protected:
  File(std::string path, bool direct) : path_(std::move(path)), direct_(direct) {}

 private:
  std::string path_;
  bool direct_;
};

// An exclusive advisory lock (flock) held until destruction.
class FileLock {
 public:
  virtual ~FileLock() = default;
};

struct FileInfo {
  bool exists = false;
  bool is_directory = false;  // of the target, for a symbolic link
  bool is_symlink = false;
  bool is_regular = false;  // a regular file (not a FIFO, socket, device); of the target
  std::uint64_t size = 0;
  std::uint64_t links = 0;       // hard links to the file (st_nlink)
  std::int64_t modified_ns = 0;  // last change of the contents (st_mtim), in ns since the epoch
};

class Env {
 public:
  virtual ~Env() = default;

  // The process-wide POSIX implementation.
  static Env& posix();

  // Opens `path`. CreateExclusiveDirect and ReadDirect throw Unsupported when the file system
  // refuses O_DIRECT (the caller falls back to CreateExclusive or Read).
  virtual std::unique_ptr<File> open(const std::string& path, OpenMode mode) = 0;
  // fsync of a directory, making the entries created, renamed or removed in it durable.
  virtual void sync_dir(const std::string& dir) = 0;
  // rename(2) when `replace`; renameat2(RENAME_NOREPLACE) otherwise, which fails if `to`
  // exists (EEXIST), so a committed checkpoint is never overwritten.
  virtual void rename(const std::string& from, const std::string& to, bool replace) = 0;
  // Swaps two existing entries atomically (renameat2(RENAME_EXCHANGE)): how a committed
  // checkpoint is replaced when the caller asks for it, with a whole one at `b` at every
  // instant. This default throws Unsupported.
  virtual void exchange(const std::string& a, const std::string& b);
  virtual void mkdir(const std::string& path) = 0;
  // A second name `new_path` for the existing regular file `existing` (link(2)): how an
  // incremental save shares an unchanged shard with an older checkpoint. Durable once the new
  // name's directory is synced. This default throws Unsupported (the caller copies instead).
  virtual void link(const std::string& existing, const std::string& new_path);
  virtual void remove_file(const std::string& path) = 0;
  // Removes an empty directory.
  virtual void remove_dir(const std::string& path) = 0;
  // Names in `dir`, without "." and "..", in no particular order.
  virtual std::vector<std::string> list_dir(const std::string& dir) = 0;
  // Never throws for a missing path: returns exists == false.
  virtual FileInfo stat(const std::string& path) = 0;
  // Takes an exclusive non-blocking flock on `path` (created if missing). Throws Locked when
  // another open file description holds it.
  virtual std::unique_ptr<FileLock> lock(const std::string& path) = 0;

  // Removes `path` and, for a directory, everything below it. A missing path is not an error.
  void remove_all(const std::string& path);
  // Reads a whole (small) file into memory.
  std::string read_file(const std::string& path);
};

// Writes `bytes` to a temporary sibling of `path`, syncs it, renames it into place and syncs
// the directory: `path` then holds the new bytes whole, or (on error, thrown as IOError) what
// it held before. For small files a person or a program reads (plots, exports, reports).
void write_file_atomically(Env& env, const std::string& path, std::string_view bytes);

}  // namespace torchpoint
