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
  // Shard `shard` (from 1) of `shards` of its component; 0 and 0 for a component in one file.
  int shard = 0;
  int shards = 0;
};

// Manifests that list shards are format 2.0: a reader of format 1 would take each shard for a
// component of its own, so it must refuse them (it does, naming the version) rather than guess.
inline constexpr int kShardedManifestMajor = 2;
// Manifests of ZeRO-sharded optimizer state (metadata "zero", see format/zero_shards.h) are
// format 3.0: a reader of format 2 would restore the optimizer's own component, which holds no
// per-parameter state, and resume silently without it.
inline constexpr int kZeroManifestMajor = 3;
// Manifests whose ZeRO layouts cut the pieces into chunks ("chunk") are format 4.0: a reader of
// format 3 would not know the chunks' keys and would refuse the shards with a puzzling message.
inline constexpr int kChunkedZeroManifestMajor = 4;
// The newest major version this build reads.
inline constexpr int kNewestManifestMajor = kChunkedZeroManifestMajor;
// Shard numbers have five digits in file names.
inline constexpr int kMaxShards = 99999;

// A file that a save hook wrote into the checkpoint (a config, a tokenizer...): any bytes,
// covered by one checksum of the whole file. Listed under "extra_files" (format 1.1), which
// readers of format 1.0 ignore.
struct ManifestExtraFile {
  std::string name;
  std::uint64_t size = 0;
  std::uint64_t checksum = 0;  // XXH3-64 of the whole file
};

// The index of a sharded component ("model.safetensors.index.json", Hugging Face's layout:
// {"metadata": {"total_size": N}, "weight_map": {tensor: shard file}}), covered by one checksum
// of the whole file. Listed under "shard_indexes" (format 2.0).
struct ManifestShardIndex {
  std::string name;
  std::string component;
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
  std::vector<ManifestShardIndex> shard_indexes;  // one per sharded component
};

// The manifest's bytes: indented JSON whose last key is its own checksum.
std::string serialize_manifest(const Manifest& manifest);

// Parses and checks manifest bytes (checksum, version, structure). Throws through `problems`.
Manifest parse_manifest(std::string_view bytes, const std::string& path, Problems& problems);

// This build's LibTorch version, as recorded in new manifests (torchpoint_version() is public:
// torchpoint/checkpoint_dir.h).
std::string libtorch_version();

}  // namespace torchpoint
