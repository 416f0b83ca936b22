// Directory checkpoints: several container files committed together under one manifest.
//
//   <dir>/model.safetensors  optimizer.safetensors  ...  manifest.json
//
// The directory appears whole or not at all: it is built under a temporary name, every file
// and the directory are fsynced, the manifest is written last, and a rename that never
// replaces an existing directory publishes it.
#pragma once

#include <cstdint>
#include <string>
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

// Writes a new directory checkpoint at `path`, which must not exist; its parent is created if
// needed. Holds `<parent>/.lock` while writing (a concurrent writer gets Locked) and first
// removes temporaries that dead writers left in the parent. On failure nothing appears at
// `path`, no temporary remains, and every other checkpoint is untouched.
//
// Example:
//   torchpoint::save_directory("runs/a/checkpoints/checkpoint_0",
//                              {{"model", {model_tensors, {}}}}, {.step = 100});
void save_directory(const std::string& path, const std::vector<Component>& components,
                    const CheckpointInfo& info = {}, Env& env = Env::posix());

struct DirectoryCheckpoint {
  std::vector<Component> components;  // in the order they were saved
  CheckpointInfo info;
  std::string torchpoint_version;
  std::string libtorch_version;
};

// Loads and verifies every file of a directory checkpoint against its manifest. Throws
// NotFound (no such directory, or no manifest: uncommitted or not a checkpoint), Corruption
// (naming the file and tensor) or Incompatible (newer major format version).
DirectoryCheckpoint load_directory(const std::string& path, Env& env = Env::posix());

}  // namespace torchpoint
