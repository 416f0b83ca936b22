// Optimizer state that ZeRO split over the processes, as a directory checkpoint holds it.
//
// The optimizer's own component ("optimizer", "optimizer_1", ...) keeps its type and param
// groups and no per-parameter state. Each process r writes a component of its own,
// "<optimizer>_zero_<r>", with the state of the parameters' elements in its range of the flat
// space (every trainable parameter of every group, in order):
//   zero.rank, zero.world                 who wrote it
//   zero.<g>.<i>.begin, zero.<g>.<i>.numel the piece of parameter i of group g: its elements
//                                         [begin, begin + numel), flattened
//   state.<g>.<i>.<field>.<k>             chunk k of the optimizer's state of those elements:
//                                         the piece's elements [k * C, min((k + 1) * C, numel)),
//                                         1-D, with C the layout's chunk (format 4.0)
//   state.<g>.<i>.<field>                 the whole piece's state, 1-D, when the layout has no
//                                         chunk (format 3.0, as written before chunks)
//   state.<g>.<i>.step                    (and any other value of that parameter's state)
// The manifest's metadata holds the global layout under "zero": one entry per sharded
// optimizer (see ZeroLayout), so that a reader knows, before reading any shard, which shards
// hold the elements it needs. Each chunk is a tensor with its own checksum, so a process whose
// range begins or ends inside a piece reads and verifies only the chunks that meet its range.
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

// The elements per chunk of the pieces a save writes (4 MiB of float state), unless
// TORCHPOINT_ZERO_CHUNK_ELEMENTS says otherwise (a positive count; a tuning and testing knob).
inline constexpr std::int64_t kZeroChunkElements = std::int64_t{1} << 20;
std::int64_t zero_chunk_elements();

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
  std::int64_t chunk = 0;  // elements per chunk of a piece's state; 0: each piece whole (3.0)
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
  // Elements [begin, begin + numel) of the parameter whose state was read: the whole piece, or
  // one chunk of it. `state` holds "<field>" tensors of numel elements and the piece's values
  // ("step"), in the order the piece lists its fields.
  struct Run {
    std::int64_t begin = 0;
    std::int64_t numel = 0;
    StateDict state;
  };
  struct Piece {
    std::int64_t begin = 0;  // of the parameter's elements, as the shard declares the piece
    std::int64_t numel = 0;
    // What was read of it, in element order: its chunks that a filter kept, or the whole piece
    // (also when it holds values but no tensor, or when no tensor of it was read).
    std::vector<Run> runs;
  };
  std::map<std::pair<int, int>, Piece> pieces;

  // Throws Corruption naming `where` for a shard that is not `rank`'s of `layout`, a piece
  // outside that rank's range, or a chunk or tensor that does not fit its piece.
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
