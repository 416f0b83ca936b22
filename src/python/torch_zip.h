// A reader for the zip archives that torch.save writes (PyTorch >= 1.6): every record stored
// uncompressed under one top directory ("archive/data.pkl", "archive/data/0", ...), with a
// ZIP64 end record. Only what those files use is supported; the bytes are treated as hostile.
// The archive is read from its end (the directory) and record by record with pread, never
// whole: a file of any size costs memory only for its directory and the records asked for.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "torchpoint/env.h"

namespace torchpoint::detail {

// The records of a zip archive in an open file. Construction checks the whole directory (every
// record lies inside the archive, none is compressed or encrypted, no name repeats); read()
// checks a record's local header and CRC-32 before handing out its bytes.
class TorchZip {
 public:
  // `file` must outlive the reader; `path` names it in error messages. Throws Corruption when
  // the file is not a zip archive or its directory is damaged (or over 1 GiB), Unsupported for
  // a compressed or encrypted record.
  TorchZip(File& file, std::string path);

  // The directory of the first record ("archive" for "archive/data.pkl"), under which
  // torch.save puts every record.
  const std::string& prefix() const { return prefix_; }
  bool contains(const std::string& name) const { return index_.contains(name); }
  // Stored size of a record that contains() reports.
  std::uint64_t size(const std::string& name) const;
  // The bytes of record `name`. Throws Corruption naming the file and record when it is
  // missing, its local header disagrees with the directory, or its CRC-32 does not match.
  std::string read(const std::string& name) const;
  // The same, into `out`, which holds size(name) bytes.
  void read_into(const std::string& name, void* out) const;

 private:
  struct Record {
    std::string name;
    std::uint64_t header_offset = 0;  // of the local file header
    std::uint64_t size = 0;
    std::uint32_t crc32 = 0;
  };

  [[noreturn]] void fail(const std::string& cause) const;
  std::string bytes_at(std::uint64_t offset, std::uint64_t size) const;
  void read_directory(std::uint64_t offset, const std::string& directory, std::uint64_t count);

  File& file_;
  std::string path_;
  std::string prefix_;
  std::uint64_t directory_offset_ = 0;  // records must end before it
  std::vector<Record> records_;
  std::unordered_map<std::string, std::size_t> index_;
};

// CRC-32 (IEEE 802.3, as zip uses) of `data`.
std::uint32_t crc32(std::string_view data);

}  // namespace torchpoint::detail
