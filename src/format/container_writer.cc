// Writes container files at close to raw disk speed: tensor bytes are gathered into aligned
// chunks and hashed while still in cache, and a second thread writes full chunks (with
// O_DIRECT for large files) while the next one fills. The header, whose checksums are known
// only at the end, has a fixed length and is written last at offset 0.
#include <ATen/ops/empty.h>
#include <c10/core/DeviceType.h>
#include <c10/util/SmallVector.h>
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <mutex>
#include <optional>
#include <system_error>
#include <thread>
#include <unordered_set>

#include "format/checksum.h"
#include "format/container.h"
#include "format/staging_gate.h"
#include "io/huge_pages.h"
#include "torchpoint/error.h"

#ifndef TORCHPOINT_VERSION
#define TORCHPOINT_VERSION "0.0.0"
#endif

namespace torchpoint {
namespace {

constexpr std::size_t kChunkSize = 8u << 20;       // bytes per write call
constexpr std::size_t kWriters = 2;                // writes in flight: the device overlaps them
constexpr std::size_t kChunkCount = kWriters + 2;  // one filling, one ready, the rest in flight
constexpr std::size_t kHashPiece = 256u << 10;     // copy then hash this much while it is in cache
constexpr std::size_t kDirectAlign = 4096;         // O_DIRECT offset, size and buffer alignment
constexpr std::uint64_t kDirectMinBytes = 1u << 20;
// From this many tensors the header is built on a second thread while the data fills.
constexpr std::size_t kHeaderThreadFrom = 1024;

std::uint64_t round_up(std::uint64_t value, std::uint64_t to) { return (value + to - 1) / to * to; }

std::uint8_t* allocate_raw(std::size_t size) {
  // A chunk is a whole number of huge pages, and gets them (see io/huge_pages.h).
  const std::size_t align = size >= kHugePageSize ? kHugePageSize : kDirectAlign;
  const std::size_t bytes = round_up(std::max<std::size_t>(size, 1), align);
  void* p = std::aligned_alloc(align, bytes);
  if (p == nullptr) throw std::bad_alloc();
  if (align == kHugePageSize) advise_huge_pages(p, bytes);
  return static_cast<std::uint8_t*>(p);
}

// Chunk buffers outlive the write that used them. Memory new to the process is zeroed by the
// kernel when first touched: for two files written at once, 64 MiB of clear_page per save,
// which on two cores took as much CPU as the incremental save's hashing of a 300 MiB backbone.
// The pool keeps as many chunks as two pipelines hold at once (64 MiB at most) and frees the
// rest; release_chunk_buffers() hands them all back.
constexpr std::size_t kPooledChunks = 2 * kChunkCount;

class ChunkPool {
 public:
  std::uint8_t* take() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (!spare_.empty()) {
        std::uint8_t* p = spare_.back();
        spare_.pop_back();
        return p;
      }
    }
    return allocate_raw(kChunkSize);
  }
  void give(std::uint8_t* p) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (spare_.size() < kPooledChunks) {
        spare_.push_back(p);
        return;
      }
    }
    std::free(p);
  }
  void release() {
    std::vector<std::uint8_t*> spare;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      spare.swap(spare_);
    }
    for (std::uint8_t* p : spare) std::free(p);
  }

 private:
  std::mutex mutex_;
  std::vector<std::uint8_t*> spare_;
};

// Never destroyed: a save may still be running on another thread while the process exits.
ChunkPool& chunk_pool() {
  static ChunkPool* pool = new ChunkPool;
  return *pool;
}

struct AlignedFree {
  bool pooled = false;  // a chunk of the pool, given back instead of freed
  void operator()(std::uint8_t* p) const {
    if (pooled) {
      chunk_pool().give(p);
    } else {
      std::free(p);
    }
  }
};
using AlignedBuffer = std::unique_ptr<std::uint8_t, AlignedFree>;

AlignedBuffer allocate_aligned(std::size_t size) { return AlignedBuffer(allocate_raw(size)); }
AlignedBuffer take_chunk() { return AlignedBuffer(chunk_pool().take(), AlignedFree{true}); }

struct PlannedTensor {
  const std::string* name;
  std::size_t caller_index;
  at::Tensor tensor;  // contiguous, on the CPU
  const DtypeInfo* dtype;
  // tensor's bytes, taken while planning: with thousands of small tensors, going back to each
  // TensorImpl after the data has streamed through the cache was a cache miss per tensor.
  const std::uint8_t* data = nullptr;
  c10::SmallVector<std::int64_t, 4> shape;  // also taken while planning, for the header
  std::uint64_t begin = 0;
  std::uint64_t end = 0;
  std::uint64_t checksum = 0;
};

