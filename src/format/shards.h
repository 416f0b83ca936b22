// Sharded components: how a large component is split into shard files, how a save shares the
// shards that did not change with an older checkpoint (hard links), and how the shards are
// read back as one component through their index (docs/format.md, "Sharded components").
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "format/container.h"
#include "format/manifest.h"
#include "torchpoint/checkpoint_dir.h"

namespace torchpoint {

// The shards of `component`, each a list of indexes into its tensors: none when the component
// fits in one file (its tensors hold at most `shard_size` bytes, or shard_size is 0). Tensors
// named in `frozen` ("<component>/<tensor>") fill shards of their own, first; the others
// follow. Within each kind tensors keep their order, and a shard closes before the tensor that
// would take it over `shard_size` (a larger tensor gets a shard to itself). The same names,
// shapes and frozen set always give the same plan, which is what lets shards be shared.
std::vector<std::vector<std::size_t>> plan_shards(const Component& component,
                                                  std::uint64_t shard_size,
                                                  const std::unordered_set<std::string>& frozen);

// The shards of a committed checkpoint that a new save may hard-link instead of writing.
class LinkSource {
 public:
  // The committed checkpoint at `path`, whose manifest is read on the first find() (a save
  // that shards nothing never reads it). An empty path, or a checkpoint whose manifest cannot
  // be read, gives a source that offers nothing (the save writes all).
  LinkSource(Env& env, const std::string& path);

  // The path of this checkpoint's file `file_name` when it is a shard holding exactly
  // `contents`: the same tensor names in the same order, dtypes, shapes and XXH3 checksums of
  // the bytes in memory now, and the same non-tensor state; its size and header as the manifest
  // lists them, and not modified since the commit. Also its manifest entry. Hashes the tensors
  // in order and stops at the first that differs. Never throws: any doubt is a nullopt.
  // Thread-safe: the shards of one component are compared on several threads.
  std::optional<std::pair<std::string, ManifestFile>> find(const std::string& file_name,
                                                           const Container& contents) const;

 private:
  void read_manifest() const;

  Env& env_;
  std::string path_;
  mutable std::once_flag read_;
  mutable std::int64_t committed_ns_ = 0;  // the manifest's modification time
  mutable std::unordered_map<std::string, ManifestFile> shards_;
};

// The (tensor, shard file) pairs of a sharded component's index file, in its order.
using WeightMap = std::vector<std::pair<std::string, std::string>>;

// Builds the index file's text: {"metadata": {"total_size": bytes}, "weight_map": {...}}.
std::string shard_index_text(const WeightMap& weight_map, std::uint64_t total_size);

// Parses the weight map of an index file's `text` (already checked against the manifest's size
// and XXH3). Throws Corruption naming `index_path` and what is wrong.
WeightMap parse_shard_index(const std::string& text, const std::string& index_path);

// Checks that `weight_map` names every tensor of every shard (`shard_tensors`: shard file ->
// tensor names) exactly once, with the shard that holds it, and nothing else. Reports through
// `problems`, naming `index_path`.
void check_weight_map(const WeightMap& weight_map,
                      const std::map<std::string, std::vector<std::string>>& shard_tensors,
                      const std::string& index_path, Problems& problems);

}  // namespace torchpoint
