#include "memory_env.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "torchpoint/error.h"

namespace torchpoint::fuzz {
namespace {

using Bytes = std::vector<std::uint8_t>;

class MemoryRegion : public MappedRegion {
 public:
  explicit MemoryRegion(std::shared_ptr<const Bytes> bytes) : bytes_(std::move(bytes)) {
    data_ = bytes_->data();
    size_ = bytes_->size();
  }

 private:
  std::shared_ptr<const Bytes> bytes_;
};

class MemoryFile : public File {
 public:
  MemoryFile(std::string path, std::shared_ptr<const Bytes> bytes)
      : File(std::move(path), false), bytes_(std::move(bytes)) {}

  std::size_t write_at(const void*, std::size_t, std::uint64_t) override { read_only(); }
  std::size_t read_at(void* data, std::size_t size, std::uint64_t offset) override {
    if (offset >= bytes_->size()) return 0;
    std::size_t n = std::min<std::uint64_t>(size, bytes_->size() - offset);
    std::memcpy(data, bytes_->data() + offset, n);
    return n;
  }
  void sync() override { read_only(); }
  void truncate(std::uint64_t) override { read_only(); }
  void close() override {}
  std::uint64_t size() override { return bytes_->size(); }
  std::shared_ptr<MappedRegion> map() override { return std::make_shared<MemoryRegion>(bytes_); }

 private:
  [[noreturn]] void read_only() {
    throw Error(ErrorCode::Unsupported, path() + ": the fuzzing Env is read-only");
  }
  std::shared_ptr<const Bytes> bytes_;
};

[[noreturn]] void read_only(const std::string& path) {
  throw Error(ErrorCode::Unsupported, path + ": the fuzzing Env is read-only");
}

}  // namespace

void MemoryEnv::add_file(const std::string& path, std::string_view bytes) {
  files_[path] = std::make_shared<const Bytes>(bytes.begin(), bytes.end());
}

std::unique_ptr<File> MemoryEnv::open(const std::string& path, OpenMode mode) {
  if (mode != OpenMode::Read && mode != OpenMode::ReadDirect) read_only(path);
  auto it = files_.find(path);
  if (it == files_.end()) throw Error(ErrorCode::NotFound, path + " does not exist");
  return std::make_unique<MemoryFile>(path, it->second);
}

void MemoryEnv::sync_dir(const std::string& dir) { read_only(dir); }
void MemoryEnv::rename(const std::string& from, const std::string&, bool) { read_only(from); }
void MemoryEnv::mkdir(const std::string& path) { read_only(path); }
void MemoryEnv::remove_file(const std::string& path) { read_only(path); }
void MemoryEnv::remove_dir(const std::string& path) { read_only(path); }
std::unique_ptr<FileLock> MemoryEnv::lock(const std::string& path) { read_only(path); }

std::vector<std::string> MemoryEnv::list_dir(const std::string& dir) {
  std::string prefix = dir.ends_with('/') ? dir : dir + "/";
  std::set<std::string> names;
  for (const auto& [path, bytes] : files_) {
    if (!path.starts_with(prefix)) continue;
    std::string rest = path.substr(prefix.size());
    names.insert(rest.substr(0, rest.find('/')));
  }
  if (names.empty()) throw Error(ErrorCode::NotFound, dir + " is not a directory");
  return {names.begin(), names.end()};
}

FileInfo MemoryEnv::stat(const std::string& path) {
  FileInfo info;
  auto it = files_.find(path);
  if (it != files_.end()) {
    info.exists = true;
    info.is_regular = true;
    info.size = it->second->size();
    return info;
  }
  std::string prefix = path.ends_with('/') ? path : path + "/";
  auto below = files_.lower_bound(prefix);
  if (below != files_.end() && below->first.starts_with(prefix)) {
    info.exists = true;
    info.is_directory = true;
  }
  return info;
}

}  // namespace torchpoint::fuzz
