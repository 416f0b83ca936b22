// ZeRO stages 1 and 2 over a ProcessGroup: an optimizer whose state each process keeps for
// about 1/N of the parameters' elements only.
//
// The parameters of the user's optimizer (every group, in order, flattened) form one flat
// space of E elements, split by bytes into N contiguous ranges of ceil(E/N) elements, the last
// ones shorter: rank r owns [r * part, (r + 1) * part). The range may begin and end inside a
// tensor. The pieces of the parameters inside it are 1-D views of their memory, and a second
// optimizer of the user's type and options (its "local" optimizer) steps only those: for an
// element-wise optimizer (SGD, Adam, AdamW) an element's update is the same arithmetic as in
// the unsharded optimizer. After the step every rank's updated range is gathered to every
// process, so every process holds the whole model again.
//
// Stage 1 keeps the whole averaged gradient on every process (backward() averages it as
// without sharding); each piece's gradient is a view of it. Stage 2 reduce-scatters the
// gradients instead: each process keeps the average of its own range only, and the whole
// gradients are freed.
#pragma once

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "format/zero_shards.h"
#include "torchpoint/process_group.h"
#include "torchpoint/state_dict.h"

namespace torchpoint::detail {

class ZeroOptimizer {
 public:
  // `optimizer` is the user's: its param groups are the logical layout and it keeps the
  // learning rates a scheduler sets (copied into the local optimizer at every step); it is never
  // stepped itself. `group` may be null (one process: the one range is everything). Throws
  // Unsupported for an optimizer other than SGD, Adam and AdamW, or parameters of several
  // dtypes; InvalidArgument for a stage other than 1 or 2.
  ZeroOptimizer(torch::optim::Optimizer& optimizer, ProcessGroup* group, int stage);

  int stage() const { return stage_; }
  torch::optim::Optimizer& user() const { return *user_; }
  // The optimizer over this process's pieces (what a GradScaler unscales and checks).
  torch::optim::Optimizer& local() const { return *local_; }

  // After a synchronizing backward(): stage 1 points the pieces' gradients into the whole
  // (already averaged) gradients; stage 2 averages the gradients over the processes with a
  // reduce-scatter, keeps this process's range and frees the whole gradients. A parameter
  // without a gradient contributes zeros and its piece gets none when no rank had one.
  void reduce_gradients();
  // Whether `local_inf` is true on any rank (a collective at stage 2, where each process
  // checked only its part; at stage 1 every process checked the same whole gradients).
  bool found_inf_anywhere(bool local_inf);
  // The total norm of the gradients over every process's part (a collective), and each part
  // multiplied by max_norm / (norm + 1e-6) when that is below 1, as clip_grad_norm_ does.
  double clip_grad_norm(double max_norm, double norm_type);
  // Steps this process's pieces with the user's current options (a scheduler's learning
  // rates), then gathers every rank's updated range into every process's parameters.
  void step();

  // Checkpoints hold the unsharded (logical) state, so that any number of processes at any
  // stage can load them: gather_into_user() (a collective) gives the user's optimizer the
  // whole state of every rank's pieces, as if it had stepped itself; take_from_user() makes this
  // process's pieces' state the matching parts of the user's optimizer's state (after a load)
  // and clears that; clear_user_state() drops the gathered state after a save.
  void gather_into_user();
  void take_from_user();
  void clear_user_state();

  // Checkpoints written by every process (see format/zero_shards.h): the layout of this
  // partition, with `name` the optimizer's component; this process's shard (its pieces' state,
  // views of the live state: write it before the next step).
  ZeroLayout layout(const std::string& name) const;
  StateDict shard_state() const;
  // The state of this process's pieces assembled from the shards of a checkpoint saved with
  // `saved` (any number of processes): an optimizer state dict of the local optimizer, to give
  // set_local_state() once everything else of a load has been checked (which takes its tensors,
  // each new memory of its own, as the local optimizer's state, with no copy). Throws
  // Incompatible when `saved` partitions other parameters, Corruption for a missing or wrong
  // shard.
  StateDict local_state_from(const ZeroLayout& saved, const std::map<int, ZeroShard>& shards,
                             const std::string& where) const;
  void set_local_state(const StateDict& state);
  int rank() const { return rank_; }

  // This process's state of its pieces: per field, the elements [begin, begin + n) of the
  // unsharded state tensor, keyed as optimizer_state_dict() keys them (state.<g>.<i>.<field>).
  struct Piece {
    int group = 0;
    int index = 0;             // the parameter's position in its group
    std::int64_t offset = 0;   // of the parameter in the flat space
    std::int64_t begin = 0;    // first element of the parameter inside this rank's range
    std::int64_t numel = 0;    // elements inside the range
    at::Tensor param;          // the parameter
    at::Tensor view;           // param's elements [begin, begin + numel), 1-D
  };
  const std::vector<Piece>& pieces() const { return pieces_; }
  // The range of `rank`: [begin, end) of the flat space.
  std::pair<std::int64_t, std::int64_t> range_of(int rank) const;
  // The bytes of optimizer state this process holds (every state tensor of its pieces).
  std::int64_t state_bytes() const;

 private:
  torch::optim::Optimizer* user_;
  ProcessGroup* group_;
  int stage_;
  std::int64_t chunk_;  // elements per chunk of a piece's state in a shard
  int world_ = 1;
  int rank_ = 0;
  std::int64_t total_ = 0;  // elements of the flat space
  std::int64_t part_ = 0;   // elements per rank (the last ranks may hold fewer)
  std::vector<Piece> pieces_;
  std::vector<at::Tensor> params_;  // every trainable parameter, in flat order
  std::vector<int> local_groups_;   // the user's group of each local group
  std::unique_ptr<torch::optim::Optimizer> local_;
  at::Tensor reduced_;  // stage 2: this rank's averaged gradients, part_ elements
};

}  // namespace torchpoint::detail
