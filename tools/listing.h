// The checkpoints in a directory, as `ls` shows them and `prune` decides about them.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "torchpoint/tensor_file.h"

namespace torchpoint::tool {

enum class Status {
  Valid,        // committed, and verify() finds no problem
  Corrupt,      // committed, but verify() reports problems
  Uncommitted,  // a temporary name (a save in progress or one that died), or no manifest.json
};

const char* status_name(Status status);

struct ListedCheckpoint {
  std::string name;  // entry name in the directory
  std::string path;
  bool is_directory = false;
  // checkpoint_<N> for a directory (also for its temporaries); for a file checkpoint, the
  // first decimal number in its name (epoch-03-loss-1.2.ckpt -> 3). None otherwise.
  std::optional<std::uint64_t> number;
  Status status = Status::Uncommitted;
  std::vector<std::string> problems;  // why it is corrupt
  // The manifest's "step"; for a valid file checkpoint, file_checkpoint_step().
  std::optional<std::int64_t> step;
  Json metadata;                      // manifest "metadata"; null when unknown
  std::uint64_t size_bytes = 0;       // all files in it (a directory is not descended into)
  std::int64_t modified_unix_ms = 0;  // of manifest.json (the commit), else of the entry
  bool latest = false;                // what loading "the latest" picks
};

struct Listing {
  std::string dir;  // where the checkpoints are
  std::vector<ListedCheckpoint> entries;
};

// Finds the checkpoints in `dir`, or in `dir`/checkpoints when that exists (a project
// directory): directories named checkpoint_<N> and other directories holding a manifest.json,
// files ending in .ckpt or .safetensors, and temporaries of either. Other entries are ignored.
// Every committed checkpoint is verified (all checksums). An entry that disappears while it is
// being verified (retention or `prune` renaming it away) is left out, never called corrupt. Ordered
// by number, numerically (checkpoint_9 before checkpoint_10), entries without a number first by
// name; the latest is the last valid one in that order. Throws NotFound for a missing `dir`,
// InvalidArgument when `dir` is a file or itself a checkpoint.
Listing list_checkpoints(const std::string& dir, Env& env = Env::posix());

// "metadata.metrics.<metric>" of a listed checkpoint, when it is a number.
std::optional<double> manifest_metric(const ListedCheckpoint& entry, const std::string& metric);

}  // namespace torchpoint::tool
