// manifest.json: the last file written into a directory checkpoint, and its commit record.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "format/container.h"
#include "torchpoint/checkpoint_dir.h"

namespace torchpoint {

inline constexpr std::string_view kManifestFormatName = "torchpoint-checkpoint";
inline constexpr std::string_view kManifestChecksumKey = "manifest_xxh3";
// Manifests are small; a larger one is hostile or damaged.
inline constexpr std::uint64_t kMaxManifestSize = 64u << 20;

struct ManifestFile {
  std::string name;  // file name inside the checkpoint directory
  std::string component;
  std::uint64_t size = 0;
  std::uint64_t header_checksum = 0;  // covers the per-tensor checksums, so the whole file
};

// A file that a save hook wrote into the checkpoint (a config, a tokenizer...): any bytes,
// covered by one checksum of the whole file. Listed under "extra_files" (format 1.1), which
// readers of format 1.0 ignore.
struct ManifestExtraFile {
  std::string name;
  std::uint64_t size = 0;
  std::uint64_t checksum = 0;  // XXH3-64 of the whole file
};

struct Manifest {
  int version_major = kFormatMajor;
  int version_minor = kFormatMinor;
  std::string torchpoint_version;
  std::string libtorch_version;
  std::int64_t created_unix_ms = 0;
  CheckpointInfo info;
  std::vector<ManifestFile> files;  // in the order the components were saved
  std::vector<ManifestExtraFile> extra_files;
};

// The manifest's bytes: indented JSON whose last key is its own checksum.
std::string serialize_manifest(const Manifest& manifest);

// Parses and checks manifest bytes (checksum, version, structure). Throws through `problems`.
Manifest parse_manifest(std::string_view bytes, const std::string& path, Problems& problems);

// This build's versions, as recorded in new manifests.
std::string torchpoint_version();
std::string libtorch_version();

}  // namespace torchpoint
