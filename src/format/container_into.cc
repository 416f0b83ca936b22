// load_file_into(): a container file read into tensors that already exist, verified in full
// before any of them changes.
//
// By default one read (FreshData, fresh_read.h): the file's data into new memory, hashed as it
// lands; then the tensors' storages adopt that memory or are copied from it. Where the memory
// is short (fresh_memory_available), two passes instead. The first reads the file in 1 MiB
// chunks into a few reused buffers on one thread while the calling thread hashes them, so that
// checking every checksum costs about one read of the file and allocates nothing of its size.
// The second reads the same bytes again, now from the page cache, straight into the tensors'
// memory, on two threads.
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/CPUAllocator.h>
#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>
#include <string_view>
#include <unordered_map>

#include "format/checksum.h"
#include "format/container.h"
#include "format/fresh_read.h"

namespace torchpoint {
namespace {

constexpr std::size_t kChunk = std::size_t{1} << 20;
constexpr std::size_t kChunks = 4;
// Below this, one thread does each pass: a thread costs more than it saves.
constexpr std::uint64_t kThreadedFrom = 8 << 20;

// From this much of it, the tensors' old memory is given back on a thread of its own.
constexpr std::uint64_t kReleaseAsideFrom = std::uint64_t{16} << 20;

std::uint64_t data_size(const ContainerHeader& header) {
  return header.entries.empty() ? 0 : header.entries.back().end;
}

// Whether `t` can take over `size` verified bytes at `bytes` as its storage's memory, in place
// of a copy: a CPU tensor that is its storage's whole memory, contiguous, held in memory from
// LibTorch's CPU allocator or an earlier such load (not shared memory, a mapping, a caller's
// blob or a lazy copy, whose owners expect that memory to stay).
bool can_adopt(const at::Tensor& t, std::uint64_t size, const char* bytes,
               std::size_t element_size) {
  if (size < kAdoptFrom || !t.device().is_cpu() || t.layout() != at::kStrided ||
      !t.is_contiguous() || t.is_conj() || t.is_neg() || t.storage_offset() != 0 ||
      !t.has_storage()) {
    return false;
  }
  if (reinterpret_cast<std::uintptr_t>(bytes) % element_size != 0) return false;
  const c10::Storage& storage = t.storage();
  if (storage.nbytes() != size) return false;
  const c10::DataPtr& data = storage.data_ptr();
  return data.get_deleter() == c10::GetCPUAllocator()->raw_deleter() ||
         FreshData::adopted(data);
}

// Frees the tensors' old memory, which no tensor holds any more. Giving much of it back to the
// system is slow (unmapping S1's 256 MiB of 4 KiB pages took 34 ms on the development machine,
// a quarter of the whole load), and nothing the caller does next waits for it, so from
// kReleaseAsideFrom bytes a detached thread does it while the caller goes on. Its deleters are
// LibTorch's CPU allocator's and FreshData's (can_adopt takes no other), which free from any
// thread. If no thread can be had, the memory is freed here.
void release(std::vector<c10::DataPtr> old, std::uint64_t bytes) {
  if (bytes >= kReleaseAsideFrom) {
    try {
      std::thread([old = std::move(old)]() mutable { old.clear(); }).detach();
    } catch (const std::system_error&) {
      // The lambda, and the memory it took, went as the exception left the constructor.
    }
    return;
  }
  old.clear();
}

std::string shape_text(c10::IntArrayRef sizes) {
  return fmt::format("[{}]", fmt::join(sizes, ", "));
}

// The reads of the first pass, a chunk at a time, ahead of the hashing by up to kChunks.
class ChunkReader {
 public:
  ChunkReader(File& file, std::uint64_t begin, std::uint64_t end, bool threaded)
      : file_(file), begin_(begin), end_(end), buffers_(threaded ? kChunks : 1) {
    for (auto& b : buffers_) b = std::make_unique_for_overwrite<char[]>(kChunk);  // not zeroed
    if (threaded) thread_ = std::thread([this] { run(); });
  }
  ~ChunkReader() { stop(); }

