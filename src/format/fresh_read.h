// A container file's data read once into new memory, every checksum checked as the pieces
// land: the one-read way to load (load_file, load_file_into), used where the memory is there.
#pragma once

#include <c10/core/Allocator.h>

#include <cstdint>
#include <memory>
#include <string>

#include "format/container.h"

namespace torchpoint {

// Anonymous memory holding a copy of one file's data region. Tensors are made over it by
// adopt(): each adopted piece keeps the memory alive, and when its storage dies it gives the
// whole pages inside it back to the system; the mapping goes when the last piece and the
// FreshData are gone. Not thread-safe; the pieces may die on any thread.
class FreshData {
 public:
  // Reads the data of `file` (at `path`, opened in `env`) described by `header`, and checks
  // every tensor's checksum (a foreign file has none). Files that are not mostly in the page
  // cache are read with O_DIRECT and several requests in flight where the file system allows
  // it, and hashed on the calling thread as the pieces land. Throws Corruption naming the
  // first tensor that fails, or when the file is shorter than its header says; IOError for a
  // failed read; Unsupported when the memory cannot be had. No memory is kept after a throw.
  static FreshData read(Env& env, const std::string& path, File& file,
                        const ContainerHeader& header);

  FreshData();
  ~FreshData();
  FreshData(FreshData&&) noexcept;
  FreshData& operator=(FreshData&&) noexcept;

  // The bytes of `entry` (one of the header's), valid while this FreshData lives.
  char* bytes(const TensorEntry& entry) const;
  // A DataPtr over the bytes of `entry`, owning its share of the memory. Each entry at most
  // once: two storages must not share pages they would both give back.
  c10::DataPtr adopt(const TensorEntry& entry);
  // Whether `data` came from adopt() (of any FreshData).
  static bool adopted(const c10::DataPtr& data);

  struct Block;  // the mapping and its count of owners (fresh_read.cc)

 private:
  Block* block_ = nullptr;
  std::uint64_t data_start_ = 0;
};

// While one lives, FreshData::read on its thread reads through the page cache even a file that
// is not in it: other processes of this machine are reading the same files at the same time
// (load_state with several processes per node), and through the page cache the device is read
// once for all of them, where O_DIRECT would read it once per process.
class SharedReads {
 public:
  explicit SharedReads(bool shared);
  ~SharedReads();
  SharedReads(const SharedReads&) = delete;
  SharedReads& operator=(const SharedReads&) = delete;

 private:
  bool previous_;
};

// Tensors smaller than this are copied out of FreshData rather than adopted: a piece keeps
// its whole mapping alive, and a small one gives no page back when it dies.
inline constexpr std::uint64_t kAdoptFrom = std::uint64_t{64} << 10;

// Whether a load may take FreshData's extra memory for `bytes` of data: the file must fit in
// half of what the system says is available (MemAvailable), and TORCHPOINT_LOAD_MEMORY must
// not be "frugal" (which asks for loads into existing tensors that allocate nothing of the
// file's size).
bool fresh_memory_available(std::uint64_t bytes);

}  // namespace torchpoint
