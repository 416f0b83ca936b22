// PosixEnv: Env over the Linux system calls.
#include <dirent.h>
#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <vector>

#include "io/posix_error.h"
#include "torchpoint/env.h"

namespace torchpoint {
namespace {

class PosixMappedRegion final : public MappedRegion {
 public:
  PosixMappedRegion(void* addr, std::size_t size) {
    data_ = static_cast<const std::uint8_t*>(addr);
    size_ = size;
  }
  ~PosixMappedRegion() override {
    if (size_ > 0) ::munmap(const_cast<std::uint8_t*>(data_), size_);
  }
};

class PosixFile final : public File {
 public:
  PosixFile(std::string path, int fd, bool direct) : File(std::move(path), direct), fd_(fd) {}

  ~PosixFile() override {
    // Swallowed on purpose: a destructor cannot report, and callers who care call close().
    if (fd_ >= 0) ::close(fd_);
  }

  std::size_t write_at(const void* data, std::size_t size, std::uint64_t offset) override {
    for (;;) {
      ssize_t n = ::pwrite(fd_, data, size, static_cast<off_t>(offset));
      if (n >= 0) return static_cast<std::size_t>(n);
      if (errno == EINTR) continue;
      throw posix_error(fmt::format("write of {} bytes to {} at offset {}", size, path(), offset),
                        errno);
    }
  }

  std::size_t read_at(void* data, std::size_t size, std::uint64_t offset) override {
    for (;;) {
      ssize_t n = ::pread(fd_, data, size, static_cast<off_t>(offset));
      if (n >= 0) return static_cast<std::size_t>(n);
      if (errno == EINTR) continue;
      throw posix_error(fmt::format("read of {} bytes from {} at offset {}", size, path(), offset),
                        errno);
    }
  }

  void sync() override {
    // No EINTR loop: fsync is not interrupted by signals on Linux, and a failed fsync must
    // never be retried and trusted (the kernel may have dropped the dirty pages).
    if (::fsync(fd_) != 0) throw posix_error(fmt::format("fsync of {}", path()), errno);
  }

  void truncate(std::uint64_t size) override {
    if (::ftruncate(fd_, static_cast<off_t>(size)) != 0) {
      throw posix_error(fmt::format("truncate of {} to {} bytes", path(), size), errno);
    }
  }

  void close() override {
    int fd = fd_;
    fd_ = -1;
    // Linux releases the descriptor even when close fails, so it is never retried.
    if (fd >= 0 && ::close(fd) != 0) throw posix_error(fmt::format("close of {}", path()), errno);
  }

  std::uint64_t size() override {
    struct stat st;
    if (::fstat(fd_, &st) != 0) throw posix_error(fmt::format("stat of {}", path()), errno);
    return static_cast<std::uint64_t>(st.st_size);
  }

  std::shared_ptr<MappedRegion> map() override {
    std::uint64_t n = size();
    if (n == 0) return std::make_shared<PosixMappedRegion>(nullptr, 0);
    // Populated read-only first: populating a writable private mapping would copy every page.
    void* addr = ::mmap(nullptr, n, PROT_READ, MAP_PRIVATE | MAP_POPULATE, fd_, 0);
    if (addr == MAP_FAILED) throw posix_error(fmt::format("mmap of {}", path()), errno);
    // Then writable, copy-on-write: tensors built on the mapping can be trained in place, and
    // only the pages actually written are copied; the file never changes.
    if (::mprotect(addr, n, PROT_READ | PROT_WRITE) != 0) {
      int err = errno;
      ::munmap(addr, n);
      throw posix_error(fmt::format("mprotect of the mapping of {}", path()), err);
    }
    return std::make_shared<PosixMappedRegion>(addr, n);
  }

  double cached_fraction(std::uint64_t offset, std::uint64_t size) override {
    if (size == 0) return 1.0;
    const std::uint64_t page = static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
    const std::uint64_t first = offset / page * page;
    const std::uint64_t length = offset + size - first;
    // A mapping that is never touched, only asked which of its pages are resident.
    void* addr = ::mmap(nullptr, length, PROT_READ, MAP_PRIVATE, fd_, static_cast<off_t>(first));
    if (addr == MAP_FAILED) return 1.0;  // only an estimate: "cached" asks for nothing special
    std::vector<unsigned char> resident((length + page - 1) / page);
    double fraction = 1.0;
    if (::mincore(addr, length, resident.data()) == 0) {
      std::size_t in = 0;
      for (unsigned char r : resident) in += r & 1;
      fraction = static_cast<double>(in) / static_cast<double>(resident.size());
    }
    ::munmap(addr, length);
    return fraction;
  }

 private:
  int fd_;
};

class PosixFileLock final : public FileLock {
 public:
  explicit PosixFileLock(int fd) : fd_(fd) {}
  ~PosixFileLock() override {
    ::flock(fd_, LOCK_UN);
    ::close(fd_);
  }

