#include "format/checksum.h"

#include <xxh_x86dispatch.h>

#include <array>

namespace torchpoint {

std::uint64_t xxh3(const void* data, std::size_t size) { return XXH3_64bits_dispatch(data, size); }

struct Xxh3Stream::State {
  XXH3_state_t* s = XXH3_createState();
  ~State() { XXH3_freeState(s); }
};

Xxh3Stream::Xxh3Stream() : state_(std::make_unique<State>()) { XXH3_64bits_reset(state_->s); }
Xxh3Stream::~Xxh3Stream() = default;
Xxh3Stream::Xxh3Stream(Xxh3Stream&&) noexcept = default;
Xxh3Stream& Xxh3Stream::operator=(Xxh3Stream&&) noexcept = default;

void Xxh3Stream::update(const void* data, std::size_t size) {
  XXH3_64bits_update_dispatch(state_->s, data, size);
}

std::uint64_t Xxh3Stream::digest() const { return XXH3_64bits_digest(state_->s); }

std::string checksum_hex(std::uint64_t value) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string text(kChecksumHexLength, '0');
  for (std::size_t i = kChecksumHexLength; i-- > 0; value >>= 4) text[i] = kDigits[value & 0xf];
  return text;
}

std::optional<std::uint64_t> parse_checksum_hex(std::string_view text) {
  // The value of each lowercase hex digit, -1 for every other byte: a file of 20,000 tensors
  // has 20,000 of these to read at each load.
  static constexpr auto kDigit = [] {
    std::array<std::int8_t, 256> t{};
    t.fill(-1);
    for (int c = '0'; c <= '9'; ++c) t[c] = static_cast<std::int8_t>(c - '0');
    for (int c = 'a'; c <= 'f'; ++c) t[c] = static_cast<std::int8_t>(c - 'a' + 10);
    return t;
  }();
  if (text.size() != kChecksumHexLength) return std::nullopt;
  std::uint64_t value = 0;
  for (char c : text) {
    const std::int8_t digit = kDigit[static_cast<unsigned char>(c)];
    if (digit < 0) return std::nullopt;
    value = (value << 4) | static_cast<std::uint64_t>(digit);
  }
  return value;
}

}  // namespace torchpoint
