// SHA-256 (FIPS 180-4), for the checkpoint digest of inspect.h (`torchpoint digest`). Not a security boundary: it names the exact
// contents of a checkpoint so two runs can be compared by eye or by script.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace torchpoint::detail {

// Incremental SHA-256: update() any number of times, then digest() once.
//
// Example:
//   Sha256 h;
//   h.update("abc");
//   std::string hex = h.hex_digest();  // "ba7816bf..."
class Sha256 {
 public:
  Sha256();

  void update(const void* data, std::size_t size);
  void update(std::string_view bytes) { update(bytes.data(), bytes.size()); }

  // Finishes the hash. The object must not be updated afterwards.
  std::array<std::uint8_t, 32> digest();
  // digest() as 64 lowercase hex digits.
  std::string hex_digest();

 private:
  void compress(const std::uint8_t* block);

  std::array<std::uint32_t, 8> state_;
  std::array<std::uint8_t, 64> buffer_{};
  std::size_t buffered_ = 0;
  std::uint64_t total_bytes_ = 0;
};

}  // namespace torchpoint::detail
