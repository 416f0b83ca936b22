// MemoryEnv: a read-only Env over files held in memory, so the fuzz targets drive the public
// readers (load_file, verify, TensorFileReader, load_directory) without touching the disk.
//
// Each file is stored in an allocation of exactly its size, so AddressSanitizer catches a read
// one byte past its end. Calls that would modify anything throw Unsupported.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "torchpoint/env.h"

namespace torchpoint::fuzz {

class MemoryEnv : public Env {
 public:
  // Adds (or replaces) the file at `path`; its parent directories exist implicitly.
  void add_file(const std::string& path, std::string_view bytes);

  std::unique_ptr<File> open(const std::string& path, OpenMode mode) override;
  void sync_dir(const std::string& dir) override;
  void rename(const std::string& from, const std::string& to, bool replace) override;
  void mkdir(const std::string& path) override;
  void remove_file(const std::string& path) override;
  void remove_dir(const std::string& path) override;
  std::vector<std::string> list_dir(const std::string& dir) override;
  FileInfo stat(const std::string& path) override;
  std::unique_ptr<FileLock> lock(const std::string& path) override;

 private:
  using Bytes = std::vector<std::uint8_t>;
  std::map<std::string, std::shared_ptr<const Bytes>> files_;
};

}  // namespace torchpoint::fuzz
