// FreshData: one read of a file's data into memory of its own, hashed as it lands.
//
// Verifying before anything changes used to cost two reads of the file for a load into
// existing tensors (load_file_into: hash the file, then read it again into the tensors). Here
// the one read goes into new memory, which the tensors then adopt (their storages point at it:
// FileFill::copy) or are copied from. A cold file is read with O_DIRECT, four requests of
// 4 MiB in flight, into huge pages: on the development machine that read 268 MB in 0.13 s,
// against 0.15 s for a buffered pread() into memory that already exists and 0.16 s for the
// page-cache mapping safetensors uses. A file mostly in the page cache is copied from it.
#include "format/fresh_read.h"

#include <fmt/format.h>
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <fstream>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include "format/checksum.h"
#include "io/huge_pages.h"

namespace torchpoint {
namespace {

constexpr std::uint64_t kPage = 4096;  // also O_DIRECT's alignment of offsets and sizes
constexpr std::uint64_t kBlock = std::uint64_t{4} << 20;
constexpr int kDirectReaders = 4;  // requests in flight; the threads mostly wait on the device
constexpr int kCachedReaders = 2;
// Below this one thread reads and then hashes: threads and O_DIRECT cost more than they save.
constexpr std::uint64_t kParallelFrom = std::uint64_t{8} << 20;
// A file with less than this share of its data in the page cache is read from the device.
constexpr double kCachedShare = 0.5;

thread_local bool shared_reads = false;

std::uint64_t round_down(std::uint64_t v, std::uint64_t a) { return v / a * a; }
std::uint64_t align_up(std::uint64_t v, std::uint64_t a) { return (v + a - 1) / a * a; }

// Gives the whole pages inside [begin, end) back to the system.
void release_pages(char* begin, char* end) {
  const auto b = align_up(reinterpret_cast<std::uintptr_t>(begin), kPage);
  const auto e = round_down(reinterpret_cast<std::uintptr_t>(end), kPage);
  if (e > b) ::madvise(reinterpret_cast<void*>(b), e - b, MADV_DONTNEED);
}

}  // namespace

struct FreshData::Block {
  void* map = nullptr;
  std::size_t map_size = 0;
  char* base = nullptr;    // holds the file's byte at offset `first`
  std::uint64_t first = 0;
  std::uint64_t length = 0;
  std::atomic<std::size_t> refs{1};
  std::vector<std::pair<char*, char*>> adopted;  // touched only by FreshData's owner

  void unref() {
    if (refs.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      ::munmap(map, map_size);
      delete this;
    }
  }
};

namespace {

struct Piece {
  FreshData::Block* block;
  char* begin;
  char* end;
};

void release_piece(void* context) {
  auto* piece = static_cast<Piece*>(context);
  release_pages(piece->begin, piece->end);
  FreshData::Block* block = piece->block;
  delete piece;
  block->unref();
}

// The reads of [first, first + length) into `base`, by `threads` threads pulling kBlock
// pieces, with the prefix that has landed published to one waiting hasher.
class BlockReads {
 public:
  BlockReads(File& file, char* base, std::uint64_t first, std::uint64_t length, int threads)
      : file_(file),
        base_(base),
        first_(first),
        length_(length),
        blocks_((length + kBlock - 1) / kBlock),
        done_(blocks_, 0),
        landed_end_(length) {
    try {
      for (int t = 0; t < threads; ++t) threads_.emplace_back([this] { run(); });
    } catch (...) {
      stop();
      throw;
    }
  }
  ~BlockReads() { stop(); }

  // Waits until the bytes up to file offset `until` have landed, or no more will; returns the
  // file offset up to which they have, and rethrows a read's failure.
  std::uint64_t wait_for(std::uint64_t until) {
    std::unique_lock<std::mutex> lock(mutex_);
    changed_.wait(lock, [&] { return failure_ || landed() >= until || finished(); });
    if (failure_) std::rethrow_exception(failure_);
    return landed();
  }

  // Stops handing out blocks and waits for the readers.
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    for (auto& t : threads_) {
      if (t.joinable()) t.join();
    }
  }

 private:
  // File offset up to which everything landed (under mutex_).
  std::uint64_t landed() const {
    return first_ + std::min(std::min(prefix_ * kBlock, length_), landed_end_);
  }
  bool finished() const { return prefix_ == blocks_; }

