// Reads container files as hostile input: every length, offset, shape and dtype is checked
// before it is used, and no allocation is sized by a number that was not checked first.
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/CPUAllocator.h>
#include <fmt/format.h>
#include <simdjson.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <numeric>
#include <unordered_map>
#include <unordered_set>

#include "compat/torch_compat.h"
#include "format/checksum.h"
#include "format/container.h"
#include "format/fresh_read.h"
#include "format/json_depth.h"
#include "format/ordered_json.h"
#include "io/filename.h"
#include "torchpoint/error.h"

namespace torchpoint {

void Problems::add(std::string message, ErrorCode code) {
  ++count_;
  if (sink_ == nullptr) throw Error(code, message);
  sink_->push_back(std::move(message));
  if (codes_ != nullptr) codes_->push_back(code);
}

namespace {

using ojson = nlohmann::ordered_json;

// numel * element size, or nullopt on overflow or a negative dimension.
std::optional<std::uint64_t> byte_size(const std::vector<std::int64_t>& shape,
                                       std::size_t element_size) {
  std::uint64_t total = element_size;
  for (std::int64_t d : shape) {
    if (d < 0) return std::nullopt;
    auto u = static_cast<std::uint64_t>(d);
    if (u != 0 && total > std::numeric_limits<std::uint64_t>::max() / u) return std::nullopt;
    total *= u;
  }
  return total;
}

std::optional<std::uint64_t> as_u64(const nlohmann::json& v) {
  if (v.is_number_unsigned()) return v.get<std::uint64_t>();
  if (v.is_number_integer() && v.get<std::int64_t>() >= 0) return v.get<std::uint64_t>();
  return std::nullopt;
}

// Makes a tensor entry of the header's fields, checked; returns false (after reporting) when
// it is unusable.
bool make_entry(std::string name, const std::string& dtype_name,
                const std::vector<std::uint64_t>& dims, std::uint64_t begin, std::uint64_t end,
                const std::string& path, Problems& problems, TensorEntry* out) {
  auto bad = [&](const std::string& why) {
    problems.add(fmt::format("{}: tensor '{}': {}", path, name, why));
    return false;
  };
  bool unsupported = false;
  auto dtype = dtype_from_name(dtype_name, &unsupported);
  if (!dtype) {
    if (unsupported) {
      problems.add(fmt::format("{}: tensor '{}' has dtype {}, which LibTorch {} cannot hold; "
                               "read it with a newer LibTorch (2.3 or later has every "
                               "safetensors dtype)",
                               path, name, dtype_name, compat::torch_version()),
                   ErrorCode::Unsupported);
      return false;
    }
    return bad(fmt::format("unknown dtype '{}'", dtype_name));
  }
  if (dims.size() > 64) return bad(fmt::format("{} dimensions is too many", dims.size()));
  std::vector<std::int64_t> shape;
  shape.reserve(dims.size());
  for (std::uint64_t u : dims) {
    if (u > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max())) {
      return bad(fmt::format("shape [{}] has an invalid dimension", fmt::join(dims, ",")));
    }
    shape.push_back(static_cast<std::int64_t>(u));
  }
  if (begin > end) return bad(fmt::format("invalid data_offsets [{},{}]", begin, end));
  auto bytes = byte_size(shape, dtype->size);
  if (!bytes || *bytes != end - begin) {
    return bad(fmt::format("shape [{}] of {} needs {} bytes but data_offsets [{},{}] span {}",
                           fmt::join(shape, ","), dtype_name,
                           bytes ? std::to_string(*bytes) : std::string("too many"), begin, end,
                           end - begin));
  }
  *out = TensorEntry{std::move(name), *dtype, std::move(shape), begin, end, 0};
  return true;
}

// Parses one tensor entry of a header parsed by nlohmann; returns false (after reporting) when
// it is unusable.
bool parse_entry(const std::string& name, const nlohmann::json& value, const std::string& path,
                 Problems& problems, TensorEntry* out) {
  auto bad = [&](const std::string& why) {
    problems.add(fmt::format("{}: tensor '{}': {}", path, name, why));
    return false;
  };
  if (!value.is_object()) return bad("header entry is not an object");
  auto dtype_it = value.find("dtype");
  auto shape_it = value.find("shape");
  auto offsets_it = value.find("data_offsets");
  if (dtype_it == value.end() || !dtype_it->is_string()) return bad("missing or non-string dtype");
  if (shape_it == value.end() || !shape_it->is_array()) return bad("missing or non-array shape");
  if (offsets_it == value.end() || !offsets_it->is_array() || offsets_it->size() != 2) {
    return bad("data_offsets must be an array of two integers");
  }
  if (shape_it->size() > 64) return bad(fmt::format("{} dimensions is too many", shape_it->size()));
  std::vector<std::uint64_t> dims;
  for (const nlohmann::json& d : *shape_it) {
    auto u = as_u64(d);
    if (!u) return bad(fmt::format("shape {} has an invalid dimension", shape_it->dump()));
    dims.push_back(*u);
  }
  auto begin = as_u64((*offsets_it)[0]);
  auto end = as_u64((*offsets_it)[1]);
  if (!begin || !end) return bad(fmt::format("invalid data_offsets {}", offsets_it->dump()));
  return make_entry(name, dtype_it->get<std::string>(), dims, *begin, *end, path, problems, out);
}

// Checks the torchpoint metadata string (nullopt: absent, or not a string) and fills version,
// checksums, order and state.
void parse_torchpoint_metadata(const std::optional<std::string>& torchpoint_text,
                               const std::string& path, Problems& problems,
                               ContainerHeader* header) {
  if (!torchpoint_text) {
    problems.add(
        fmt::format("{}: no torchpoint metadata in the header: not a torchpoint file "
                    "(a plain safetensors file has no checksums to verify)",
                    path));
    return;
  }
  const std::string& meta_text = *torchpoint_text;
  if (!json_depth_within(meta_text)) {
    problems.add(
        fmt::format("{}: torchpoint metadata nests deeper than {} levels", path, kMaxJsonDepth));
    return;
  }
  ojson meta;
  try {
    meta = parse_ordered_json(meta_text);
  } catch (const ojson::exception& e) {
    problems.add(fmt::format("{}: torchpoint metadata is not valid JSON ({})", path, e.what()));
    return;
  }
  if (!meta.is_object() || string_field(meta, "format") != kFormatName) {
    problems.add(fmt::format("{}: torchpoint metadata has no \"format\": \"torchpoint\"", path));
    return;
  }
  std::string version = string_field(meta, "format_version");
  int major = 0, minor = 0;
  if (std::sscanf(version.c_str(), "%d.%d", &major, &minor) != 2 || major < 1) {
    problems.add(fmt::format("{}: invalid format_version '{}'", path, version));
    return;
  }
  header->version_major = major;
  header->version_minor = minor;
  if (major > kFormatMajor) {
    problems.add(fmt::format("{} is in torchpoint format version {}, but this build reads "
                             "versions up to {}.{}: upgrade torchpoint to load it",
                             path, version, kFormatMajor, kFormatMinor),
                 ErrorCode::Incompatible);
    return;
  }
  auto state = meta.find("state");
  if (state == meta.end() || !state->is_object()) {
    problems.add(fmt::format("{}: torchpoint metadata has no \"state\" object", path));
  } else {
    header->state = *state;
  }
  auto tensors = meta.find("tensors");
  if (tensors == meta.end() || !tensors->is_array()) {
    problems.add(fmt::format("{}: torchpoint metadata has no \"tensors\" checksums", path));
    return;
  }
  std::unordered_map<std::string_view, std::size_t> index;
  for (std::size_t i = 0; i < header->entries.size(); ++i) index[header->entries[i].name] = i;
  std::unordered_set<std::size_t> listed;
  for (const auto& pair : *tensors) {
    if (!pair.is_array() || pair.size() != 2 || !pair[0].is_string()) {
      problems.add(fmt::format("{}: malformed entry {} in \"tensors\"", path, pair.dump()));
      continue;
    }
    const std::string& name = pair[0].get_ref<const std::string&>();
    const auto& value = pair[1];
    auto found = index.find(name);
    if (found == index.end()) {
      problems.add(fmt::format("{}: tensor '{}' has a checksum but no header entry", path, name));
      continue;
    }
    if (listed.count(found->second)) {
      problems.add(fmt::format("{}: tensor '{}' is listed twice", path, name));
      continue;
    }
    auto sum = value.is_string() ? parse_checksum_hex(value.get<std::string>()) : std::nullopt;
    if (!sum) {
      problems.add(fmt::format("{}: tensor '{}' has a malformed checksum", path, name));
      continue;
    }
    header->entries[found->second].checksum = *sum;
    header->caller_order.push_back(found->second);
    listed.insert(found->second);
  }
  for (std::size_t i = 0; i < header->entries.size(); ++i) {
    if (!listed.count(i)) {
      problems.add(fmt::format("{}: tensor '{}' has no checksum", path, header->entries[i].name));
    }
  }
}


// ---- The fast path: simdjson ------------------------------------------------------------------
//
// nlohmann builds a tree of the whole header, which for 20,000 tensors (a 2.8 MB header) takes
// most of a load's time. simdjson reads it in place, about twenty times as fast. The fast path
// takes only headers that are exactly as torchpoint writes them, and declines (returns false,
// having changed nothing) at the first thing it does not expect: then the nlohmann path reads
// the header again and reports its problems in its own words. So the two agree on every
// header the fast path takes, and every problem is reported by one reader only.

namespace sj = simdjson::ondemand;

// The tensor entries, the presence of __metadata__ and its "torchpoint" string.
struct FastHeader {
  std::vector<TensorEntry> entries;
  bool has_metadata = false;
  std::optional<std::string> torchpoint_text;
};

bool fast_u64_array(sj::value value, std::vector<std::uint64_t>* out, std::size_t max) {
  sj::array array;
  if (value.get_array().get(array)) return false;
  for (auto item : array) {
    std::uint64_t u = 0;
    if (item.get_uint64().get(u) || out->size() == max) return false;
    out->push_back(u);
  }
  return true;
}

// Whether `value` is neither an array nor an object. The fast reader takes members it does not
// read only when they are: what it takes then nests three levels at most, so it needs no bound
// on nesting, and anything nested is left to the full reader, which applies the bound.
bool fast_flat(sj::value value) {
  sj::json_type type;
  return !value.type().get(type) && type != sj::json_type::array &&
         type != sj::json_type::object;
}

bool fast_entry(std::string name, sj::value value, const std::string& path,
                TensorEntry* out) {
  sj::object object;
  if (value.get_object().get(object)) return false;
  std::string dtype;
  std::vector<std::uint64_t> dims, offsets;
  bool has_dtype = false, has_shape = false, has_offsets = false;
  for (auto item : object) {
    sj::field field;
    std::string_view key;
    if (std::move(item).get(field) || field.unescaped_key().get(key)) return false;
    if (key == "dtype") {
      std::string_view text;
      if (has_dtype || field.value().get_string().get(text)) return false;
      dtype = text;
      has_dtype = true;
    } else if (key == "shape") {
      if (has_shape || !fast_u64_array(field.value(), &dims, 64)) return false;
      has_shape = true;
    } else if (key == "data_offsets") {
      if (has_offsets || !fast_u64_array(field.value(), &offsets, 2)) return false;
      has_offsets = true;
    } else if (!fast_flat(field.value())) {
      return false;
    }
  }
  if (!has_dtype || !has_shape || offsets.size() != 2) return false;
  std::vector<std::string> problems;
  Problems collect(&problems);
  return make_entry(std::move(name), dtype, dims, offsets[0], offsets[1], path, collect, out);
}

// True when `doc` (over `padded`) is one value followed by nothing but JSON whitespace, as
// nlohmann requires; rewinds it for reading. (simdjson 3.0's On Demand API reads values in
// place and does not check what follows the root by itself.)
bool nothing_after_root(sj::document& doc, const simdjson::padded_string& padded) {
  std::string_view raw;
  if (doc.raw_json().get(raw)) return false;
  std::string_view rest(padded.data(), padded.size());
  rest.remove_prefix(static_cast<std::size_t>(raw.data() + raw.size() - padded.data()));
  doc.rewind();
  return rest.find_first_not_of(" \t\n\r") == std::string_view::npos;
}

bool fast_header(std::string_view text, const std::string& path, FastHeader* out) {
  sj::parser parser;
  simdjson::padded_string padded(text.data(), text.size());
  sj::document doc;
  sj::object root;
  if (parser.iterate(padded).get(doc) || !nothing_after_root(doc, padded) ||
      doc.get_object().get(root)) {
    return false;
  }
  // The unescaped keys stay in the parser's buffer while it lives.
  std::unordered_set<std::string_view> names;
  // An entry takes 60 bytes or more; a hostile header's size reserves no more than 1M names.
  names.reserve(std::min<std::size_t>(text.size() / 60, std::size_t{1} << 20));
  for (auto item : root) {
    sj::field field;
    std::string_view key;
    if (std::move(item).get(field) || field.unescaped_key().get(key)) return false;
    if (key == kMetadataKey) {
      sj::object metadata;
      if (out->has_metadata || field.value().get_object().get(metadata)) return false;
      out->has_metadata = true;
      for (auto meta_item : metadata) {
        sj::field meta_field;
        std::string_view meta_key;
        if (std::move(meta_item).get(meta_field) || meta_field.unescaped_key().get(meta_key)) {
          return false;
        }
        if (meta_key != kTorchpointKey) {
          if (!fast_flat(meta_field.value())) return false;
          continue;
        }
        std::string_view value;
        if (out->torchpoint_text || meta_field.value().get_string().get(value)) return false;
        out->torchpoint_text = std::string(value);
      }
      continue;
    }
    TensorEntry entry;
    if (!names.insert(key).second || !fast_entry(std::string(key), field.value(), path, &entry)) {
      return false;
    }
    out->entries.push_back(std::move(entry));
  }
  return true;
}

// The torchpoint metadata of a header the fast path took, into `header`: only when it is
// exactly right (format, a version this build reads, a state object, one checksum per entry).
bool fast_torchpoint_metadata(const std::string& meta_text, ContainerHeader* header) {
  sj::parser parser;
  simdjson::padded_string padded(meta_text);
  sj::document doc;
  sj::object meta;
  if (parser.iterate(padded).get(doc) || !nothing_after_root(doc, padded) ||
      doc.get_object().get(meta)) {
    return false;
  }
  std::optional<std::string> format, version;
  std::optional<Json> state;
  std::vector<std::pair<std::size_t, std::uint64_t>> sums;  // entry, checksum
  bool has_tensors = false;
  // The entry of each listed name: torchpoint lists them in data order, so the entry after
  // the last one found is tried first; the map is built only for a file listed otherwise.
  const std::vector<TensorEntry>& entries = header->entries;
  std::unordered_map<std::string_view, std::size_t> index;
  std::size_t next = 0;
  auto find_entry = [&](std::string_view name) -> std::optional<std::size_t> {
    if (next < entries.size() && entries[next].name == name) return next++;
    if (index.empty()) {
      index.reserve(entries.size());
      for (std::size_t i = 0; i < entries.size(); ++i) index.emplace(entries[i].name, i);
    }
    auto found = index.find(name);
    if (found == index.end()) return std::nullopt;
    next = found->second + 1;
    return found->second;
  };
  std::vector<bool> listed(header->entries.size(), false);
  for (auto item : meta) {
    sj::field field;
    std::string_view key;
    if (std::move(item).get(field) || field.unescaped_key().get(key)) return false;
    if (key == "format" || key == "format_version") {
      std::string_view text;
      std::optional<std::string>& slot = key == "format" ? format : version;
      if (slot || field.value().get_string().get(text)) return false;
      slot = std::string(text);
    } else if (key == "state") {
      sj::object object;
      std::string_view raw;
      // The state becomes a nlohmann value, so its nesting is bounded here: with the
      // metadata object around it, as the full reader counts.
      if (state || field.value().get_object().get(object) || object.raw_json().get(raw) ||
          !json_depth_within(raw, kMaxJsonDepth - 1)) {
        return false;
      }
      try {
        state = parse_ordered_json(raw);
      } catch (const ojson::exception&) {
        return false;
      }
    } else if (key == "tensors") {
      sj::array tensors;
      if (has_tensors || field.value().get_array().get(tensors)) return false;
      has_tensors = true;
      for (auto pair_item : tensors) {
        sj::array pair;
        if (pair_item.get_array().get(pair)) return false;
        std::string_view parts[2];
        std::size_t n = 0;
        for (auto part : pair) {
          if (n == 2 || part.get_string().get(parts[n])) return false;
          ++n;
        }
        if (n != 2) return false;
        std::optional<std::size_t> found = find_entry(parts[0]);
        auto sum = parse_checksum_hex(parts[1]);
        if (!found || listed[*found] || !sum) return false;
        listed[*found] = true;
        sums.emplace_back(*found, *sum);
      }
    } else if (!fast_flat(field.value())) {
      return false;
    }
  }
  if (format != kFormatName || !version || !state || !has_tensors) return false;
  int major = 0, minor = 0;
  if (std::sscanf(version->c_str(), "%d.%d", &major, &minor) != 2 || major < 1 ||
      major > kFormatMajor) {
    return false;
  }
  if (sums.size() != header->entries.size()) return false;  // an entry with no checksum
  header->version_major = major;
  header->version_minor = minor;
  header->state = std::move(*state);
  for (const auto& [entry, sum] : sums) {
    header->entries[entry].checksum = sum;
    header->caller_order.push_back(entry);
  }
  return true;
}

}  // namespace

