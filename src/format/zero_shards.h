// Optimizer state that ZeRO split over the processes, as a directory checkpoint holds it.
//
// The optimizer's own component ("optimizer", "optimizer_1", ...) keeps its type and param
// groups and no per-parameter state. Each process r writes a component of its own,
// "<optimizer>_zero_<r>", with the state of the parameters' elements in its range of the flat
// space (every trainable parameter of every group, in order):
//   zero.rank, zero.world                 who wrote it
//   zero.<g>.<i>.begin, zero.<g>.<i>.numel the piece of parameter i of group g: its elements
//                                         [begin, begin + numel), flattened
//   state.<g>.<i>.<field>                 the optimizer's state of those elements, 1-D
//   state.<g>.<i>.step                    (and any other value of that parameter's state)
// The manifest's metadata holds the global layout under "zero": one entry per sharded
// optimizer (see ZeroLayout), so that a reader knows, before reading any shard, which shards
// hold the elements it needs.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "format/container.h"
#include "torchpoint/checkpoint_dir.h"
#include "torchpoint/state_dict.h"

namespace torchpoint::detail {

// The component of `rank`'s part of the optimizer component `optimizer`.
std::string zero_shard_name(const std::string& optimizer, int rank);

struct ZeroLayout {
  struct Param {
    int group = 0;
    int index = 0;
    std::int64_t offset = 0;  // of its first element in the flat space
    std::vector<std::int64_t> shape;
    std::int64_t numel() const;
  };
  std::string optimizer;  // the optimizer's component name
  int stage = 1;
  int world = 1;
  std::int64_t total = 0;  // elements of the flat space
  std::int64_t part = 0;   // elements per rank: rank r holds [r * part, (r + 1) * part) ∩ [0, total)
  std::vector<Param> params;

  // The ranks whose ranges meet [begin, end).
  std::vector<int> ranks_meeting(std::int64_t begin, std::int64_t end) const;
  Json to_json() const;
  // Throws Corruption naming `where` for a layout that does not add up.
  static ZeroLayout from_json(const Json& json, const std::string& where);
};

// Which tensors of a shard of `layout` a process whose range is [begin, end) of the flat space
// needs (for load_container_part): the state of the pieces that meet that range, and anything
// that is not a piece's state.
TensorFilter zero_shard_filter(const ZeroLayout& layout, std::int64_t begin, std::int64_t end);

// The layouts in a manifest's metadata (none for a checkpoint saved without ZeRO).
std::vector<ZeroLayout> zero_layouts(const Json& metadata, const std::string& where);

// One shard as read: its pieces by (group, index).
struct ZeroShard {
  struct Piece {
    std::int64_t begin = 0;
    std::int64_t numel = 0;
    StateDict state;  // "<field>" tensors of numel elements, and the parameter's values
  };
  std::map<std::pair<int, int>, Piece> pieces;

  // Throws Corruption naming `where` for a shard that is not `rank`'s of `layout`, or a piece
  // outside that rank's range.
  static ZeroShard parse(const StateDict& contents, const ZeroLayout& layout, int rank,
                         const std::string& where);
};

// The state of parameter `param`'s elements [begin, begin + numel), from the shards of
// `layout` (by rank; each must be there when its range meets those elements), keyed as one
// parameter's state: "<field>" 1-D tensors of numel elements, and its values ("step": the
// largest any shard holds). Empty when no shard holds state for the parameter (never stepped).
// Elements of a field that no shard holds (a rank whose piece never had a gradient) are zero,
// as they were in the gathered state of earlier versions. Throws Corruption for a missing
// shard.
StateDict zero_piece_state(const ZeroLayout& layout, const std::map<int, ZeroShard>& shards,
                           const ZeroLayout::Param& param, std::int64_t begin,
                           std::int64_t numel, const std::string& where);

// The optimizer state dict of the whole (unsharded) optimizer: `main` (type and param groups)
// with every parameter's state assembled from the shards, shaped as the parameter.
StateDict zero_consolidate(const ZeroLayout& layout, const StateDict& main,
                           const std::map<int, ZeroShard>& shards, const std::string& where);

// Replaces, in a loaded directory checkpoint, every sharded optimizer's shards by its whole
// state in its own component, as if it had been saved by one process without ZeRO; the
// metadata's "zero" entry goes too. Nothing happens to a checkpoint saved without ZeRO.
void zero_consolidate(DirectoryCheckpoint& checkpoint, const std::string& where);

}  // namespace torchpoint::detail