// Appends `text` as a JSON string, as nlohmann's dump() writes it. Printable ASCII without
// quotes or backslashes (every name in practice) is copied as it is; anything else goes through
// nlohmann, which escapes it and refuses invalid UTF-8. A header of 20,000 names spent a quarter
// of its time building one nlohmann value per name.
void append_json_string(std::string& out, const std::string& text, std::string_view what) {
  const bool plain = std::all_of(text.begin(), text.end(), [](char c) {
    const auto u = static_cast<unsigned char>(c);
    return u >= 0x20 && u < 0x7f && c != '"' && c != '\\';
  });
  if (plain) {
    out += '"';
    out += text;
    out += '"';
    return;
  }
  try {
    out += nlohmann::json(text).dump();
  } catch (const nlohmann::json::exception&) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("{} '{}' is not valid UTF-8; use UTF-8 names", what, text));
  }
}

// Appends `json_text` (JSON written here: valid UTF-8) as a JSON string, byte for byte what
// nlohmann's dump() writes for it: quotes and backslashes escaped, the rest copied. Text with a
// control character, which JSON made by dump() never holds, goes through nlohmann.
void append_escaped(std::string& out, std::string_view json_text) {
  const bool controls = std::any_of(json_text.begin(), json_text.end(),
                                    [](char c) { return static_cast<unsigned char>(c) < 0x20; });
  if (controls) {
    out += nlohmann::json(std::string(json_text)).dump();
    return;
  }
  out.reserve(out.size() + json_text.size() + json_text.size() / 4 + 2);
  out += '"';
  const char* from = json_text.data();
  const char* const end = from + json_text.size();
  while (from < end) {
    const char* at = std::find_if(from, end, [](char c) { return c == '"' || c == '\\'; });
    out.append(from, at);
    if (at == end) break;
    out += '\\';
    out += *at;
    from = at + 1;
  }
  out += '"';
}

template <typename Integer>
void append_number(std::string& out, Integer value) {
  char digits[24];
  const auto result = std::to_chars(digits, digits + sizeof digits, value);
  out.append(digits, result.ptr);
}

// Tensors in data order: descending element size (so every tensor is naturally aligned when
// the data starts 8-byte aligned), the caller's order among equal sizes.
std::vector<PlannedTensor> plan(const Container& contents) {
  if (!contents.state.is_null() && !contents.state.is_object()) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("the JSON state must be an object (or null), not {}; wrap the "
                            "value, e.g. {{\"value\": ...}}",
                            contents.state.type_name()));
  }
  std::vector<PlannedTensor> planned;
  planned.reserve(contents.tensors.size());
  std::unordered_set<std::string_view> seen;
  seen.reserve(contents.tensors.size());
  const NamedTensors& tensors = contents.tensors;
  for (std::size_t index = 0; index < tensors.size(); ++index) {
    const auto& [name, tensor] = tensors[index];
    if (name.empty() || name == kMetadataKey) {
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("tensor name '{}' is reserved or empty; rename the tensor", name));
    }
    if (!seen.insert(name).second) {
      throw Error(
          ErrorCode::InvalidArgument,
          fmt::format("tensor name '{}' appears twice; names in one file must be unique", name));
    }
    if (!tensor.defined()) {
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("tensor '{}' is undefined; pass a tensor or leave it out", name));
    }
    const DtypeInfo& dtype = dtype_info(tensor.scalar_type(), name);
    at::Tensor contiguous = (tensor.device().is_cpu() ? tensor : tensor.to(c10::kCPU)).contiguous();
    const auto* data = static_cast<const std::uint8_t*>(contiguous.data_ptr());
    const auto bytes = static_cast<std::uint64_t>(contiguous.numel()) * dtype.size;
    const c10::IntArrayRef sizes = contiguous.sizes();
    // begin and end hold the size until the tensors are in data order.
    planned.push_back({&name, planned.size(), std::move(contiguous), &dtype, data,
                       c10::SmallVector<std::int64_t, 4>(sizes.begin(), sizes.end()), 0, bytes});
  }
  // Most files are in data order already (one dtype, or larger elements first): no sort then,
  // which for 20,000 tensors cost 3-5 ms of moves.
  auto larger_first = [](const PlannedTensor& a, const PlannedTensor& b) {
    return a.dtype->size > b.dtype->size;
  };
  if (!std::is_sorted(planned.begin(), planned.end(), larger_first)) {
    std::stable_sort(planned.begin(), planned.end(), larger_first);
  }
  std::uint64_t offset = 0;
  for (PlannedTensor& p : planned) {
    p.begin = offset;
    offset += p.end;
    p.end = offset;
  }
  return planned;
}