ContainerHeader parse_container_header(std::string_view prefix, std::uint64_t file_size,
                                       const std::string& path, Problems& problems,
                                       bool allow_foreign) {
  ContainerHeader header;
  if (file_size < 8 || prefix.size() < 8) {
    problems.add(
        fmt::format("{} is {} bytes long, too short for a container header (8 bytes "
                    "at least): the file is truncated or not a checkpoint file",
                    path, file_size));
    return header;
  }
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<std::uint8_t>(prefix[i]);
  if (n > kMaxHeaderSize || n > file_size - 8) {
    problems.add(
        fmt::format("{}: the header length its first 8 bytes give exceeds {} (file size {}): "
                    "the file is truncated or not a container",
                    path, std::min<std::uint64_t>(kMaxHeaderSize, file_size - 8), file_size));
    return header;
  }
  if (prefix.size() < 8 + n) {
    problems.add(fmt::format("{}: only {} header bytes available of {}", path, prefix.size(), n));
    return header;
  }
  header.data_start = 8 + n;
  std::string_view text = prefix.substr(8, n);

  // The header checksum: the last key, at a fixed place before the space padding.
  std::size_t last = text.find_last_not_of(' ');
  std::string key = fmt::format("\"{}\":\"", kHeaderChecksumKey);
  std::size_t tail = key.size() + kChecksumHexLength + 3;  // digits, then "}}
  bool header_ok = true;
  bool has_tail =
      !(last == std::string_view::npos || last + 1 < tail ||
        text.substr(last + 1 - tail, key.size()) != key || text.substr(last - 2, 3) != "\"}}");
  if (!has_tail && allow_foreign) {
    header.foreign = true;  // another writer's file: structure only, no checksums
  } else if (!has_tail) {
    problems.add(
        fmt::format("{}: the header does not end with its checksum: not a torchpoint "
                    "file, or its header is damaged",
                    path));
    header_ok = false;
  } else {
    std::size_t digits_at = last + 1 - tail + key.size();
    auto claimed = parse_checksum_hex(text.substr(digits_at, kChecksumHexLength));
    // The checksum covers the header with its own digits as zeros: hashed in three pieces
    // rather than through a copy of a header that may be megabytes long.
    static constexpr char kZeros[] = "0000000000000000";
    static_assert(sizeof(kZeros) == kChecksumHexLength + 1);
    Xxh3Stream stream;
    stream.update(prefix.data(), 8 + digits_at);
    stream.update(kZeros, kChecksumHexLength);
    const std::size_t after = 8 + digits_at + kChecksumHexLength;
    stream.update(prefix.data() + after, 8 + n - after);
    std::uint64_t actual = stream.digest();
    if (!claimed || *claimed != actual) {
      problems.add(
          fmt::format("{}: header checksum mismatch (stored {}, computed {}): the "
                      "header is corrupt",
                      path, text.substr(digits_at, kChecksumHexLength), checksum_hex(actual)));
      header_ok = false;
    } else {
      header.header_checksum = actual;
    }
  }
  if (!header_ok && !problems.collecting()) return header;

  FastHeader fast;
  const bool took_fast = fast_header(text, path, &fast);
  bool has_metadata = false;
  std::optional<std::string> torchpoint_text;
  if (took_fast) {
    header.entries = std::move(fast.entries);
    has_metadata = fast.has_metadata;
    torchpoint_text = std::move(fast.torchpoint_text);
  } else {
    // The fast reader takes nothing nested deeper than three levels; this one parses
    // recursively, so the bound on nesting is checked here, not before the fast reader (a pass
    // over megabytes of header that a load of 20,000 tensors paid for nothing).
    if (!json_depth_within(text)) {
      problems.add(
          fmt::format("{}: header JSON nests deeper than {} levels", path, kMaxJsonDepth));
      return header;
    }
    // A std::map-backed object: ordered_json would make 20,000 keys cost quadratic time, and
    // the data order comes from the offsets anyway.
    nlohmann::json root;
    try {
      root = nlohmann::json::parse(text);
    } catch (const nlohmann::json::parse_error& e) {
      // The position only: the parser's own message quotes the file's bytes, which need not
      // be a checkpoint's (a link or a stray file may hold anything).
      problems.add(
          fmt::format("{}: header is not valid JSON (syntax error at byte {} of the "
                      "header)",
                      path, e.byte));
      return header;
    } catch (const nlohmann::json::exception& e) {
      problems.add(fmt::format("{}: header is not valid JSON (error {})", path, e.id));
      return header;
    }
    if (!root.is_object()) {
      problems.add(fmt::format("{}: header is not a JSON object", path));
      return header;
    }
    for (const auto& [name, value] : root.items()) {
      if (name == kMetadataKey) {
        if (!value.is_object()) {
          problems.add(fmt::format("{}: __metadata__ is not an object", path));
        } else {
          has_metadata = true;
          auto it = value.find(std::string(kTorchpointKey));
          if (it != value.end() && it->is_string()) torchpoint_text = it->get<std::string>();
        }
        continue;
      }
      TensorEntry entry;
      if (parse_entry(name, value, path, problems, &entry))
        header.entries.push_back(std::move(entry));
    }
  }

  // The data must tile [0, data size) exactly: no holes, no overlap, nothing after it.
  std::uint64_t data_size = file_size - header.data_start;
  std::vector<std::size_t> by_offset(header.entries.size());
  std::iota(by_offset.begin(), by_offset.end(), 0);
  auto before = [&](std::size_t a, std::size_t b) {
    const auto& ea = header.entries[a];
    const auto& eb = header.entries[b];
    return ea.begin != eb.begin ? ea.begin < eb.begin : ea.end < eb.end;
  };
  // torchpoint writes the entries in data order: then there is nothing to sort.
  if (!std::is_sorted(by_offset.begin(), by_offset.end(), before)) {
    std::sort(by_offset.begin(), by_offset.end(), before);
  }
  std::uint64_t expected = 0;
  for (std::size_t i : by_offset) {
    const TensorEntry& e = header.entries[i];
    if (e.begin != expected) {
      problems.add(fmt::format(
          "{}: tensor '{}' starts at data offset {} but the previous "
          "tensor ends at {} ({})",
          path, e.name, e.begin, expected, e.begin > expected ? "a hole" : "an overlap"));
    }
    expected = std::max(expected, e.end);
  }
  if (expected != data_size) {
    problems.add(
        fmt::format("{}: the tensors cover {} data bytes but the file holds {}: the "
                    "file is {}",
                    path, expected, data_size,
                    expected > data_size ? "truncated" : "longer than its header says"));
  }
  std::vector<TensorEntry> ordered;
  ordered.reserve(by_offset.size());
  for (std::size_t i : by_offset) ordered.push_back(std::move(header.entries[i]));
  header.entries = std::move(ordered);

  if (header.foreign) {
    for (std::size_t i = 0; i < header.entries.size(); ++i) header.caller_order.push_back(i);
    return header;
  }
  if (!has_metadata) {
    problems.add(fmt::format("{}: the header has no __metadata__: not a torchpoint file", path));
    return header;
  }
  if (took_fast && torchpoint_text && fast_torchpoint_metadata(*torchpoint_text, &header)) {
    return header;
  }
  parse_torchpoint_metadata(torchpoint_text, path, problems, &header);
  return header;
}

