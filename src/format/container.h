// The container file layout (docs/format.md), shared by the writer and the reader.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "format/dtype.h"
#include "torchpoint/env.h"
#include "torchpoint/error.h"
#include "torchpoint/tensor_file.h"

namespace torchpoint {

inline constexpr std::string_view kFormatName = "torchpoint";
inline constexpr int kFormatMajor = 1;
inline constexpr int kFormatMinor = 0;
// The same bound as the safetensors reference implementation.
inline constexpr std::uint64_t kMaxHeaderSize = 100'000'000;
// Keys inside "__metadata__".
inline constexpr std::string_view kMetadataKey = "__metadata__";
inline constexpr std::string_view kTorchpointKey = "torchpoint";
inline constexpr std::string_view kHeaderChecksumKey = "torchpoint_header_xxh3";

struct TensorEntry {
  std::string name;
  DtypeInfo dtype;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0;  // relative to the first data byte
  std::uint64_t end = 0;
  std::uint64_t checksum = 0;
};

struct ContainerHeader {
  std::uint64_t data_start = 0;           // 8 + header length
  std::vector<TensorEntry> entries;       // in data order
  std::vector<std::size_t> caller_order;  // indexes into entries, in the writer's order
  Json state = Json::object();
  std::uint64_t header_checksum = 0;
  int version_major = 0;
  int version_minor = 0;
  bool foreign = false;  // no torchpoint metadata (allowed only when asked): no checksums
};

// Where validation problems go: thrown at once as Corruption, or collected (verify).
class Problems {
 public:
  explicit Problems(std::vector<std::string>* sink = nullptr) : sink_(sink) {}
  // Collects into `report`, with each problem's code.
  explicit Problems(VerifyReport* report) : sink_(&report->problems), codes_(&report->codes) {}
  // Throws Error(code) unless collecting.
  void add(std::string message, ErrorCode code = ErrorCode::Corruption);
  bool collecting() const { return sink_ != nullptr; }
  bool any() const { return count_ > 0; }

 private:
  std::vector<std::string>* sink_;
  std::vector<ErrorCode>* codes_ = nullptr;
  std::size_t count_ = 0;
};

struct WrittenFile {
  std::uint64_t size = 0;
  std::uint64_t header_checksum = 0;
};

// Writes `contents` into a new file at `path` (created exclusively), fsyncs and closes it.
// Large files bypass the page cache (O_DIRECT) where the file system allows it. With
// `hugging_face_format`, __metadata__ also says "format": "pt", as Hugging Face's loaders of
// sharded checkpoints require (shard files have it; other files keep the 1.0 bytes).
WrittenFile write_container(Env& env, const std::string& path, const Container& contents,
                            bool hugging_face_format = false);

// Frees the chunk buffers that write_container keeps from one file to the next (at most 64
// MiB: they spare the kernel zeroing new memory at every save). For measurements of memory.
void release_chunk_buffers();

// Parses and validates the header of a container of `file_size` bytes whose first bytes are
// `prefix` (at least 8 + header length of them). Every rule that does not need the data is
// checked. With a throwing Problems the first problem throws; a collecting one returns what
// could be parsed.
// With `allow_foreign`, a safetensors file written by another tool (no torchpoint checksums)
// is accepted after the structural checks, with `foreign` set.
ContainerHeader parse_container_header(std::string_view prefix, std::uint64_t file_size,
                                       const std::string& path, Problems& problems,
                                       bool allow_foreign = false);

// load_file(), also returning the header checksum (which the manifest records).
Container load_container(Env& env, const std::string& path, std::uint64_t* header_checksum,
                         bool allow_foreign = false, bool* verified = nullptr);
// Which tensors of a container to read, by name, given its state (the header's JSON).
using TensorFilter = std::function<bool(const std::string& tensor, const Json& state)>;
// load_container() of the tensors `keep` accepts (all with an empty filter): the header is
// read and checked whole, and each tensor read against its checksum; the others are neither
// read nor returned. `bytes_read`: the header's and the kept tensors' bytes.
Container load_container_part(Env& env, const std::string& path, const TensorFilter& keep,
                              std::uint64_t* header_checksum, std::uint64_t* bytes_read,
                              bool allow_foreign = false, bool* verified = nullptr);

// load_file_into()'s two passes, apart, so that a directory load can verify every file before
// any tensor changes, and copy the files in only once nothing else can fail.
class FileFill {
 public:
  // Opens `path` and checks it against `into`: header, names, dtypes and shapes, then (reading
  // the whole file once) every checksum and its size. Changes no tensor. A mismatch of names,
  // dtypes or shapes throws Incompatible naming each, or, with `mismatches`, fills it and
  // returns with fits() false before reading any data. Other errors as load_file_into().
  FileFill(Env& env, const std::string& path, const NamedTensors& into,
           std::vector<std::string>* mismatches = nullptr);
  ~FileFill();
  FileFill(FileFill&&) noexcept;
  FileFill& operator=(FileFill&&) noexcept;

  bool fits() const;
  const Json& state() const;
  std::uint64_t header_checksum() const;
  // The second pass: reads the file again into the tensors (each chunk checked against the
  // first pass's reading) and bumps their version counters. Only once, and only when fits().
  // An error here (the file unreadable, or changed since the first pass) says that the
  // tensors may hold part of the file.
  void copy();

 private:
  void copy_fresh();

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Bytes read at a time by the readers that stream a file's data (verify, extra files).
inline constexpr std::size_t kReadBufferSize = std::size_t{4} << 20;

// XXH3 of `size` bytes of `file` at `offset`, read in pieces through `buffer` (one read when
// it is large enough). Throws Corruption when the file ends first (truncated while read).
std::uint64_t checksum_range(File& file, std::uint64_t offset, std::uint64_t size,
                             std::vector<std::uint8_t>& buffer);

// Reads and parses the header of an open file.
ContainerHeader read_container_header(File& file, const std::string& path, Problems& problems,
                                      bool allow_foreign = false);

}  // namespace torchpoint
