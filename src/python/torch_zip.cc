#include "python/torch_zip.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <bit>
#include <cstring>
#include <utility>

#include "torchpoint/error.h"

namespace torchpoint::detail {
namespace {

// Record signatures and fixed sizes from PKWARE's APPNOTE.TXT.
constexpr std::uint32_t kLocalHeaderSig = 0x04034b50;
constexpr std::uint32_t kCentralHeaderSig = 0x02014b50;
constexpr std::uint32_t kEndSig = 0x06054b50;
constexpr std::uint32_t kZip64EndSig = 0x06064b50;
constexpr std::uint32_t kZip64LocatorSig = 0x07064b50;
constexpr std::uint64_t kLocalHeaderSize = 30;
constexpr std::uint64_t kCentralHeaderSize = 46;
constexpr std::uint64_t kEndSize = 22;
constexpr std::uint64_t kZip64EndSize = 56;
constexpr std::uint64_t kZip64LocatorSize = 20;
constexpr std::uint16_t kZip64ExtraId = 0x0001;
constexpr std::uint64_t kMaxComment = 0xffff;
// The most directory bytes read: far above any real state dict, far below a hostile claim.
constexpr std::uint64_t kMaxDirectory = std::uint64_t{1} << 30;

// Little-endian integer of `n` bytes at `at`; the caller has checked the bounds.
std::uint64_t le(std::string_view b, std::uint64_t at, int n) {
  std::uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = v << 8 | static_cast<std::uint8_t>(b[at + i]);
  return v;
}

// Tables for CRC-32 eight bytes at a time ("slicing by 8"): table k advances a byte's
// contribution by k more bytes. About four times faster than a byte at a time, which matters
// since every byte of a checkpoint passes through here.
using CrcTables = std::array<std::array<std::uint32_t, 256>, 8>;
constexpr CrcTables make_crc_tables() {
  CrcTables t{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xedb88320u ^ (c >> 1) : c >> 1;
    t[0][i] = c;
  }
  for (std::size_t k = 1; k < 8; ++k) {
    for (std::size_t i = 0; i < 256; ++i) t[k][i] = (t[k - 1][i] >> 8) ^ t[0][t[k - 1][i] & 0xff];
  }
  return t;
}
constexpr CrcTables kCrc = make_crc_tables();

}  // namespace

std::uint32_t crc32(std::string_view data) {
  std::uint32_t c = 0xffffffffu;
  const char* p = data.data();
  std::size_t n = data.size();
  auto u32 = [](const char* q) {  // little-endian
    std::uint32_t v;
    std::memcpy(&v, q, 4);
    if constexpr (std::endian::native == std::endian::big) v = __builtin_bswap32(v);
    return v;
  };
  for (; n >= 8; p += 8, n -= 8) {
    std::uint32_t lo = c ^ u32(p), hi = u32(p + 4);
    c = kCrc[7][lo & 0xff] ^ kCrc[6][(lo >> 8) & 0xff] ^ kCrc[5][(lo >> 16) & 0xff] ^
        kCrc[4][lo >> 24] ^ kCrc[3][hi & 0xff] ^ kCrc[2][(hi >> 8) & 0xff] ^
        kCrc[1][(hi >> 16) & 0xff] ^ kCrc[0][hi >> 24];
  }
  for (; n > 0; ++p, --n) c = kCrc[0][(c ^ static_cast<std::uint8_t>(*p)) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

void TorchZip::fail(const std::string& cause) const {
  throw Error(ErrorCode::Corruption,
              fmt::format("{} is not a file written by torch.save (zip format, PyTorch >= 1.6) "
                          "or is damaged: {}",
                          path_, cause));
}

std::string TorchZip::bytes_at(std::uint64_t offset, std::uint64_t size) const {
  // Callers bound `size` by the archive's size (or a smaller limit) first.
  std::string out(size, '\0');
  file_.read_exact(out.data(), size, offset);
  return out;
}

TorchZip::TorchZip(File& file, std::string path) : file_(file), path_(std::move(path)) {
  const std::uint64_t n = file_.size();
  if (n < kEndSize) fail("too short to be a zip archive (truncated?)");
  // The end record is the last 22 bytes plus a comment of up to 64 KiB: search backwards in
  // that tail (only it is read, however large the file) for a signature whose comment length
  // reaches exactly the end of the file. A ZIP64 locator sits just before it.
  const std::uint64_t window =
      std::min<std::uint64_t>(n, kEndSize + kMaxComment + kZip64LocatorSize);
  const std::uint64_t base = n - window;
  const std::string tail = bytes_at(base, window);
  std::uint64_t end = n;
  for (std::uint64_t p = window - kEndSize + 1; p-- > 0;) {
    if (le(tail, p, 4) == kEndSig && base + p + kEndSize + le(tail, p + 20, 2) == n) {
      end = p;
      break;
    }
  }
  if (end == n) fail("no end-of-central-directory record (truncated or not a zip archive)");
  if (le(tail, end + 4, 2) != 0 || le(tail, end + 6, 2) != 0) {
    fail("the archive spans several disks");
  }
  std::uint64_t count = le(tail, end + 10, 2);
  std::uint64_t dir_size = le(tail, end + 12, 4);
  std::uint64_t dir_offset = le(tail, end + 16, 4);
  std::uint64_t dir_end = base + end;
  // torch.save always writes a ZIP64 end record (located by the 20 bytes before the plain
  // one); its counts are the authoritative ones.
  if (end >= kZip64LocatorSize && le(tail, end - kZip64LocatorSize, 4) == kZip64LocatorSig) {
    const std::uint64_t locator = base + end - kZip64LocatorSize;
    const std::uint64_t at = le(tail, end - kZip64LocatorSize + 8, 8);
    if (at > locator || locator - at < kZip64EndSize) {
      fail("the ZIP64 end-of-central-directory record is missing or out of place");
    }
    const std::string record = bytes_at(at, kZip64EndSize);
    if (le(record, 0, 4) != kZip64EndSig) {
      fail("the ZIP64 end-of-central-directory record is missing or out of place");
    }
    count = le(record, 32, 8);
    dir_size = le(record, 40, 8);
    dir_offset = le(record, 48, 8);
    dir_end = at;
  }
  if (dir_offset > dir_end || dir_size > dir_end - dir_offset) {
    fail(fmt::format("the central directory ({} bytes at {}) lies outside the archive", dir_size,
                     dir_offset));
  }
  if (dir_size > kMaxDirectory) {
    fail(
        fmt::format("the central directory is {} bytes, over the {} byte limit (a state dict "
                    "of a million tensors needs about 100 MB)",
                    dir_size, kMaxDirectory));
  }
  read_directory(dir_offset, bytes_at(dir_offset, dir_size), count);
  if (records_.empty()) fail("the archive has no records");
  const std::string& first = records_.front().name;
  std::size_t slash = first.find('/');
  if (slash == std::string::npos || slash == 0) {
    fail(fmt::format("its first record '{}' is not inside a directory", first));
  }
  prefix_ = first.substr(0, slash);
}

void TorchZip::read_directory(std::uint64_t offset, const std::string& dir, std::uint64_t count) {
  directory_offset_ = offset;
  const std::uint64_t size = dir.size();
  // Every entry takes at least 46 bytes, which bounds the count before anything is reserved.
  if (count > size / kCentralHeaderSize) {
    fail(fmt::format("the directory claims {} records in {} bytes", count, size));
  }
  records_.reserve(count);
  std::uint64_t at = 0;
  const std::uint64_t limit = size;
  for (std::uint64_t i = 0; i < count; ++i) {
    if (limit - at < kCentralHeaderSize || le(dir, at, 4) != kCentralHeaderSig) {
      fail(fmt::format("directory entry {} is damaged", i));
    }
    std::uint64_t flags = le(dir, at + 8, 2);
    std::uint64_t method = le(dir, at + 10, 2);
    Record r;
    r.crc32 = static_cast<std::uint32_t>(le(dir, at + 16, 4));
    std::uint64_t packed = le(dir, at + 20, 4);
    r.size = le(dir, at + 24, 4);
    std::uint64_t name_len = le(dir, at + 28, 2);
    std::uint64_t extra_len = le(dir, at + 30, 2);
    std::uint64_t comment_len = le(dir, at + 32, 2);
    r.header_offset = le(dir, at + 42, 4);
    std::uint64_t entry_size = kCentralHeaderSize + name_len + extra_len + comment_len;
    if (limit - at < entry_size) fail(fmt::format("directory entry {} is truncated", i));
    r.name = dir.substr(at + kCentralHeaderSize, name_len);
    // Sizes and offsets that do not fit in 32 bits are in the ZIP64 extra field, in this order.
    std::uint64_t extra = at + kCentralHeaderSize + name_len;
    const std::uint64_t extra_end = extra + extra_len;
    while (extra_end - extra >= 4) {
      std::uint64_t id = le(dir, extra, 2);
      std::uint64_t len = le(dir, extra + 2, 2);
      if (extra_end - extra - 4 < len) fail(fmt::format("record '{}': bad extra field", r.name));
      if (id == kZip64ExtraId) {
        std::uint64_t field = extra + 4;
        auto take = [&](std::uint64_t& value) {
          if (value != 0xffffffffu) return;
          if (extra + 4 + len - field < 8) {
            fail(fmt::format("record '{}': short ZIP64 extra field", r.name));
          }
          value = le(dir, field, 8);
          field += 8;
        };
        take(r.size);
        take(packed);
        take(r.header_offset);
      }
      extra += 4 + len;
    }
    if (flags & 1) {
      throw Error(ErrorCode::Unsupported,
                  fmt::format("{}: record '{}' is encrypted, which torch.save never writes", path_,
                              r.name));
    }
    if (method != 0) {
      throw Error(ErrorCode::Unsupported,
                  fmt::format("{}: record '{}' is compressed (zip method {}); torch.save stores "
                              "records uncompressed, so save the file again with torch.save "
                              "instead of re-zipping it",
                              path_, r.name, method));
    }
    if (packed != r.size) {
      fail(fmt::format("record '{}' is stored but its sizes differ ({} and {})", r.name, packed,
                       r.size));
    }
    if (r.header_offset >= offset) {
      fail(fmt::format("record '{}' starts at {}, past the central directory at {}", r.name,
                       r.header_offset, offset));
    }
    if (!index_.emplace(r.name, records_.size()).second) {
      fail(fmt::format("record '{}' appears twice", r.name));
    }
    records_.push_back(std::move(r));
    at += entry_size;
  }
}

std::uint64_t TorchZip::size(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? 0 : records_[it->second].size;
}

void TorchZip::read_into(const std::string& name, void* out) const {
  auto it = index_.find(name);
  if (it == index_.end()) fail(fmt::format("record '{}' is missing", name));
  const Record& r = records_[it->second];
  // The directory checked header_offset < directory_offset_ <= the file's size.
  std::uint64_t at = r.header_offset;
  if (directory_offset_ - at < kLocalHeaderSize) {
    fail(fmt::format("the local header of record '{}' is damaged", name));
  }
  const std::string header = bytes_at(at, kLocalHeaderSize);
  if (le(header, 0, 4) != kLocalHeaderSig) {
    fail(fmt::format("the local header of record '{}' is damaged", name));
  }
  std::uint64_t name_len = le(header, 26, 2);
  std::uint64_t extra_len = le(header, 28, 2);
  std::uint64_t data = at + kLocalHeaderSize + name_len + extra_len;
  if (data > directory_offset_ || r.size > directory_offset_ - data) {
    fail(fmt::format("record '{}' ({} bytes) runs past the end of the data (truncated?)", name,
                     r.size));
  }
  if (bytes_at(at + kLocalHeaderSize, name_len) != name) {
    fail(fmt::format("the local header of record '{}' names another record", name));
  }
  if (r.size > 0) file_.read_exact(out, r.size, data);
  // A zero CRC means the writer skipped it (recent PyTorch can be told to), not a check.
  if (r.crc32 != 0 && crc32(std::string_view(static_cast<const char*>(out), r.size)) != r.crc32) {
    fail(fmt::format("record '{}' fails its CRC-32 check", name));
  }
}

std::string TorchZip::read(const std::string& name) const {
  std::string out(size(name), '\0');
  read_into(name, out.data());
  return out;
}

}  // namespace torchpoint::detail