  // The next chunk's bytes, valid until the next call; empty at the end.
  std::string_view next() {
    if (!thread_.joinable()) {
      std::uint64_t at = begin_ + consumed_ * kChunk;
      if (at >= end_) return {};
      std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(kChunk, end_ - at));
      file_.read_exact(buffers_[0].get(), n, at);
      ++consumed_;
      return {buffers_[0].get(), n};
    }
    std::unique_lock<std::mutex> lock(mutex_);
    if (consumed_ > 0) {  // the previous chunk's buffer is free again
      ++released_;
      changed_.notify_all();
    }
    changed_.wait(lock, [&] { return produced_ > consumed_ || done_; });
    if (produced_ == consumed_) {
      if (failure_) std::rethrow_exception(failure_);
      return {};
    }
    std::uint64_t k = consumed_++;
    std::uint64_t at = begin_ + k * kChunk;
    std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(kChunk, end_ - at));
    return {buffers_[k % buffers_.size()].get(), n};
  }

  void stop() {
    if (!thread_.joinable()) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
      changed_.notify_all();
    }
    thread_.join();
  }

 private:
  void run() {
    try {
      for (std::uint64_t k = 0;; ++k) {
        std::uint64_t at = begin_ + k * kChunk;
        if (at >= end_) break;
        {
          std::unique_lock<std::mutex> lock(mutex_);
          changed_.wait(lock, [&] { return stopping_ || k - released_ < buffers_.size(); });
          if (stopping_) break;
        }
        std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(kChunk, end_ - at));
        file_.read_exact(buffers_[k % buffers_.size()].get(), n, at);
        std::lock_guard<std::mutex> lock(mutex_);
        ++produced_;
        changed_.notify_all();
      }
    } catch (...) {
      std::lock_guard<std::mutex> lock(mutex_);
      failure_ = std::current_exception();
    }
    std::lock_guard<std::mutex> lock(mutex_);
    done_ = true;
    changed_.notify_all();
  }

  File& file_;
  const std::uint64_t begin_, end_;
  std::vector<std::unique_ptr<char[]>> buffers_;
  std::thread thread_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::uint64_t produced_ = 0, consumed_ = 0, released_ = 0;
  bool stopping_ = false, done_ = false;
  std::exception_ptr failure_;
};

// First pass: every tensor's checksum, from one sequential read of the data; and the XXH3 of
// each chunk, which the second pass checks again.
std::vector<std::uint64_t> check_checksums(File& file, const ContainerHeader& header,
                                           const std::string& path, bool threaded) {
  const std::uint64_t start = header.data_start;
  ChunkReader reader(file, start, start + data_size(header), threaded);
  std::vector<std::uint64_t> chunk_sums;
  std::size_t i = 0;  // the first entry not yet complete
  Xxh3Stream partial;
  bool in_partial = false;
  auto check = [&](const TensorEntry& e, std::uint64_t actual) {
    if (actual == e.checksum) return;
    throw Error(ErrorCode::Corruption,
                fmt::format("{}: tensor '{}' fails its checksum (stored {}, computed {}): its data "
                            "is corrupt; nothing was loaded",
                            path, e.name, checksum_hex(e.checksum), checksum_hex(actual)));
  };
  std::uint64_t chunk_begin = 0;  // relative to the data start
  for (std::string_view chunk = reader.next(); !chunk.empty(); chunk = reader.next()) {
    const std::uint64_t chunk_end = chunk_begin + chunk.size();
    chunk_sums.push_back(xxh3(chunk.data(), chunk.size()));
    while (i < header.entries.size() && header.entries[i].begin < chunk_end) {
      const TensorEntry& e = header.entries[i];
      std::uint64_t from = std::max(e.begin, chunk_begin);
      std::uint64_t to = std::min(e.end, chunk_end);
      const char* bytes = chunk.data() + (from - chunk_begin);
      if (!in_partial && e.begin >= chunk_begin && e.end <= chunk_end) {
        check(e, xxh3(bytes, to - from));  // the whole tensor is in this chunk
      } else {
        if (!in_partial) partial = Xxh3Stream();
        in_partial = true;
        partial.update(bytes, to - from);
        if (e.end > chunk_end) break;  // continues in the next chunk
        in_partial = false;
        check(e, partial.digest());
      }
      ++i;
    }
    chunk_begin = chunk_end;
  }
  // Empty tensors at the very end, or a file with no data at all.
  for (; i < header.entries.size(); ++i) check(header.entries[i], xxh3(nullptr, 0));
  return chunk_sums;
}

