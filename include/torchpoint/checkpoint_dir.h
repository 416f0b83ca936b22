// Directory checkpoints: several container files committed together under one manifest.
//
//   <dir>/model.safetensors  optimizer.safetensors  ...  manifest.json
//
// The directory appears whole or not at all: it is built under a temporary name, every file
// and the directory are fsynced, the manifest is written last, and a rename that never
// replaces an existing directory publishes it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <unordered_set>
#include <vector>

#include "torchpoint/env.h"
#include "torchpoint/error.h"
#include "torchpoint/tensor_file.h"

namespace torchpoint {

// One file of a directory checkpoint: `name` becomes `<name>.safetensors`.
struct Component {
  std::string name;
  Container contents;
};

// What the manifest records besides the files.
struct CheckpointInfo {
  std::int64_t step = 0;
  std::int64_t iteration = 0;
  Json metadata = Json::object();  // the caller's, kept as given
};

struct SaveDirectoryOptions {
  // Replace a committed checkpoint at the path, atomically: the old one stays whole until the
  // new one is committed, then it is removed. Without it, an existing checkpoint is an error.
  bool overwrite = false;
  // Called with the directory being written (a temporary sibling of the path, renamed to it on
  // commit) before the components are written. Regular files it writes there become part of the
  // checkpoint: fsynced, listed in the manifest with their size and XXH3 ("extra_files"), and
  // verified on load. A subdirectory, a link or a file named like a component is an error.
  std::function<void(const std::string& dir)> before_components;
  // A component whose tensors hold more than this many bytes is written as shards of at most
  // about this size, in Hugging Face's layout: <name>-00001-of-0000N.safetensors ... and
  // <name>.safetensors.index.json. Each shard is a whole container with its checksums; two files
  // are written at once while two more threads compare shards with link_from. 0: never shard. Loading gives the component whole, as if it were one file.
  std::uint64_t shard_size = kDefaultShardSize;
  // Tensors expected to keep their bytes from save to save (frozen parameters, buffers), as
  // "<component>/<tensor>": a sharded component keeps them in shards of their own, so that
  // those shards come out unchanged and can be shared (see link_from).
  std::unordered_set<std::string> frozen;
  // A committed directory checkpoint (normally the newest one) whose shards this save may
  // share: a shard whose tensors have the same names, dtypes, shapes and XXH3 checksums as
  // that checkpoint's shard of the same name (and the same non-tensor state) is hard-linked
  // from it instead of written again, or written when the file system refuses the link. The
  // bytes are compared every time, so a tensor changed in place is always written. Each
  // checkpoint stays complete: deleting either one leaves the other whole. Empty, missing or
  // unreadable: every shard is written.
  std::string link_from;

  static constexpr std::uint64_t kDefaultShardSize = std::uint64_t{128} << 20;
};

// Writes a directory checkpoint at `path`, which must not exist, or be an empty directory (or,
// with `options.overwrite`, a committed checkpoint); its parent is created if needed. Holds
// `<parent>/.lock` while writing (a concurrent writer gets Locked) and first removes temporaries
// that dead writers left in the parent. On failure nothing new appears at `path`, no temporary
// remains, and every committed checkpoint is untouched.
//
// Example:
//   torchpoint::save_directory("runs/a/checkpoints/checkpoint_0",
//                              {{"model", {model_tensors, {}}}}, {.step = 100});
void save_directory(const std::string& path, const std::vector<Component>& components,
                    const CheckpointInfo& info = {}, Env& env = Env::posix(),
                    const SaveDirectoryOptions& options = {});

// The version of this torchpoint library ("0.1.0"), as every checkpoint it writes records it.
std::string torchpoint_version();

struct DirectoryCheckpoint {
  std::vector<Component> components;  // in the order they were saved
  CheckpointInfo info;
  std::string torchpoint_version;
  std::string libtorch_version;
  std::vector<std::string> extra_files;  // written by before_components, each verified
};

// Loads and verifies every file of a directory checkpoint against its manifest (the extra
// files a save hook wrote included). An optimizer that ZeRO sharded over several processes
// comes whole, as one process without ZeRO would have saved it (its per-process shards are
// read, verified and joined). Throws NotFound (no such directory, or no manifest:
// uncommitted or not a checkpoint), Corruption (naming the file and tensor) or Incompatible
// (newer major format version).
DirectoryCheckpoint load_directory(const std::string& path, Env& env = Env::posix());

// Writes at `output` (which must not exist) a directory checkpoint of the same state as the
// one at `path` with every ZeRO-sharded optimizer whole, one file per component, as one process
// without ZeRO saves: what DeepSpeed's zero_to_fp32.py does, with the checksums kept. Every
// file of `path` is verified first; the files its save hooks wrote are copied. Committed as
// save_directory() commits. Returns the number of per-process shards joined (0: `path` held
// none, and `output` is a verified copy of it).
std::size_t consolidate_directory(const std::string& path, const std::string& output,
                                  Env& env = Env::posix());

}  // namespace torchpoint