ContainerHeader read_container_header(File& file, const std::string& path, Problems& problems,
                                      bool allow_foreign) {
  std::uint64_t file_size = file.size();
  std::string prefix(std::min<std::uint64_t>(file_size, 8), '\0');
  file.read_exact(prefix.data(), prefix.size(), 0);
  if (prefix.size() == 8) {
    std::uint64_t n = 0;
    for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<std::uint8_t>(prefix[i]);
    // Only a length already known to fit in the file and under the bound sizes the buffer.
    if (n <= kMaxHeaderSize && n <= file_size - 8) {
      prefix.resize(8 + n);
      file.read_exact(prefix.data() + 8, n, 8);
    }
  }
  return parse_container_header(prefix, file_size, path, problems, allow_foreign);
}

namespace {

// The size the header says the file has.
std::uint64_t expected_size(const ContainerHeader& header) {
  return header.data_start + (header.entries.empty() ? 0 : header.entries.back().end);
}

// Throws Corruption unless `file` still has the size its header promised: a committed file
// never changes, so a difference means another process truncated or rewrote it.
void check_size_unchanged(File& file, const ContainerHeader& header, const std::string& path,
                          const char* while_what, Problems& problems) {
  std::uint64_t now = file.size();
  if (now != expected_size(header)) {
    problems.add(
        fmt::format("{} changed size while being {} ({} bytes, its header says {}): "
                    "another process truncated or rewrote it; a committed checkpoint "
                    "must never be modified in place",
                    path, while_what, now, expected_size(header)));
  }
}

// Reads every tensor's bytes with positioned reads (never through a mapping, so a file
// truncated meanwhile is an error, not SIGBUS) and reports each checksum mismatch.
void check_data(File& file, const ContainerHeader& header, const std::string& path,
                Problems& problems) {
  std::vector<std::uint8_t> buffer(
      static_cast<std::size_t>(std::min<std::uint64_t>(kReadBufferSize, expected_size(header))));
  for (const TensorEntry& e : header.entries) {
    std::uint64_t actual =
        checksum_range(file, header.data_start + e.begin, e.end - e.begin, buffer);
    if (actual != e.checksum) {
      problems.add(
          fmt::format("{}: tensor '{}' fails its checksum (stored {}, computed {}): its "
                      "data is corrupt",
                      path, e.name, checksum_hex(e.checksum), checksum_hex(actual)));
    }
  }
}

// Opens `path` and reads and validates its header; throws at the first problem.
ContainerHeader open_container(Env& env, const std::string& path, bool allow_foreign,
                               std::unique_ptr<File>* file) {
  *file = env.open(path, OpenMode::Read);
  Problems throwing;
  ContainerHeader header = read_container_header(**file, path, throwing, allow_foreign);
  return header;
}

}  // namespace