// Second pass, over the chunks [first, last) of the data: each chunk read once, straight into
// its tensor when it lies in one, else through a buffer, and its XXH3 checked against the
// first pass's while the bytes are still in the cache. Throws Corruption for a chunk that
// differs (the file changed between the passes); the tensors then hold part of it.
void copy_chunks(File& file, const ContainerHeader& header, const std::vector<char*>& dest,
                 const std::vector<std::uint64_t>& chunk_sums, std::size_t first,
                 std::size_t last, const std::string& path) {
  const auto& entries = header.entries;
  const std::uint64_t total = data_size(header);
  std::size_t i = static_cast<std::size_t>(
      std::upper_bound(entries.begin(), entries.end(), std::uint64_t{first} * kChunk,
                       [](std::uint64_t v, const TensorEntry& e) { return v < e.end; }) -
      entries.begin());
  std::unique_ptr<char[]> buffer;
  for (std::size_t k = first; k < last; ++k) {
    const std::uint64_t lo = std::uint64_t{k} * kChunk;
    const std::uint64_t hi = std::min<std::uint64_t>(lo + kChunk, total);
    while (i < entries.size() && entries[i].end <= lo) ++i;  // empty tensors, finished ones
    std::uint64_t actual = 0;
    if (i < entries.size() && entries[i].begin <= lo && entries[i].end >= hi) {
      char* to = dest[i] + (lo - entries[i].begin);
      file.read_exact(to, hi - lo, header.data_start + lo);
      actual = xxh3(to, hi - lo);
    } else {
      if (!buffer) buffer = std::make_unique_for_overwrite<char[]>(kChunk);
      file.read_exact(buffer.get(), hi - lo, header.data_start + lo);
      actual = xxh3(buffer.get(), hi - lo);
      for (std::size_t j = i; j < entries.size() && entries[j].begin < hi; ++j) {
        std::uint64_t from = std::max(entries[j].begin, lo);
        std::uint64_t to = std::min(entries[j].end, hi);
        if (to > from) {
          std::memcpy(dest[j] + (from - entries[j].begin), buffer.get() + (from - lo), to - from);
        }
      }
    }
    if (actual != chunk_sums[k]) {
      throw Error(ErrorCode::Corruption,
                  fmt::format("{}: data bytes {} to {} differ from what was verified a moment "
                              "before: another process wrote into the file, or the disk returns "
                              "other bytes on each read",
                              path, lo, hi));
    }
  }
}

}  // namespace

struct FileFill::Impl {
  Env* env = nullptr;
  std::string path;
  std::unique_ptr<File> file, other;
  ContainerHeader header;
  std::vector<at::Tensor> targets;  // by header entry: handles to the caller's tensors
  std::vector<std::uint64_t> chunk_sums;   // XXH3 of each kChunk of the data, from the first pass
  std::optional<FreshData> fresh;         // the one-read way: the verified data, in memory
  bool fits = false;
  bool copied = false;
};