// The header text, padded so that 8 + its length is a multiple of `align`, with every
// tensor's checksum still 16 '0's: its length does not depend on them, so it is built once,
// before the data is written, and the checksums are filled in at `sum_at` afterwards.
struct HeaderText {
  std::string text;
  std::vector<std::size_t> sum_at;  // where each tensor's checksum digits start, caller's order
  std::size_t header_sum_at = 0;    // where the header's own checksum digits start
};

// Where the bytes at `at` (ascending offsets into `json_text`) land once append_escaped() has
// copied it from `start` on: after the opening quote, shifted by each quote or backslash before
// them, which gains a backslash.
void map_escaped(std::string_view json_text, std::size_t start, std::vector<std::size_t>& at) {
  std::size_t escapes = 0;
  std::size_t scanned = 0;
  for (std::size_t& position : at) {
    for (; scanned < position; ++scanned) {
      const char c = json_text[scanned];
      escapes += (c == '"' || c == '\\') ? 1 : 0;
    }
    position += start + 1 + escapes;
  }
}

HeaderText build_header(const Container& contents, const std::vector<PlannedTensor>& planned,
                        std::size_t align, bool hugging_face_format) {
  // Appended piece by piece: one fmt::format per tensor was another quarter of the time.
  HeaderText out;
  std::string& header = out.text;
  header = "{";
  header.reserve(planned.size() * 96 + 512);
  for (const PlannedTensor& p : planned) {
    append_json_string(header, *p.name, "tensor name");
    header += ":{\"dtype\":\"";
    header += p.dtype->name;
    header += "\",\"shape\":[";
    bool first = true;
    for (const std::int64_t size : p.shape) {
      if (!first) header += ',';
      first = false;
      append_number(header, size);
    }
    header += "],\"data_offsets\":[";
    append_number(header, p.begin);
    header += ',';
    append_number(header, p.end);
    header += "]},";
  }
  // [name, checksum] pairs in the caller's order, which is how the reader recovers that order.
  // Built as text: a JSON object of thousands of keys costs quadratic time in ordered_json.
  const std::string zeros(kChecksumHexLength, '0');
  std::string meta_text = fmt::format(
      "{{\"format\":\"{}\",\"format_version\":\"{}.{}\",\"torchpoint_version\":\"{}\","
      "\"tensors\":[",
      kFormatName, kFormatMajor, kFormatMinor, TORCHPOINT_VERSION);
  meta_text.reserve(meta_text.size() + contents.tensors.size() * 40 + 64);
  out.sum_at.reserve(contents.tensors.size());
  for (std::size_t i = 0; i < contents.tensors.size(); ++i) {
    if (i > 0) meta_text += ',';
    meta_text += '[';
    append_json_string(meta_text, contents.tensors[i].first, "tensor name");
    meta_text += ",\"";
    out.sum_at.push_back(meta_text.size());
    meta_text += zeros;
    meta_text += "\"]";
  }
  meta_text += "],\"state\":";
  try {
    meta_text += contents.state.is_null() ? std::string("{}") : contents.state.dump();
  } catch (const nlohmann::json::exception& e) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("the JSON state cannot be written: {}; use UTF-8 strings", e.what()));
  }
  meta_text += '}';
  // "format": "pt" first where asked: Hugging Face's loaders of sharded checkpoints
  // (transformers, accelerate) refuse a safetensors file without it; torchpoint ignores it.
  header += fmt::format("\"{}\":{{{}\"{}\":", kMetadataKey,
                        hugging_face_format ? "\"format\":\"pt\"," : "", kTorchpointKey);
  const std::size_t meta_start = header.size();
  append_escaped(header, meta_text);
  map_escaped(meta_text, meta_start, out.sum_at);
  header += fmt::format(",\"{}\":\"", kHeaderChecksumKey);
  out.header_sum_at = 8 + header.size();
  header += zeros;
  header += "\"}}";
  for (std::size_t& at : out.sum_at) {
    // The metadata holds no control character (names and state come from dump(), which
    // escapes them), so append_escaped() added only the backslashes map_escaped() counts.
    if (header.compare(at, kChecksumHexLength, zeros) != 0 || header[at - 1] != '"') {
      throw Error(ErrorCode::InvalidArgument,
                  "a tensor's checksum is not where the header builder placed it (internal error)");
    }
    at += 8;  // offsets in the file: after the length prefix
  }
  std::uint64_t padded = round_up(8 + header.size(), align) - 8;
  header.resize(padded, ' ');
  return out;
}

