// For crash tests: one XXH3 over every key and value of a StateDict (tensor bytes, JSON text), so
// that children can log "final <digest>" and equal digests mean bit-identical states.
#pragma once

#include <cstdint>
#include <string>
#include <variant>

#include "format/checksum.h"
#include "torchpoint/state_dict.h"

namespace torchpoint::testing {

inline std::uint64_t state_digest(const StateDict& sd) {
  Xxh3Stream h;
  for (const auto& [key, value] : sd.entries()) {
    h.update(key.data(), key.size());
    if (std::holds_alternative<at::Tensor>(value)) {
      at::Tensor t = std::get<at::Tensor>(value).contiguous();
      h.update(t.data_ptr(), t.numel() * t.element_size());
    } else {
      std::string text = std::get<Json>(value).dump();
      h.update(text.data(), text.size());
    }
  }
  return h.digest();
}

}  // namespace torchpoint::testing
