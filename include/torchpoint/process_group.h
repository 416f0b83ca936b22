// The processes of one training run, as torchrun starts them: who this process is, and the
// collectives (broadcast, allreduce, gather, barrier) that keep them in step. The engine is
// PyTorch's own: c10d's TCPStore for rendezvous and small messages, ProcessGroupGloo for tensors.
// Launching and restarting the processes is torchrun's job:
//
//   torchrun --nproc-per-node 2 --max-restarts 3 --no-python ./train
//
// Every collective and every exchange through the store waits at most timeout(); a process that
// stops answering makes the others throw an Error naming its rank instead of hanging.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "torchpoint/error.h"

namespace torchpoint {

// Who this process is and where the group meets. from_environment() reads torchrun's variables;
// a test or a launcher of its own may fill them in by hand.
struct ProcessGroupOptions {
  TORCH_ARG(int, rank) = 0;                           // RANK
  TORCH_ARG(int, world_size) = 1;                     // WORLD_SIZE
  TORCH_ARG(int, local_rank) = 0;                     // LOCAL_RANK
  TORCH_ARG(int, local_world_size) = 1;               // LOCAL_WORLD_SIZE
  TORCH_ARG(std::string, master_addr) = "127.0.0.1";  // MASTER_ADDR
  TORCH_ARG(int, master_port) = 29500;                // MASTER_PORT
  // TORCHELASTIC_RESTART_COUNT: how many times torchrun restarted the group before this run.
  TORCH_ARG(int, restart_count) = 0;
  // torchrun's agent already serves the store at master_addr:master_port
  // (TORCHELASTIC_USE_AGENT_STORE=True): every rank connects to it as a client. Otherwise rank 0
  // serves it. Either way the ranks of each start agree on a name of their own for their keys
  // (not the restart count, which is each agent's own), so the keys of an earlier start are
  // never seen.
  TORCH_ARG(bool, use_agent_store) = false;
  // The longest any collective or exchange waits for the other processes. A rank slower than this
  // (a long evaluation on the main process between two collectives) must raise it.
  // TORCHPOINT_PROCESS_TIMEOUT (seconds) overrides the default in from_environment().
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(5);

 public:
  // The options torchrun's environment describes, or nullopt when WORLD_SIZE is not set (a
  // program started by hand is one process). Throws InvalidArgument naming a variable that is set
  // but malformed (RANK outside [0, WORLD_SIZE), a port that is not a number, ...).
  static std::optional<ProcessGroupOptions> from_environment();
};

// One process's membership of the group. Thread-compatible: call it from the training thread.
class ProcessGroup {
 public:
  enum class ReduceOp { Sum, Max, Min };

  // Joins the group: connects to (or, for rank 0 without an agent store, serves) the TCPStore,
  // then creates the gloo process group, which waits until every rank has joined (at most
  // timeout()). Throws Error(IOError) naming the address when the store cannot be reached.
  //
  // Example:
  //   auto group = torchpoint::ProcessGroup::create(
  //       torchpoint::ProcessGroupOptions().rank(r).world_size(2).master_port(29512));
  static std::shared_ptr<ProcessGroup> create(const ProcessGroupOptions& options);
  // The group of this process's torchrun environment, created at the first call and shared by
  // every later one (an Accelerator and a Learner of one process use the same group); nullptr when
  // the process was not started as one of several (no WORLD_SIZE, or WORLD_SIZE=1).
  static std::shared_ptr<ProcessGroup> from_environment();

  ~ProcessGroup();
  ProcessGroup(const ProcessGroup&) = delete;
  ProcessGroup& operator=(const ProcessGroup&) = delete;

  int rank() const { return options_.rank(); }
  int size() const { return options_.world_size(); }
  int local_rank() const { return options_.local_rank(); }
  int local_size() const { return options_.local_world_size(); }
  int restart_count() const { return options_.restart_count(); }
  std::chrono::milliseconds timeout() const { return options_.timeout(); }
  // How many collectives (barrier, broadcast, allreduce, allgather; a bucketed call counts one
  // per bucket) this process has entered so far: the same on every rank of a healthy run.
  std::uint64_t collectives() const { return collectives_; }
  // What coordination cost this process so far: the store requests it made (each collective's
  // progress record, and every set, wait and get of the exchanges below), and the seconds it
  // spent in the exchanges' requests, waiting for the other ranks included.
  std::uint64_t store_requests() const { return store_requests_; }
  double store_seconds() const { return store_seconds_; }
  const ProcessGroupOptions& options() const { return options_; }