// The header text and with it where the data starts (8 + its length). With thousands of
// tensors it is built on a second thread while the first chunks are filled and hashed: on
// 20,000 small tensors its 6-8 ms came before the first byte was written.
class PendingHeader {
 public:
  PendingHeader(std::function<HeaderText()> build, bool threaded) {
    if (threaded) {
      try {
        future_ = std::async(std::launch::async, build);
        return;
      } catch (const std::system_error&) {
        // No thread to be had: built here, as for a few tensors.
      }
    }
    header_ = build();
  }

  // Whether the header is built, without waiting.
  bool ready() const {
    return header_.has_value() ||
           future_.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
  }

  // Waits for the header; rethrows what stopped its builder (a name that is not UTF-8...).
  HeaderText& get() {
    if (!header_) header_ = future_.get();
    return *header_;
  }

  std::uint64_t data_start() { return 8 + get().text.size(); }

 private:
  std::future<HeaderText> future_;  // waited for by its destructor, whatever happens
  std::optional<HeaderText> header_;
};

// Writes full chunks on a second thread while the caller fills the next one.
class ChunkPipeline {
 public:
  // `own_buffers` false: the caller submits only borrowed memory, acquire() is not used.
  ChunkPipeline(File& file, bool threaded, bool own_buffers = true)
      : file_(file),
        threaded_(threaded),
        buffers_left_(own_buffers ? (threaded ? kChunkCount : 1) : 0) {
    if (threaded_) {
      for (std::size_t i = 0; i < kWriters; ++i) workers_.emplace_back([this] { run(); });
    }
  }

  ~ChunkPipeline() { join(); }

  AlignedBuffer acquire() {
    std::unique_lock<std::mutex> lock(mutex_);
    // A new buffer only when none is free: a file of two chunks takes two, not kChunkCount.
    cv_.wait(lock, [this] { return !free_.empty() || buffers_left_ > 0 || error_; });
    rethrow_locked();
    if (free_.empty()) {
      --buffers_left_;
      return take_chunk();
    }
    AlignedBuffer b = std::move(free_.front());
    free_.pop_front();
    return b;
  }

  void submit(AlignedBuffer buffer, std::size_t size, std::uint64_t offset) {
    if (!threaded_) {
      file_.write_all(buffer.get(), size, offset);
      free_.push_back(std::move(buffer));
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      rethrow_locked();
      const std::uint8_t* data = buffer.get();
      pending_.push_back({std::move(buffer), data, size, offset});
    }
    cv_.notify_all();
  }

  // Writes `size` bytes at `data`, memory the caller keeps unchanged until finish().
  void submit_borrowed(const std::uint8_t* data, std::size_t size, std::uint64_t offset) {
    if (!threaded_) {
      file_.write_all(data, size, offset);
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      rethrow_locked();
      pending_.push_back({AlignedBuffer(), data, size, offset});
    }
    cv_.notify_all();
  }

  // Waits until every submitted chunk is written; rethrows the first write error.
  void finish() {
    if (!threaded_) return;
    join();
    rethrow_locked();
  }

 private:
  struct Job {
    AlignedBuffer buffer;  // null for borrowed memory
    const std::uint8_t* data;
    std::size_t size;
    std::uint64_t offset;
  };

  void rethrow_locked() {
    if (error_) std::rethrow_exception(error_);
  }

  void join() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    cv_.notify_all();
    for (std::thread& t : workers_) {
      if (t.joinable()) t.join();
    }
  }

  void run() {
    for (;;) {
      Job job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        cv_.wait(lock, [this] { return !pending_.empty() || stop_; });
        if (pending_.empty() || error_) return;
        job = std::move(pending_.front());
        pending_.pop_front();
      }
      try {
        file_.write_all(job.data, job.size, job.offset);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
        cv_.notify_all();
        return;
      }
      if (job.buffer) {
        std::lock_guard<std::mutex> lock(mutex_);
        free_.push_back(std::move(job.buffer));
      }
      cv_.notify_all();
    }
  }

  File& file_;
  bool threaded_;
  std::size_t buffers_left_;  // chunks acquire() may still take from the pool
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<AlignedBuffer> free_;
  std::deque<Job> pending_;
  std::exception_ptr error_;
  bool stop_ = false;
  std::vector<std::thread> workers_;
};