  void run() {
    try {
      for (;;) {
        std::uint64_t b = next_.fetch_add(1);
        {
          std::lock_guard<std::mutex> lock(mutex_);
          if (stopping_ || failure_ || b >= blocks_) return;
        }
        const std::uint64_t at = b * kBlock;
        const std::uint64_t size = std::min(kBlock, length_ - at);
        std::uint64_t got = 0;
        while (got < size) {
          std::size_t n = file_.read_at(base_ + at + got, size - got, first_ + at + got);
          got += n;
          // The end of the file. A direct read can only go on from an aligned offset, and a
          // regular file reads short only at its end.
          if (n == 0 || (file_.direct() && got < size)) break;
        }
        std::lock_guard<std::mutex> lock(mutex_);
        if (got < size) landed_end_ = std::min(landed_end_, at + got);
        done_[b] = 1;
        while (prefix_ < blocks_ && done_[prefix_]) ++prefix_;
        changed_.notify_all();
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!failure_) failure_ = std::current_exception();
      changed_.notify_all();
    }
  }

  File& file_;
  char* base_;
  const std::uint64_t first_, length_, blocks_;
  std::atomic<std::uint64_t> next_{0};
  std::mutex mutex_;
  std::condition_variable changed_;
  std::vector<char> done_;
  std::uint64_t prefix_ = 0;      // blocks [0, prefix_) all landed
  std::uint64_t landed_end_;      // relative: where a read met the end of the file
  bool stopping_ = false;
  std::exception_ptr failure_;
  std::vector<std::thread> threads_;
};

Error size_changed(const std::string& path, std::uint64_t size, std::uint64_t expected) {
  return Error(ErrorCode::Corruption,
               fmt::format("{} changed size while being read ({} bytes, its header says {}): "
                           "another process truncated or rewrote it; nothing was loaded",
                           path, size, expected));
}

}  // namespace

FreshData::FreshData() = default;
FreshData::~FreshData() {
  if (block_ == nullptr) return;
  // The pages of what no tensor adopted go back now; those of adopted pieces when they die.
  if (block_->refs.load(std::memory_order_acquire) > 1) {
    auto& adopted = block_->adopted;
    std::sort(adopted.begin(), adopted.end());
    char* at = block_->base;
    for (const auto& [begin, end] : adopted) {
      release_pages(at, begin);
      at = std::max(at, end);
    }
    release_pages(at, block_->base + block_->length);
  }
  block_->unref();
}
FreshData::FreshData(FreshData&& other) noexcept
    : block_(std::exchange(other.block_, nullptr)), data_start_(other.data_start_) {}
FreshData& FreshData::operator=(FreshData&& other) noexcept {
  if (this != &other) {
    FreshData gone(std::move(*this));
    block_ = std::exchange(other.block_, nullptr);
    data_start_ = other.data_start_;
  }
  return *this;
}

char* FreshData::bytes(const TensorEntry& entry) const {
  return block_->base + (data_start_ + entry.begin - block_->first);
}

c10::DataPtr FreshData::adopt(const TensorEntry& entry) {
  char* begin = bytes(entry);
  char* end = begin + (entry.end - entry.begin);
  auto* piece = new Piece{block_, begin, end};
  block_->refs.fetch_add(1, std::memory_order_relaxed);
  block_->adopted.emplace_back(begin, end);
  return c10::DataPtr(begin, piece, &release_piece, c10::Device(c10::DeviceType::CPU));
}

bool FreshData::adopted(const c10::DataPtr& data) { return data.get_deleter() == &release_piece; }

