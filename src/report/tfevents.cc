#include "report/tfevents.h"

#include <fmt/format.h>
#include <unistd.h>

#include <array>
#include <bit>
#include <boost/crc.hpp>
#include <cstring>

namespace torchpoint::detail {
namespace {

// The protobuf wire format: a key is (field << 3 | wire type); varints are little-endian base
// 128; fixed-width numbers little-endian; strings and messages length-prefixed.
enum WireType : std::uint32_t { kVarint = 0, kFixed64 = 1, kLengthDelimited = 2, kFixed32 = 5 };

void put_varint(std::string& out, std::uint64_t value) {
  while (value >= 0x80) {
    out += static_cast<char>((value & 0x7f) | 0x80);
    value >>= 7;
  }
  out += static_cast<char>(value);
}

void put_key(std::string& out, std::uint32_t field, WireType type) {
  put_varint(out, (static_cast<std::uint64_t>(field) << 3) | type);
}

static_assert(std::endian::native == std::endian::little, "the wire format is little-endian");

template <typename T>
void put_little_endian(std::string& out, T value) {
  std::array<char, sizeof(T)> bytes;
  std::memcpy(bytes.data(), &value, sizeof(T));
  out.append(bytes.data(), bytes.size());
}

void put_bytes(std::string& out, std::uint32_t field, const std::string& bytes) {
  put_key(out, field, kLengthDelimited);
  put_varint(out, bytes.size());
  out += bytes;
}

// Event fields: wall_time = 1 (double), step = 2 (int64), file_version = 3 (string),
// summary = 5 (Summary), session_log = 7 (SessionLog).
std::string event_head(double wall_time, std::int64_t step) {
  std::string out;
  put_key(out, 1, kFixed64);
  put_little_endian(out, wall_time);
  if (step != 0) {
    put_key(out, 2, kVarint);
    put_varint(out, static_cast<std::uint64_t>(step));
  }
  return out;
}

}  // namespace

std::uint32_t tfrecord_masked_crc(const std::string& data) {
  boost::crc_optimal<32, 0x1EDC6F41, 0xFFFFFFFF, 0xFFFFFFFF, true, true> crc32c;
  crc32c.process_bytes(data.data(), data.size());
  std::uint32_t crc = crc32c.checksum();
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string tfrecord(const std::string& payload) {
  std::string length;
  put_little_endian(length, static_cast<std::uint64_t>(payload.size()));
  std::string out = length;
  put_little_endian(out, tfrecord_masked_crc(length));
  out += payload;
  put_little_endian(out, tfrecord_masked_crc(payload));
  return out;
}

std::string event_file_version(double wall_time) {
  std::string out = event_head(wall_time, 0);
  put_bytes(out, 3, "brain.Event:2");
  return out;
}

std::string event_session_start(double wall_time, std::int64_t step) {
  std::string session_log;  // SessionLog: status = 1 (enum; START is 1)
  put_key(session_log, 1, kVarint);
  put_varint(session_log, 1);
  std::string out = event_head(wall_time, step);
  put_bytes(out, 7, session_log);
  return out;
}

std::string event_scalars(double wall_time, std::int64_t step,
                          const std::vector<std::pair<std::string, float>>& values) {
  std::string summary;  // Summary: repeated Value value = 1
  for (const auto& [tag, number] : values) {
    std::string value;  // Summary.Value: tag = 1 (string), simple_value = 2 (float)
    put_bytes(value, 1, tag);
    put_key(value, 2, kFixed32);
    put_little_endian(value, number);
    put_bytes(summary, 1, value);
  }
  std::string out = event_head(wall_time, step);
  put_bytes(out, 5, summary);
  return out;
}

std::string event_file_name(double wall_time, int serial) {
  std::array<char, 256> host{};
  if (::gethostname(host.data(), host.size() - 1) != 0) std::strcpy(host.data(), "localhost");
  return fmt::format("events.out.tfevents.{}.{}.{}.{}", static_cast<std::int64_t>(wall_time),
                     host.data(), ::getpid(), serial);
}

}  // namespace torchpoint::detail