// The start of the data as an asynchronous save staged it: every tensor at its data offset in
// one piece of the save's staging memory, with room for O_DIRECT's last whole block; null when
// the tensors are not laid out so (the writer then copies them, as for any other tensors).
const std::uint8_t* staged_image(const std::vector<PlannedTensor>& planned, std::uint64_t data_size,
                                 bool direct, const detail::StagingGate& gate) {
  if (planned.empty()) return nullptr;
  const std::uint8_t* image = planned.front().data;
  if (direct && reinterpret_cast<std::uintptr_t>(image) % kDirectAlign != 0) return nullptr;
  for (const PlannedTensor& p : planned) {
    if (p.data != image + p.begin) return nullptr;
  }
  const std::uint64_t extent = direct ? round_up(data_size, kDirectAlign) : data_size;
  return gate.contains(image, static_cast<std::size_t>(extent)) ? image : nullptr;
}

// write_data() of a staged image: hashes each tensor where it lies, once the snapshot has
// copied it, and writes the image itself, chunk by chunk, with no copy.
std::uint64_t write_image(File& file, std::vector<PlannedTensor>& planned,
                          const std::uint8_t* image, PendingHeader& header,
                          std::uint64_t data_size, const detail::StagingGate& gate) {
  ChunkPipeline pipeline(file, /*threaded=*/data_size > kChunkSize, /*own_buffers=*/false);
  // First every chunk to the disk, each as soon as the snapshot has copied it; then the
  // checksums, while the writes run: hashing during the copy would compete with it for memory
  // bandwidth, and the copy is the training loop's stall.
  for (std::uint64_t at = 0; at < data_size; at += kChunkSize) {
    std::uint64_t size = std::min<std::uint64_t>(kChunkSize, data_size - at);
    gate.wait_for(image + at, static_cast<std::size_t>(size));
    // Asked for once the first chunk is copied: the header builds while the snapshot copies.
    const std::uint64_t data_start = header.data_start();
    // O_DIRECT writes the last block whole; the bytes past the data are cut by the caller.
    if (file.direct()) size = round_up(size, kDirectAlign);
    pipeline.submit_borrowed(image + at, static_cast<std::size_t>(size), data_start + at);
  }
  for (PlannedTensor& p : planned) {
    const auto size = static_cast<std::size_t>(p.end - p.begin);
    p.checksum = size > 0 ? xxh3(image + p.begin, size) : Xxh3Stream().digest();
  }
  pipeline.finish();
  return file.direct() ? round_up(data_size, kDirectAlign) - data_size : 0;
}