std::uint64_t checksum_range(File& file, std::uint64_t offset, std::uint64_t size,
                             std::vector<std::uint8_t>& buffer) {
  if (size <= buffer.size()) {
    file.read_exact(buffer.data(), size, offset);
    return xxh3(buffer.data(), size);
  }
  Xxh3Stream stream;
  while (size > 0) {
    std::size_t n = static_cast<std::size_t>(std::min<std::uint64_t>(size, buffer.size()));
    file.read_exact(buffer.data(), n, offset);
    stream.update(buffer.data(), n);
    offset += n;
    size -= n;
  }
  return stream.digest();
}

// A new tensor for entry `e`; Unsupported when it does not fit in memory.
static at::Tensor empty_tensor(const TensorEntry& e, std::uint64_t size, const std::string& path) {
  try {
    return at::empty(e.shape, at::TensorOptions().dtype(e.dtype.type));
  } catch (const std::exception&) {  // c10::Error (out of memory) or std::bad_alloc
    throw Error(ErrorCode::Unsupported,
                fmt::format("{}: tensor '{}' ({} bytes) does not fit in this process's memory: "
                            "free memory, or read tensors one at a time with TensorFileReader",
                            path, e.name, size));
  }
}

Container load_file(const std::string& path, Env& env) {
  return load_container(env, path, nullptr);
}