 private:
  int fd_;
};

// Closes `fd` and throws InvalidArgument unless it is a regular file (not a FIFO, socket,
// device or directory).
void require_regular(int fd, const std::string& path, const char* what) {
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    throw posix_error(fmt::format("stat of {}", path), err);
  }
  if (S_ISREG(st.st_mode)) return;
  ::close(fd);
  const char* kind = S_ISFIFO(st.st_mode)   ? "a FIFO"
                     : S_ISSOCK(st.st_mode) ? "a socket"
                     : S_ISCHR(st.st_mode)  ? "a character device"
                     : S_ISBLK(st.st_mode)  ? "a block device"
                     : S_ISDIR(st.st_mode)  ? "a directory"
                                            : "not a regular file";
  throw Error(ErrorCode::InvalidArgument,
              fmt::format("{} is {}, where {} should be; torchpoint reads and locks only regular "
                          "files: remove or rename it",
                          path, kind, what));
}

class PosixEnv final : public Env {
 public:
  std::unique_ptr<File> open(const std::string& path, OpenMode mode) override {
    int flags = O_CLOEXEC;
    bool direct = false;
    switch (mode) {
      case OpenMode::Read:
        // O_NONBLOCK: a FIFO (or a device) put where a checkpoint file belongs would otherwise
        // block this open forever; it is refused below instead. For a regular file the flag
        // changes nothing.
        flags |= O_RDONLY | O_NONBLOCK;
        break;
      case OpenMode::ReadDirect:
        flags |= O_RDONLY | O_NONBLOCK | O_DIRECT;
        direct = true;
        break;
      case OpenMode::CreateExclusive:
        flags |= O_WRONLY | O_CREAT | O_EXCL;
        break;
      case OpenMode::CreateExclusiveDirect:
        flags |= O_WRONLY | O_CREAT | O_EXCL | O_DIRECT;
        direct = true;
        break;
    }
    int fd;
    do {
      fd = ::open(path.c_str(), flags, 0644);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) {
      if (direct && errno == EINVAL) {
        throw Error(
            ErrorCode::Unsupported,
            fmt::format("O_DIRECT is not supported for {} (falls back to buffered I/O)", path));
      }
      throw posix_error(fmt::format("open of {}", path), errno);
    }
    if (mode == OpenMode::Read || mode == OpenMode::ReadDirect) {
      require_regular(fd, path, "a checkpoint file");
    }
    return std::make_unique<PosixFile>(path, fd, direct);
  }

  void sync_dir(const std::string& dir) override {
    int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0) throw posix_error(fmt::format("open of directory {} for fsync", dir), errno);
    int rc = ::fsync(fd);
    int err = errno;
    ::close(fd);
    if (rc != 0) throw posix_error(fmt::format("fsync of directory {}", dir), err);
  }

  void rename(const std::string& from, const std::string& to, bool replace) override {
    int rc = replace ? ::rename(from.c_str(), to.c_str())
                     : ::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_NOREPLACE);
    if (rc != 0) throw posix_error(fmt::format("rename of {} to {}", from, to), errno);
  }

  void exchange(const std::string& a, const std::string& b) override {
    if (::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) != 0) {
      throw posix_error(fmt::format("exchange of {} and {}", a, b), errno);
    }
  }

  void link(const std::string& existing, const std::string& new_path) override {
    if (::link(existing.c_str(), new_path.c_str()) != 0) {
      throw posix_error(fmt::format("link of {} as {}", existing, new_path), errno);
    }
  }

  void mkdir(const std::string& path) override {
    if (::mkdir(path.c_str(), 0755) != 0) {
      throw posix_error(fmt::format("mkdir of {}", path), errno);
    }
  }

  void remove_file(const std::string& path) override {
    if (::unlink(path.c_str()) != 0) throw posix_error(fmt::format("removal of {}", path), errno);
  }

  void remove_dir(const std::string& path) override {
    if (::rmdir(path.c_str()) != 0) {
      throw posix_error(fmt::format("removal of directory {}", path), errno);
    }
  }

  std::vector<std::string> list_dir(const std::string& dir) override {
    DIR* d = ::opendir(dir.c_str());
    if (d == nullptr) throw posix_error(fmt::format("listing of {}", dir), errno);
    std::vector<std::string> names;
    errno = 0;
    while (dirent* e = ::readdir(d)) {
      std::string name = e->d_name;
      if (name != "." && name != "..") names.push_back(std::move(name));
      errno = 0;
    }
    int err = errno;
    ::closedir(d);
    if (err != 0) throw posix_error(fmt::format("listing of {}", dir), err);
    return names;
  }

  FileInfo stat(const std::string& path) override {
    struct stat st;
    FileInfo info;
    if (::lstat(path.c_str(), &st) != 0) {
      if (errno == ENOENT || errno == ENOTDIR) return info;
      throw posix_error(fmt::format("stat of {}", path), errno);
    }
    info.exists = true;
    if (S_ISLNK(st.st_mode)) {
      info.is_symlink = true;
      if (::stat(path.c_str(), &st) != 0) return info;  // dangling: a link to nothing
    }
    info.is_directory = S_ISDIR(st.st_mode);
    info.is_regular = S_ISREG(st.st_mode);
    info.size = static_cast<std::uint64_t>(st.st_size);
    info.links = static_cast<std::uint64_t>(st.st_nlink);
    info.modified_ns = static_cast<std::int64_t>(st.st_mtim.tv_sec) * 1'000'000'000 +
                       st.st_mtim.tv_nsec;
    return info;
  }

  std::unique_ptr<FileLock> lock(const std::string& path) override {
    // O_NOFOLLOW: a .lock that is a symbolic link must not create or lock its target, which
    // may lie outside the project.
    int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
    if (fd < 0 && errno == ELOOP) {
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("lock file {} is a symbolic link; torchpoint locks only a regular "
                              "file it creates itself: remove the link",
                              path));
    }
    if (fd < 0) throw posix_error(fmt::format("open of lock file {}", path), errno);
    require_regular(fd, path, "a lock file");
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      int err = errno;
      ::close(fd);
      if (err == EWOULDBLOCK) {
        throw Error(ErrorCode::Locked,
                    fmt::format("{} is held by another writer: another process (or another "
                                "Accelerator in this one) is saving into this directory; stop it "
                                "or use another project directory",
                                path));
      }
      throw posix_error(fmt::format("flock of {}", path), err);
    }
    return std::make_unique<PosixFileLock>(fd);
  }
};

}  // namespace

Env& Env::posix() {
  static PosixEnv env;
  return env;
}

}  // namespace torchpoint
