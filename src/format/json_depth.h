// A bound on how deeply the JSON in a file may nest.
#pragma once

#include <string_view>

namespace torchpoint {

// nlohmann::json copies, compares and prints values recursively, so a hostile file nesting
// arrays a few thousand deep would overflow the stack. Readers refuse anything deeper than this
// before parsing; no state torchpoint or a user writes comes near it.
inline constexpr int kMaxJsonDepth = 1000;

// True when no array or object in the JSON text `text` is nested more than `max_depth` deep
// (brackets inside strings do not count). Linear in the text; does not validate it otherwise.
bool json_depth_within(std::string_view text, int max_depth = kMaxJsonDepth);

}  // namespace torchpoint
