#include "format/manifest.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <set>

#include "compat/torch_compat.h"
#include "format/checksum.h"
#include "format/json_depth.h"
#include "format/ordered_json.h"
#include "io/filename.h"
#include "torchpoint/error.h"

#ifndef TORCHPOINT_VERSION
#define TORCHPOINT_VERSION "0.0.0"
#endif

namespace torchpoint {
namespace {

using ojson = nlohmann::ordered_json;

// The JSON integer at `key`. nlohmann's get<std::int64_t>() would also take a float, with
// undefined behaviour when it does not fit; here anything but a fitting integer throws.
std::int64_t int64_at(const ojson& object, const char* key) {
  const ojson& v = object.at(key);
  if (!v.is_number_integer() ||
      (v.is_number_unsigned() &&
       v.get<std::uint64_t>() >
           static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))) {
    throw std::runtime_error(fmt::format("\"{}\" is not a signed 64-bit integer", key));
  }
  return v.get<std::int64_t>();
}

std::uint64_t uint64_at(const ojson& object, const char* key) {
  const ojson& v = object.at(key);
  if (!v.is_number_unsigned()) {
    throw std::runtime_error(fmt::format("\"{}\" is not an unsigned 64-bit integer", key));
  }
  return v.get<std::uint64_t>();
}

// Every sharded component has shards 1..n exactly once, all saying n, and no component is
// both sharded and in one file.
void check_shards_complete(const std::vector<ManifestFile>& files) {
  std::map<std::string, std::vector<const ManifestFile*>> by_component;
  for (const ManifestFile& f : files) by_component[f.component].push_back(&f);
  for (const auto& [component, parts] : by_component) {
    bool sharded = parts.front()->shards > 0;
    std::set<int> seen;
    for (const ManifestFile* f : parts) {
      bool ok = sharded ? f->shards == parts.front()->shards && seen.insert(f->shard).second
                        : parts.size() == 1;
      if (!ok) {
        throw std::runtime_error(
            fmt::format("component '{}' is listed more than once, or its shards disagree",
                        component));
      }
    }
    if (sharded && static_cast<int>(seen.size()) != parts.front()->shards) {
      throw std::runtime_error(fmt::format("component '{}' lists {} of its {} shards", component,
                                           seen.size(), parts.front()->shards));
    }
  }
}

std::string tail_prefix() { return fmt::format(",\n  \"{}\": \"", kManifestChecksumKey); }
constexpr std::string_view kTailSuffix = "\"\n}\n";

}  // namespace

std::string torchpoint_version() { return TORCHPOINT_VERSION; }
std::string libtorch_version() { return compat::torch_version(); }

std::string serialize_manifest(const Manifest& m) {
  ojson files = ojson::object();
  for (const ManifestFile& f : m.files) {
    files[f.name] = {{"component", f.component},
                     {"size", f.size},
                     {"header_xxh3", checksum_hex(f.header_checksum)}};
    if (f.shards > 0) files[f.name]["shard"] = {f.shard, f.shards};
  }
  ojson body = {
      {"format", kManifestFormatName},
      {"format_version", fmt::format("{}.{}", m.version_major, m.version_minor)},
      {"torchpoint_version", m.torchpoint_version},
      {"libtorch_version", m.libtorch_version},
      {"created_unix_ms", m.created_unix_ms},
      {"step", m.info.step},
      {"iteration", m.info.iteration},
      {"metadata", m.info.metadata},
      {"files", std::move(files)},
  };
  if (!m.extra_files.empty()) {
    ojson extras = ojson::object();
    for (const ManifestExtraFile& f : m.extra_files) {
      append_new_key(extras, f.name, {{"size", f.size}, {"xxh3", checksum_hex(f.checksum)}});
    }
    body["extra_files"] = std::move(extras);
  }
  if (!m.shard_indexes.empty()) {
    ojson indexes = ojson::object();
    for (const ManifestShardIndex& f : m.shard_indexes) {
      append_new_key(indexes, f.name,
                     {{"component", f.component},
                      {"size", f.size},
                      {"xxh3", checksum_hex(f.checksum)}});
    }
    body["shard_indexes"] = std::move(indexes);
  }
  std::string text;
  try {
    text = body.dump(2);  // ends with "\n}"
  } catch (const nlohmann::json::exception& e) {
    throw Error(
        ErrorCode::InvalidArgument,
        fmt::format("the checkpoint metadata cannot be written: {}; use UTF-8 strings", e.what()));
  }
  text.resize(text.size() - 2);
  text += tail_prefix();
  std::size_t digits_at = text.size();
  text += std::string(kChecksumHexLength, '0');
  text += kTailSuffix;
  std::string hex = checksum_hex(xxh3(text.data(), text.size()));
  text.replace(digits_at, kChecksumHexLength, hex);
  return text;
}