Container load_container(Env& env, const std::string& path, std::uint64_t* header_checksum,
                         bool allow_foreign, bool* verified) {
  return load_container_part(env, path, nullptr, header_checksum, nullptr, allow_foreign,
                             verified);
}

Container load_container_part(Env& env, const std::string& path, const TensorFilter& keep,
                              std::uint64_t* header_checksum, std::uint64_t* bytes_read,
                              bool allow_foreign, bool* verified) {
  std::unique_ptr<File> file;
  ContainerHeader header = open_container(env, path, allow_foreign, &file);
  if (verified != nullptr) *verified = !header.foreign;
  if (header_checksum != nullptr) *header_checksum = header.header_checksum;
  std::vector<bool> kept(header.entries.size(), true);
  std::uint64_t read = header.data_start;
  for (std::size_t i = 0; i < header.entries.size(); ++i) {
    if (keep) kept[i] = keep(header.entries[i].name, header.state);
    if (kept[i]) read += header.entries[i].end - header.entries[i].begin;
  }
  if (bytes_read != nullptr) *bytes_read = read;

  // Each tensor is read into memory of its own, never a mapping of the file: nothing the file
  // goes through afterwards can change or fault a tensor.
  std::vector<at::Tensor> tensors(header.entries.size());
  if (!keep) {
    // The whole file: one read into new memory, hashed as it lands (fresh_read.h); large
    // tensors keep their piece of it, small ones are copied out so that it can go.
    FreshData fresh = FreshData::read(env, path, *file, header);
    for (std::size_t i = 0; i < header.entries.size(); ++i) {
      const TensorEntry& e = header.entries[i];
      const std::uint64_t size = e.end - e.begin;
      const char* bytes = fresh.bytes(e);
      if (size >= kAdoptFrom && reinterpret_cast<std::uintptr_t>(bytes) % e.dtype.size == 0) {
        c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<std::int64_t>(size),
                             fresh.adopt(e), c10::GetCPUAllocator(), /*resizable=*/true);
        tensors[i] =
            at::empty({0}, at::TensorOptions().dtype(e.dtype.type)).set_(storage, 0, e.shape);
      } else {
        tensors[i] = empty_tensor(e, size, path);
        if (size > 0) std::memcpy(tensors[i].data_ptr(), bytes, size);
      }
    }
  } else {
    Problems throwing;
    for (std::size_t i = 0; i < header.entries.size(); ++i) {
      if (!kept[i]) continue;
      const TensorEntry& e = header.entries[i];
      std::uint64_t size = e.end - e.begin;
      at::Tensor t = empty_tensor(e, size, path);
      file->read_exact(t.data_ptr(), size, header.data_start + e.begin);
      if (!header.foreign) {
        std::uint64_t actual = xxh3(t.data_ptr(), size);
        if (actual != e.checksum) {
          throwing.add(
              fmt::format("{}: tensor '{}' fails its checksum (stored {}, computed {}): its "
                          "data is corrupt",
                          path, e.name, checksum_hex(e.checksum), checksum_hex(actual)));
        }
      }
      tensors[i] = std::move(t);
    }
    check_size_unchanged(*file, header, path, "read", throwing);
  }

  Container out;
  out.state = std::move(header.state);
  out.tensors.reserve(header.entries.size());
  for (std::size_t i : header.caller_order) {
    if (kept[i]) out.tensors.emplace_back(header.entries[i].name, std::move(tensors[i]));
  }
  return out;
}