  // Collectives: every rank calls the same ones in the same order. Each throws
  // Error(IOError) when a rank does not take part within timeout(), naming the ranks that did not
  // reach it; `what` says what the collective was for ("the gradients of backward()").
  void barrier(const std::string& what = "a barrier");
  // Replaces each tensor (dense, contiguous, on the CPU) with root's.
  void broadcast(std::vector<at::Tensor>& tensors, int root = 0,
                 const std::string& what = "a broadcast");
  // In place, over every rank: afterwards each rank holds the same reduced values.
  void allreduce(at::Tensor& tensor, ReduceOp op = ReduceOp::Sum,
                 const std::string& what = "an allreduce");
  // Every rank's `tensor` (same shape and dtype on every rank), in rank order.
  std::vector<at::Tensor> allgather(const at::Tensor& tensor,
                                    const std::string& what = "an allgather");
  // The sum over every rank of `input` (1-D, its length a multiple of size()), of which this
  // rank gets only its part: elements [rank * len / size, (rank + 1) * len / size). The
  // collective ZeRO stage 2 reduces gradients with (c10d's reduce-scatter; on LibTorch 1.13,
  // whose gloo lacks one, an allreduce of which each rank keeps its part).
  at::Tensor reduce_scatter(const at::Tensor& input,
                            const std::string& what = "a reduce-scatter");

  // Many tensors at once, in flat buckets (up to 25 MiB of one dtype, one collective each).
  // Every rank's tensors get root's values (prepare(model): rank 0's parameters).
  void broadcast_tensors(const std::vector<at::Tensor>& tensors, int root, const std::string& what);
  // Each tensor becomes its mean over the ranks, in place (gradients).
  void average_tensors(const std::vector<at::Tensor>& tensors, const std::string& what);

  // Small messages through the store, for agreeing on what to do (paths, file lists, verdicts).
  // Like the collectives, every rank makes the same calls in the same order.
  // Root's `value` to every rank (the others' `value` is ignored).
  std::string broadcast_string(const std::string& value, int root, const std::string& what);
  // Every rank's value, in rank order, on every rank.
  std::vector<std::string> allgather_strings(const std::string& value, const std::string& what);
  // Every rank's value, in rank order, on `root`; the other ranks get an empty vector and do not
  // wait.
  std::vector<std::string> gather_strings(const std::string& value, int root,
                                          const std::string& what);
  // For a step done by the main process on behalf of all (open a checkpoint, commit it, choose
  // one to load): rank 0 runs `fn` and every rank returns its result. When `fn` throws, rank 0
  // rethrows and every other rank throws an Error of the same code saying so. `fn` may make
  // exchanges of its own that the other ranks make before calling this.
  std::string decided_by_main(const std::function<std::string()>& fn, const std::string& what);
  // For a step every rank does its part of (verify a checkpoint before anything changes): each
  // rank says whether its part succeeded (`failure` null). When any failed, every rank throws:
  // its own error, or one naming the ranks that failed and why.
  void agree(const std::exception_ptr& failure, const std::string& what);

  // A second membership of this group for another thread of this process (a background
  // save's): the same ranks, its own connection to the store and keys of its own, so that its
  // exchanges neither wait behind this group's nor mix with them. Only the string exchanges
  // above work on it (its collectives throw Unsupported), and it counts its own requests. Every
  // rank opens its side channels in the same order: the n-th of each rank meet.
  std::unique_ptr<ProcessGroup> side_channel();

  struct Impl;

 private:
  ProcessGroup(ProcessGroupOptions options, std::unique_ptr<Impl> impl);
  // Records that this rank enters collective number `n` (for naming the ranks that never did).
  std::uint64_t enter_collective();
  [[noreturn]] void collective_failed(std::uint64_t n, const std::string& what,
                                      const std::exception& cause);
  std::vector<std::string> wait_for_keys(const std::vector<std::string>& keys,
                                         const std::vector<int>& ranks, const std::string& what);
  // The store key of the next exchange: the same on every rank, as they make the same calls.
  std::string next_key();

  ProcessGroupOptions options_;
  std::unique_ptr<Impl> impl_;
  std::uint64_t collectives_ = 0;
  std::uint64_t side_channels_ = 0;
  std::uint64_t exchanges_ = 0;
  std::uint64_t store_requests_ = 0;
  double store_seconds_ = 0;
  struct StoreTimer;
};

}  // namespace torchpoint
