// Insertion-ordered JSON in linear time.
//
// nlohmann::ordered_json keeps an object's keys in a vector and finds a key by walking it, so
// parsing an object of n keys, or filling one with operator[], costs O(n^2): 100,000 keys take
// seconds. These helpers build the same values in O(n).
#pragma once

#include <string>
#include <string_view>

#include "torchpoint/tensor_file.h"

namespace torchpoint {

// Parses `text` as ordered_json::parse() does (same values, same key order, a duplicate key
// keeps its first position and its last value; the same nlohmann exceptions on bad input), in
// time linear in the number of keys.
Json parse_ordered_json(std::string_view text);

// Appends `key` to the object `object` without looking for it first: the caller guarantees it
// is not there yet (ordered_json's operator[] would search every earlier key).
void append_new_key(Json& object, std::string key, Json value);

// The string at `key`, or "" when it is missing or not a string (json::value() would throw a
// nlohmann exception for a hostile non-string, which no caller expects).
std::string string_field(const Json& object, const char* key);

}  // namespace torchpoint