FileFill::FileFill(Env& env, const std::string& path, const NamedTensors& into,
                   std::vector<std::string>* mismatches)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.env = &env;
  m.path = path;
  m.file = env.open(path, OpenMode::Read);
  Problems throwing;
  m.header = read_container_header(*m.file, path, throwing);

  // Every name, dtype and shape first: a mismatch is found before any data is read. A model's
  // tensors usually come in the file's order: the one after the last match is tried first, and
  // the map by name is built only when that fails (it also finds a name given twice).
  std::unordered_map<std::string_view, std::size_t> by_name;  // names live in `into`
  auto build_by_name = [&] {
    if (!by_name.empty() || into.empty()) return;
    by_name.reserve(into.size());
    for (std::size_t j = 0; j < into.size(); ++j) {
      if (!by_name.emplace(into[j].first, j).second) {
        throw Error(ErrorCode::InvalidArgument,
                    fmt::format("loading {} into tensors: the tensor '{}' is named twice", path,
                                into[j].first));
      }
    }
  };
  std::vector<bool> matched(into.size(), false);
  std::size_t next = 0;
  std::vector<std::string> problems;
  m.targets.resize(m.header.entries.size());
  for (std::size_t k = 0; k < m.header.entries.size(); ++k) {
    const TensorEntry& e = m.header.entries[k];
    std::size_t j = next;
    if (j >= into.size() || matched[j] || into[j].first != e.name) {
      build_by_name();
      auto found = by_name.find(e.name);
      if (found == by_name.end()) {
        problems.push_back(
            fmt::format("'{}' is in the file but not among the tensors to fill", e.name));
        continue;
      }
      j = found->second;
    }
    next = j + 1;
    matched[j] = true;
    const at::Tensor& t = into[j].second;
    if (!t.defined()) {
      problems.push_back(fmt::format("'{}' is an undefined tensor", e.name));
    } else if (t.scalar_type() != e.dtype.type) {
      problems.push_back(fmt::format("dtype mismatch for '{}': file {}, tensor {}", e.name,
                                     c10::toString(e.dtype.type), c10::toString(t.scalar_type())));
    } else if (t.sizes() != c10::IntArrayRef(e.shape)) {
      problems.push_back(fmt::format("size mismatch for '{}': file {}, tensor {}", e.name,
                                     shape_text(e.shape), shape_text(t.sizes())));
    }
    m.targets[k] = t;
  }
  if (std::find(matched.begin(), matched.end(), false) != matched.end()) {
    build_by_name();  // a name given twice is the first problem to report
    for (std::size_t j = 0; j < into.size(); ++j) {
      if (!matched[j]) problems.push_back(fmt::format("'{}' is not in the file", into[j].first));
    }
  }
  if (!problems.empty()) {
    if (mismatches != nullptr) {
      *mismatches = std::move(problems);
      return;
    }
    throw Error(ErrorCode::Incompatible,
                fmt::format("{} does not fit the tensors to fill; nothing was loaded:\n  {}", path,
                            fmt::join(problems, "\n  ")));
  }

  const std::uint64_t total = data_size(m.header);
  if (fresh_memory_available(total)) {
    m.fresh = FreshData::read(env, path, *m.file, m.header);
    m.fits = true;
    return;
  }
  const bool threaded = total >= kThreadedFrom;
  // The second pass reads the halves on two threads, each through a file of its own (so that
  // each has its own read-ahead); opened now, while a failure still changes nothing.
  if (threaded) m.other = env.open(path, OpenMode::Read);
  m.chunk_sums = check_checksums(*m.file, m.header, path, threaded);
  if (m.file->size() != m.header.data_start + total) {
    throw Error(ErrorCode::Corruption,
                fmt::format("{} changed size while being read ({} bytes, its header says {}): "
                            "another process truncated or rewrote it; nothing was loaded",
                            path, m.file->size(), m.header.data_start + total));
  }
  m.fits = true;
}

FileFill::~FileFill() = default;
FileFill::FileFill(FileFill&&) noexcept = default;
FileFill& FileFill::operator=(FileFill&&) noexcept = default;

bool FileFill::fits() const { return impl_->fits; }
const Json& FileFill::state() const { return impl_->header.state; }
std::uint64_t FileFill::header_checksum() const { return impl_->header.header_checksum; }