Container load_file_mapped(const std::string& path, Env& env) {
  std::unique_ptr<File> file;
  ContainerHeader header = open_container(env, path, /*allow_foreign=*/false, &file);
  Problems throwing;
  // Checked by positioned reads, before the mapping exists: a truncation during the load is a
  // Corruption error here, never SIGBUS.
  check_data(*file, header, path, throwing);
  std::shared_ptr<MappedRegion> region = file->map();
  if (region->size() != expected_size(header)) {
    throwing.add(
        fmt::format("{} changed size while being read ({} bytes, its header says {}): "
                    "another process truncated or rewrote it",
                    path, region->size(), expected_size(header)));
  }

  Container out;
  out.state = std::move(header.state);
  out.tensors.reserve(header.entries.size());
  for (std::size_t i : header.caller_order) {
    const TensorEntry& e = header.entries[i];
    std::uint64_t offset = header.data_start + e.begin;
    auto options = at::TensorOptions().dtype(e.dtype.type);
    at::Tensor t;
    if (offset % e.dtype.size == 0) {
      // Zero copy: the tensor keeps the mapping alive.
      auto* ptr = const_cast<std::uint8_t*>(region->data() + offset);
      t = at::from_blob(
          ptr, e.shape, [region](void*) {}, options);
    } else {
      // Misaligned for its dtype: a copy, read from the file rather than the mapping.
      t = at::empty(e.shape, options);
      file->read_exact(t.data_ptr(), e.end - e.begin, offset);
    }
    out.tensors.emplace_back(e.name, std::move(t));
  }
  return out;
}