Manifest parse_manifest(std::string_view bytes, const std::string& path, Problems& problems) {
  Manifest m;
  std::string prefix = tail_prefix();
  std::size_t tail = prefix.size() + kChecksumHexLength + kTailSuffix.size();
  if (bytes.size() < tail || bytes.substr(bytes.size() - tail, prefix.size()) != prefix ||
      bytes.substr(bytes.size() - kTailSuffix.size()) != kTailSuffix) {
    problems.add(
        fmt::format("{}: the manifest does not end with its checksum: it is truncated "
                    "or damaged",
                    path));
    return m;
  }
  std::size_t digits_at = bytes.size() - kTailSuffix.size() - kChecksumHexLength;
  auto claimed = parse_checksum_hex(bytes.substr(digits_at, kChecksumHexLength));
  std::string copy(bytes);
  std::memset(copy.data() + digits_at, '0', kChecksumHexLength);
  std::uint64_t actual = xxh3(copy.data(), copy.size());
  if (!claimed || *claimed != actual) {
    problems.add(
        fmt::format("{}: manifest checksum mismatch (stored {}, computed {}): the "
                    "manifest is corrupt",
                    path, bytes.substr(digits_at, kChecksumHexLength), checksum_hex(actual)));
    if (!problems.collecting()) return m;
  }
  if (!json_depth_within(bytes)) {
    problems.add(fmt::format("{}: the manifest nests deeper than {} levels", path, kMaxJsonDepth));
    return m;
  }
  ojson root;
  try {
    root = parse_ordered_json(bytes);
  } catch (const ojson::parse_error& e) {
    // The position only: the parser's message quotes the file's bytes (see container_reader).
    problems.add(
        fmt::format("{}: the manifest is not valid JSON (syntax error at byte {})", path, e.byte));
    return m;
  } catch (const ojson::exception& e) {
    problems.add(fmt::format("{}: the manifest is not valid JSON (error {})", path, e.id));
    return m;
  }
  auto bad = [&](const std::string& why) { problems.add(fmt::format("{}: {}", path, why)); };
  if (!root.is_object() || string_field(root, "format") != kManifestFormatName) {
    bad("not a torchpoint manifest (no \"format\": \"torchpoint-checkpoint\")");
    return m;
  }
  std::string version = string_field(root, "format_version");
  if (std::sscanf(version.c_str(), "%d.%d", &m.version_major, &m.version_minor) != 2 ||
      m.version_major < 1) {
    bad(fmt::format("invalid format_version '{}'", version));
    return m;
  }
  if (m.version_major > kNewestManifestMajor) {
    problems.add(fmt::format("{} is in torchpoint format version {}, but this build reads "
                             "versions up to {}.{}: upgrade torchpoint to load it",
                             path, version, kNewestManifestMajor, 0),
                 ErrorCode::Incompatible);
    return m;
  }
  try {
    m.torchpoint_version = root.value("torchpoint_version", "");
    m.libtorch_version = root.value("libtorch_version", "");
    m.created_unix_ms = root.contains("created_unix_ms") ? int64_at(root, "created_unix_ms") : 0;
    m.info.step = int64_at(root, "step");
    m.info.iteration = int64_at(root, "iteration");
    m.info.metadata = root.value("metadata", ojson::object());
    const ojson& files = root.at("files");
    if (!files.is_object()) throw std::runtime_error("\"files\" is not an object");
    for (const auto& [name, f] : files.items()) {
      ManifestFile file;
      file.name = name;
      file.component = f.at("component").get<std::string>();
      file.size = uint64_at(f, "size");
      auto sum = parse_checksum_hex(f.at("header_xxh3").get<std::string>());
      if (!sum) throw std::runtime_error(fmt::format("malformed header_xxh3 of {}", name));
      file.header_checksum = *sum;
      if (auto shard = f.find("shard"); shard != f.end()) {
        if (m.version_major < kShardedManifestMajor || !shard->is_array() || shard->size() != 2 ||
            !(*shard)[0].is_number_integer() || !(*shard)[1].is_number_integer()) {
          throw std::runtime_error(fmt::format("malformed \"shard\" of {}", name));
        }
        file.shard = (*shard)[0].get<int>();
        file.shards = (*shard)[1].get<int>();
        if (file.shards < 1 || file.shards > kMaxShards || file.shard < 1 ||
            file.shard > file.shards) {
          throw std::runtime_error(fmt::format("{} claims to be shard {} of {}", name,
                                               file.shard, file.shards));
        }
      }
      std::string expected = file.shards > 0
                                 ? shard_file_name(file.component, file.shard, file.shards)
                                 : component_file_name(file.component);
      if (name.find('/') != std::string::npos || name == "." || name == ".." || name != expected) {
        throw std::runtime_error(fmt::format("file name '{}' does not match its component", name));
      }
      m.files.push_back(std::move(file));
    }
    check_shards_complete(m.files);
    if (auto indexes = root.find("shard_indexes"); indexes != root.end()) {
      if (!indexes->is_object()) throw std::runtime_error("\"shard_indexes\" is not an object");
      for (const auto& [name, f] : indexes->items()) {
        ManifestShardIndex index;
        index.name = name;
        index.component = f.at("component").get<std::string>();
        index.size = uint64_at(f, "size");
        auto sum = parse_checksum_hex(f.at("xxh3").get<std::string>());
        if (!sum) throw std::runtime_error(fmt::format("malformed xxh3 of {}", name));
        index.checksum = *sum;
        if (name != shard_index_file_name(index.component)) {
          throw std::runtime_error(fmt::format("index name '{}' does not match its component", name));
        }
        m.shard_indexes.push_back(std::move(index));
      }
    }
    for (const ManifestFile& f : m.files) {
      if (f.shard != 1) continue;
      int found = 0;
      for (const ManifestShardIndex& index : m.shard_indexes) found += index.component == f.component;
      if (found != 1) {
        throw std::runtime_error(
            fmt::format("sharded component '{}' has {} indexes, not one", f.component, found));
      }
    }
    for (const ManifestShardIndex& index : m.shard_indexes) {
      if (std::none_of(m.files.begin(), m.files.end(), [&](const ManifestFile& f) {
            return f.shard == 1 && f.component == index.component;
          })) {
        throw std::runtime_error(
            fmt::format("index {} is of no sharded component", index.name));
      }
    }
    if (auto extras = root.find("extra_files"); extras != root.end()) {
      if (!extras->is_object()) throw std::runtime_error("\"extra_files\" is not an object");
      for (const auto& [name, f] : extras->items()) {
        ManifestExtraFile file;
        file.name = name;
        file.size = uint64_at(f, "size");
        auto sum = parse_checksum_hex(f.at("xxh3").get<std::string>());
        if (!sum) throw std::runtime_error(fmt::format("malformed xxh3 of {}", name));
        file.checksum = *sum;
        if (name.empty() || name.find('/') != std::string::npos || name == "." || name == ".." ||
            name == kManifestFileName || files.contains(name) ||
            std::any_of(m.shard_indexes.begin(), m.shard_indexes.end(),
                        [&file](const ManifestShardIndex& i) { return i.name == file.name; })) {
          throw std::runtime_error(fmt::format("extra file name '{}' is not usable", name));
        }
        m.extra_files.push_back(std::move(file));
      }
    }
  } catch (const std::exception& e) {
    bad(fmt::format("malformed manifest: {}", e.what()));
  }
  return m;
}

}  // namespace torchpoint