// Streams every tensor's bytes into the file from `data_start` on, computing the checksums.
// Returns the number of bytes written past the end of the data (O_DIRECT padding).
std::uint64_t write_data(File& file, std::vector<PlannedTensor>& planned, PendingHeader& header,
                         std::uint64_t data_size) {
  const detail::StagingGate* gate = detail::current_staging_gate;
  if (gate != nullptr) {
    if (const std::uint8_t* image = staged_image(planned, data_size, file.direct(), *gate)) {
      return write_image(file, planned, image, header, data_size, *gate);
    }
  }
  const bool threaded = data_size > kChunkSize;
  ChunkPipeline pipeline(file, threaded);
  // Chunks filled before the header is built wait here (offsets from the data's start), as
  // many as leave the pipeline a buffer to fill next; then the filling waits for the header.
  struct Held {
    AlignedBuffer buffer;
    std::size_t size;
    std::uint64_t at;
  };
  std::vector<Held> held;
  std::optional<std::uint64_t> data_start;
  auto submit = [&](AlignedBuffer buffer, std::size_t size, std::uint64_t at, bool last) {
    if (!data_start) {
      if (threaded && !last && held.size() + 1 < kChunkCount && !header.ready()) {
        held.push_back({std::move(buffer), size, at});
        return;
      }
      data_start = header.data_start();
      for (Held& h : held) pipeline.submit(std::move(h.buffer), h.size, *data_start + h.at);
      held.clear();
    }
    if (size > 0) pipeline.submit(std::move(buffer), size, *data_start + at);
  };
  AlignedBuffer chunk;
  std::size_t used = 0;
  std::uint64_t chunk_offset = 0;  // from the data's start
  auto flush = [&](bool last) {
    std::size_t size = used;
    if (last && file.direct()) {
      std::size_t padded = round_up(used, kDirectAlign);
      std::memset(chunk.get() + used, 0, padded - used);
      size = padded;
    }
    submit(std::move(chunk), size, chunk_offset, last);
    chunk_offset += used;
    used = 0;
  };
  for (PlannedTensor& p : planned) {
    const std::uint8_t* src = p.data;
    std::uint64_t remaining = p.end - p.begin;
    // An asynchronous save may still be copying this tensor into its staging memory.
    if (gate != nullptr) gate->wait_for(src, static_cast<std::size_t>(remaining));
    Xxh3Stream stream;
    bool whole = true;  // the tensor went into the file in one piece: hash it in one call
    std::uint64_t hashed_whole = 0;
    while (remaining > 0) {
      if (!chunk) chunk = pipeline.acquire();
      std::size_t piece = static_cast<std::size_t>(
          std::min<std::uint64_t>({remaining, kChunkSize - used, kHashPiece}));
      std::uint8_t* dst = chunk.get() + used;
      std::memcpy(dst, src, piece);
      if (whole && piece == remaining && remaining == p.end - p.begin) {
        hashed_whole = xxh3(dst, piece);
      } else {
        whole = false;
        stream.update(dst, piece);
      }
      src += piece;
      remaining -= piece;
      used += piece;
      if (used == kChunkSize) flush(false);
    }
    p.checksum = (whole && p.end > p.begin) ? hashed_whole : stream.digest();
  }
  if (chunk) {
    flush(true);
  } else {
    submit(AlignedBuffer(), 0, chunk_offset, /*last=*/true);  // what is still held, if any
  }
  pipeline.finish();
  return file.direct() ? round_up(data_size, kDirectAlign) - data_size : 0;
}

}  // namespace

void release_chunk_buffers() { chunk_pool().release(); }

WrittenFile write_container(Env& env, const std::string& path, const Container& contents,
                            bool hugging_face_format) {
  std::vector<PlannedTensor> planned = plan(contents);
  std::uint64_t data_size = planned.empty() ? 0 : planned.back().end;

  std::unique_ptr<File> file;
  if (data_size >= kDirectMinBytes) {
    try {
      file = env.open(path, OpenMode::CreateExclusiveDirect);
    } catch (const Error& e) {
      // The file system refuses O_DIRECT (tmpfs, some FUSE): buffered I/O is as safe, only slower.
      if (e.code() != ErrorCode::Unsupported) throw;
    }
  }
  if (!file) file = env.open(path, OpenMode::CreateExclusive);
  std::size_t align = file->direct() ? kDirectAlign : 8;

  // The header's length does not depend on the checksums (fixed-width hex), so the data can be
  // written first, at its final offset, and the header once the checksums are known.
  PendingHeader pending(
      [&contents, &planned, align, hugging_face_format] {
        return build_header(contents, planned, align, hugging_face_format);
      },
      /*threaded=*/planned.size() >= kHeaderThreadFrom);
  std::uint64_t padding = write_data(*file, planned, pending, data_size);
  HeaderText& header = pending.get();
  std::uint64_t data_start = 8 + header.text.size();

  AlignedBuffer head = allocate_aligned(data_start);
  std::uint64_t header_len = header.text.size();
  for (int i = 0; i < 8; ++i) head.get()[i] = static_cast<std::uint8_t>(header_len >> (8 * i));
  std::memcpy(head.get() + 8, header.text.data(), header.text.size());
  for (const PlannedTensor& p : planned) {
    const std::string hex = checksum_hex(p.checksum);
    std::memcpy(head.get() + header.sum_at[p.caller_index], hex.data(), hex.size());
  }
  // The header checksum is computed with its own 16 digits still '0', then filled in.
  std::uint64_t header_checksum = xxh3(head.get(), data_start);
  const std::string hex = checksum_hex(header_checksum);
  std::memcpy(head.get() + header.header_sum_at, hex.data(), hex.size());
  file->write_all(head.get(), data_start, 0);

  std::uint64_t file_size = data_start + data_size;
  // O_DIRECT wrote whole blocks; cut the zero padding so the data ends the file.
  if (padding > 0) file->truncate(file_size);
  file->sync();
  file->close();
  return {file_size, header_checksum};
}

}  // namespace torchpoint