void FileFill::copy() {
  Impl& m = *impl_;
  if (!m.fits || m.copied) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("FileFill::copy() of {}: {}", m.path,
                            m.copied ? "already copied" : "the file does not fit the tensors"));
  }
  m.copied = true;
  if (m.fresh) {
    copy_fresh();
    return;
  }
  const ContainerHeader& header = m.header;
  // Where each tensor's bytes go: its own memory, or (not contiguous, not on the CPU) a
  // staging tensor copied in at the end. Staging is allocated before anything changes.
  std::vector<char*> dest(header.entries.size());
  std::vector<std::pair<at::Tensor*, at::Tensor>> staged;
  for (std::size_t k = 0; k < header.entries.size(); ++k) {
    at::Tensor& t = m.targets[k];
    if (t.device().is_cpu() && t.is_contiguous() && !t.is_conj() && !t.is_neg()) {
      dest[k] = static_cast<char*>(t.data_ptr());
    } else {
      staged.emplace_back(&t, at::empty(t.sizes(), t.options().device(at::kCPU)));
      dest[k] = static_cast<char*>(staged.back().second.data_ptr());
    }
  }

  // Verified: from here on the tensors change. A read can fail now only if the file became
  // unreadable between the two passes.
  const std::size_t chunks = m.chunk_sums.size();
  try {
    if (m.other) {
      const std::size_t half = chunks / 2;
      std::exception_ptr other_failure;
      std::thread other_half([&] {
        try {
          copy_chunks(*m.other, header, dest, m.chunk_sums, half, chunks, m.path);
        } catch (...) {
          other_failure = std::current_exception();
        }
      });
      try {
        copy_chunks(*m.file, header, dest, m.chunk_sums, 0, half, m.path);
      } catch (...) {
        other_half.join();
        throw;
      }
      other_half.join();
      if (other_failure) std::rethrow_exception(other_failure);
    } else {
      copy_chunks(*m.file, header, dest, m.chunk_sums, 0, chunks, m.path);
    }
  } catch (const Error& e) {
    throw Error(e.code(), fmt::format("{} (it was verified, then failed while being copied in: the "
                                      "tensors to fill may hold part of it; load it again)",
                                      e.what()));
  }
  // Written behind autograd's back: bump each version counter as an in-place op would, so
  // that a graph that saved one of these tensors refuses to backpropagate through old values.
  for (std::size_t k = 0; k < header.entries.size(); ++k) {
    at::Tensor& t = m.targets[k];
    if (!t.is_inference() && dest[k] == t.data_ptr()) t.unsafeGetTensorImpl()->bump_version();
  }
  at::NoGradGuard no_grad;
  for (auto& [target, staging] : staged) target->copy_(staging);
}

void FileFill::copy_fresh() {
  Impl& m = *impl_;
  const ContainerHeader& header = m.header;
  std::vector<c10::DataPtr> replaced;  // the tensors' old memory, freed once all moved
  replaced.reserve(header.entries.size());
  std::uint64_t replaced_bytes = 0;
  std::vector<std::pair<at::Tensor*, at::Tensor>> staged;
  for (std::size_t k = 0; k < header.entries.size(); ++k) {
    const TensorEntry& e = header.entries[k];
    at::Tensor& t = m.targets[k];
    char* bytes = m.fresh->bytes(e);
    const std::uint64_t size = e.end - e.begin;
    if (can_adopt(t, size, bytes, e.dtype.size)) {
      // The storage itself takes the verified memory: every view of it, and every optimizer
      // holding the tensor, sees the new values, as after an in-place copy.
      replaced.push_back(t.storage().unsafeGetStorageImpl()->set_data_ptr(m.fresh->adopt(e)));
      replaced_bytes += size;
    } else if (t.device().is_cpu() && t.is_contiguous() && !t.is_conj() && !t.is_neg()) {
      if (size > 0) std::memcpy(t.data_ptr(), bytes, size);
    } else {
      staged.emplace_back(&t,
                          at::from_blob(bytes, e.shape, at::TensorOptions().dtype(e.dtype.type)));
      continue;
    }
    // Written behind autograd's back: bump the version counter as an in-place op would, so
    // that a graph that saved this tensor refuses to backpropagate through old values.
    if (!t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
  }
  {
    at::NoGradGuard no_grad;
    for (auto& [target, view] : staged) target->copy_(view);
  }
  release(std::move(replaced), replaced_bytes);
  m.fresh.reset();  // gives back the memory of what was copied rather than adopted
}

Json load_file_into(const std::string& path, const NamedTensors& into, Env& env) {
  FileFill fill(env, path, into);
  fill.copy();
  return fill.state();
}

}  // namespace torchpoint
