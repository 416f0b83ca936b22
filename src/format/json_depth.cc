#include "format/json_depth.h"

#include <array>
#include <cstdint>

namespace torchpoint {
namespace {

// What a byte means to the depth count, outside strings and inside them.
enum : std::uint8_t { kOther, kQuote, kOpen, kClose, kBackslash };

constexpr std::array<std::uint8_t, 256> kOutside = [] {
  std::array<std::uint8_t, 256> t{};
  t['"'] = kQuote;
  t['['] = t['{'] = kOpen;
  t[']'] = t['}'] = kClose;
  return t;
}();

constexpr std::array<std::uint8_t, 256> kInside = [] {
  std::array<std::uint8_t, 256> t{};
  t['"'] = kQuote;
  t['\\'] = kBackslash;
  return t;
}();

}  // namespace

// One table lookup per byte: a header of 20,000 tensors is megabytes of JSON, read at every
// load.
bool json_depth_within(std::string_view text, int max_depth) {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  const auto* end = p + text.size();
  int depth = 0;
  while (p < end) {
    const std::uint8_t kind = kOutside[*p++];
    if (kind == kOther) continue;
    if (kind == kQuote) {
      while (p < end) {
        const std::uint8_t inside = kInside[*p++];
        if (inside == kQuote) break;
        if (inside == kBackslash && p < end) ++p;  // the escaped byte, a quote included
      }
    } else if (kind == kOpen) {
      if (++depth > max_depth) return false;
    } else if (depth > 0) {
      --depth;
    }
  }
  return true;
}

}  // namespace torchpoint
