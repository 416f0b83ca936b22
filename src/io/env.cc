#include "torchpoint/env.h"

#include <fmt/format.h>

#include <cerrno>
#include <cstring>

#include "io/posix_error.h"

namespace torchpoint {

Error posix_error(const std::string& context, int err) {
  const char* hint = "";
  ErrorCode code = ErrorCode::IOError;
  switch (err) {
    case ENOENT:
      code = ErrorCode::NotFound;
      hint = "check the path";
      break;
    case ENOSPC:
      hint = "the disk is full: free space or point the checkpoint elsewhere";
      break;
    case EDQUOT:
      hint = "the disk quota is exhausted: free space or raise the quota";
      break;
    case EFBIG:
      hint = "the file is too large for this file system or for RLIMIT_FSIZE";
      break;
    case EXDEV:
      hint = "temporary and final paths must be on the same file system";
      break;
    case EACCES:
    case EPERM:
      hint = "check the permissions of the file and of the directories above it";
      break;
    case EIO:
      hint = "the device reported an error: the data written may be lost";
      break;
    case EEXIST:
      hint = "the target already exists and is never overwritten";
      break;
    case EROFS:
      hint = "the file system is read-only";
      break;
    default:
      break;
  }
  std::string message = fmt::format("{} failed: {}", context, std::strerror(err));
  if (*hint != '\0') message += fmt::format(" ({})", hint);
  return Error(code, message);
}

void File::write_all(const void* data, std::size_t size, std::uint64_t offset) {
  const auto* p = static_cast<const std::uint8_t*>(data);
  while (size > 0) {
    std::size_t n = write_at(p, size, offset);
    if (n == 0) {
      throw Error(ErrorCode::IOError,
                  fmt::format("write to {} at offset {} wrote nothing (is the disk full?)", path(),
                              offset));
    }
    p += n;
    size -= n;
    offset += n;
  }
}

double File::cached_fraction(std::uint64_t, std::uint64_t) { return 1.0; }

void File::read_exact(void* data, std::size_t size, std::uint64_t offset) {
  auto* p = static_cast<std::uint8_t*>(data);
  while (size > 0) {
    std::size_t n = read_at(p, size, offset);
    if (n == 0) {
      throw Error(ErrorCode::Corruption,
                  fmt::format("{} ends at offset {} but {} more bytes were expected: the file "
                              "is truncated",
                              path(), offset, size));
    }
    p += n;
    size -= n;
    offset += n;
  }
}

void Env::exchange(const std::string& a, const std::string& b) {
  throw Error(ErrorCode::Unsupported,
              fmt::format("this Env cannot exchange {} and {} atomically, which replacing a "
                          "committed checkpoint needs: write to a new directory instead",
                          a, b));
}

void Env::link(const std::string& existing, const std::string& new_path) {
  throw Error(ErrorCode::Unsupported,
              fmt::format("this Env cannot make {} a second name of {}", new_path, existing));
}

void Env::remove_all(const std::string& path) {
  FileInfo info = stat(path);
  if (!info.exists) return;
  // A link is removed, never followed: cleanup must not reach outside the directory.
  if (!info.is_directory || info.is_symlink) {
    remove_file(path);
    return;
  }
  for (const std::string& name : list_dir(path)) remove_all(path + "/" + name);
  remove_dir(path);
}

std::string Env::read_file(const std::string& path) {
  std::unique_ptr<File> file = open(path, OpenMode::Read);
  std::uint64_t size = file->size();
  std::string bytes(size, '\0');
  file->read_exact(bytes.data(), size, 0);
  return bytes;
}

}  // namespace torchpoint