struct TensorFileReader::Impl {
  std::string path;
  std::unique_ptr<File> file;
  ContainerHeader header;
  std::unordered_map<std::string, std::size_t> index;  // name -> entry
};

TensorFileReader::TensorFileReader(const std::string& path, Env& env)
    : impl_(std::make_unique<Impl>()) {
  impl_->path = path;
  impl_->file = env.open(path, OpenMode::Read);
  Problems throwing;
  impl_->header = read_container_header(*impl_->file, path, throwing);
  for (std::size_t i = 0; i < impl_->header.entries.size(); ++i) {
    impl_->index.emplace(impl_->header.entries[i].name, i);
  }
}

TensorFileReader::~TensorFileReader() = default;
TensorFileReader::TensorFileReader(TensorFileReader&&) noexcept = default;
TensorFileReader& TensorFileReader::operator=(TensorFileReader&&) noexcept = default;

std::vector<std::string> TensorFileReader::names() const {
  std::vector<std::string> out;
  for (std::size_t i : impl_->header.caller_order) out.push_back(impl_->header.entries[i].name);
  return out;
}

bool TensorFileReader::contains(const std::string& name) const {
  return impl_->index.count(name) > 0;
}

const Json& TensorFileReader::state() const { return impl_->header.state; }

at::Tensor TensorFileReader::read(const std::string& name) const {
  auto it = impl_->index.find(name);
  if (it == impl_->index.end()) {
    throw Error(ErrorCode::NotFound, fmt::format("{} has no tensor '{}'", impl_->path, name));
  }
  const TensorEntry& e = impl_->header.entries[it->second];
  at::Tensor t = at::empty(e.shape, at::TensorOptions().dtype(e.dtype.type));
  impl_->file->read_exact(t.data_ptr(), e.end - e.begin, impl_->header.data_start + e.begin);
  std::uint64_t actual = xxh3(t.data_ptr(), e.end - e.begin);
  if (actual != e.checksum) {
    throw Error(ErrorCode::Corruption,
                fmt::format("{}: tensor '{}' fails its checksum (stored {}, computed {}): its "
                            "data is corrupt",
                            impl_->path, name, checksum_hex(e.checksum), checksum_hex(actual)));
  }
  return t;
}

// Implemented here for files; directory checkpoints are checked in directory.cc.
VerifyReport verify_directory(const std::string& path, Env& env);

VerifyReport verify(const std::string& path, Env& env) {
  VerifyReport report{path, {}, {}};
  try {
    FileInfo info = env.stat(path);
    if (!info.exists) {
      report.add(fmt::format("{} does not exist", path), ErrorCode::NotFound);
      return report;
    }
    if (info.is_directory) return verify_directory(path, env);
    std::unique_ptr<File> file = env.open(path, OpenMode::Read);
    Problems collect(&report);
    ContainerHeader header = read_container_header(*file, path, collect);
    if (collect.any()) return report;
    check_data(*file, header, path, collect);
    check_size_unchanged(*file, header, path, "verified", collect);
  } catch (const Error& e) {
    report.add(e.what(), e.code());
  }
  return report;
}

}  // namespace torchpoint
