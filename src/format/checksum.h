// XXH3-64 checksums, as used in every torchpoint file, and their text form.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

namespace torchpoint {

// XXH3-64 with seed 0 (the vectorised build picked at run time).
std::uint64_t xxh3(const void* data, std::size_t size);

// XXH3-64 over data that arrives in pieces; equal to xxh3() of the concatenation.
class Xxh3Stream {
 public:
  Xxh3Stream();
  ~Xxh3Stream();
  Xxh3Stream(Xxh3Stream&&) noexcept;
  Xxh3Stream& operator=(Xxh3Stream&&) noexcept;

  void update(const void* data, std::size_t size);
  std::uint64_t digest() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
};

// Exactly 16 lowercase hex digits.
std::string checksum_hex(std::uint64_t value);
// The value of 16 lowercase hex digits; nullopt for anything else.
std::optional<std::uint64_t> parse_checksum_hex(std::string_view text);

inline constexpr std::size_t kChecksumHexLength = 16;

}  // namespace torchpoint