FreshData FreshData::read(Env& env, const std::string& path, File& file,
                          const ContainerHeader& header) {
  const std::uint64_t total = header.entries.empty() ? 0 : header.entries.back().end;
  const std::uint64_t data_end = header.data_start + total;
  FreshData out;
  out.data_start_ = header.data_start;
  auto* block = new Block;
  out.block_ = block;
  block->first = round_down(header.data_start, kPage);
  block->length = align_up(data_end, kPage) - block->first;
  const bool huge = block->length >= kHugePageSize;
  // Room to place the data on a 2 MiB boundary, for huge pages and O_DIRECT alike.
  block->map_size = std::max<std::uint64_t>(block->length + (huge ? kHugePageSize : 0), kPage);
  void* map = ::mmap(nullptr, block->map_size, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (map == MAP_FAILED) {
    block->map_size = 0;  // nothing to unmap
    block->map = nullptr;
    throw Error(ErrorCode::Unsupported,
                fmt::format("{}: no memory for its {} bytes of data: free memory, or set "
                            "TORCHPOINT_LOAD_MEMORY=frugal to load without a copy of the file",
                            path, total));
  }
  block->map = map;
  block->base = static_cast<char*>(map);
  if (huge) {
    block->base = reinterpret_cast<char*>(
        align_up(reinterpret_cast<std::uintptr_t>(map), kHugePageSize));
    advise_huge_pages(block->base, block->length);
  }

  // Cold files straight from the device, with several requests in flight; warm ones from the
  // page cache, where a direct read would go to the device again.
  std::unique_ptr<File> direct;
  if (total >= kParallelFrom && !shared_reads &&
      file.cached_fraction(header.data_start, total) < kCachedShare) {
    try {
      direct = env.open(path, OpenMode::ReadDirect);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::Unsupported) throw;
      // Swallowed: a file system without O_DIRECT is read through the page cache instead.
    }
  }
  File& source = direct ? *direct : file;
  const int threads = total < kParallelFrom ? 0 : direct ? kDirectReaders : kCachedReaders;
  std::unique_ptr<BlockReads> reads;
  std::uint64_t landed = data_end;
  if (threads > 0) {
    reads = std::make_unique<BlockReads>(source, block->base, block->first, block->length,
                                         threads);
    landed = block->first;
  } else if (total > 0) {
    std::uint64_t got = 0;
    char* to = block->base + (header.data_start - block->first);
    while (got < total) {
      std::size_t n = source.read_at(to + got, total - got, header.data_start + got);
      if (n == 0) break;
      got += n;
    }
    landed = header.data_start + got;
  }

  // Each tensor's checksum as soon as its bytes are in: those of a tensor larger than what
  // has landed are hashed in pieces as they come.
  for (const TensorEntry& e : header.entries) {
    const std::uint64_t from = header.data_start + e.begin;
    const std::uint64_t to = header.data_start + e.end;
    // Waits for the tensor's first byte only: a large one is hashed while the rest lands.
    if (reads && landed < to) landed = reads->wait_for(std::min(from + 1, to));
    if (header.foreign) {
      if (landed < to) break;
      continue;
    }
    std::uint64_t actual;
    if (landed >= to) {
      actual = xxh3(out.bytes(e), to - from);
    } else {
      Xxh3Stream stream;
      std::uint64_t at = from;
      while (at < to) {
        std::uint64_t until = std::min(reads ? reads->wait_for(at + 1) : landed, to);
        if (until <= at) break;  // the file ended
        stream.update(out.bytes(e) + (at - from), until - at);
        at = until;
      }
      if (at < to) {
        landed = at;
        break;
      }
      actual = stream.digest();
    }
    if (actual != e.checksum) {
      throw Error(ErrorCode::Corruption,
                  fmt::format("{}: tensor '{}' fails its checksum (stored {}, computed {}): its "
                              "data is corrupt; nothing was loaded",
                              path, e.name, checksum_hex(e.checksum), checksum_hex(actual)));
    }
  }
  if (reads) {
    landed = reads->wait_for(data_end);
    reads->stop();
  }
  if (landed < data_end) throw size_changed(path, landed, data_end);
  const std::uint64_t size = file.size();
  if (size != data_end) throw size_changed(path, size, data_end);
  return out;
}

SharedReads::SharedReads(bool shared) : previous_(shared_reads) { shared_reads = shared; }
SharedReads::~SharedReads() { shared_reads = previous_; }

bool fresh_memory_available(std::uint64_t bytes) {
  const char* mode = std::getenv("TORCHPOINT_LOAD_MEMORY");
  if (mode != nullptr && std::string_view(mode) == "frugal") return false;
  std::ifstream meminfo("/proc/meminfo");
  std::string key;
  std::uint64_t kib = 0;
  while (meminfo >> key >> kib) {
    if (key == "MemAvailable:") return bytes <= kib * 1024 / 2;
    meminfo.ignore(256, '\n');
  }
  return false;  // unknown: the load that allocates nothing of the file's size
}

}  // namespace torchpoint
