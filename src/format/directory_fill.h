// Loading a directory checkpoint with some components read straight into tensors that already
// exist (a model's parameters and buffers), verified with the rest before any of them changes.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "format/container.h"
#include "torchpoint/checkpoint_dir.h"

namespace torchpoint {

struct DirectoryFill {
  // The components not filled in place, as load_directory() returns them.
  DirectoryCheckpoint checkpoint;
  // The components filled in place, in the manifest's order: verified, not yet copied.
  std::vector<std::string> filled;
  std::vector<FileFill> files;
  // The bytes of the files read and verified (every component not skipped; of a component read
  // in part, its header and the tensors read).
  std::uint64_t bytes_read = 0;

  // Copies every filled component's files into its tensors. Call once, when nothing else can
  // fail: its errors (see FileFill::copy) say that the tensors may hold part of the files.
  void copy();
};

// load_directory() of `path`, except that each component named in `fill` whose files hold
// exactly those tensors (names, dtypes and shapes) and no other values is only verified, to be
// copied in by DirectoryFill::copy(). A component that does not fit is loaded as usual, so that
// whoever restores it reports what differs. A component for which `skip` (given the manifest's
// record) says true is neither read nor verified: another process reads it. For a component
// in one file for which `part` gives a filter, only the tensors it keeps are read and verified
// (with the file's header, and its size against the manifest); the others are left out. ZeRO
// shards stay shards (see format/zero_shards.h). Every check and error is load_directory()'s.
DirectoryFill load_directory_filling(
    const std::string& path, Env& env, const std::map<std::string, NamedTensors>& fill,
    const std::function<bool(const std::string&, const CheckpointInfo&)>& skip = nullptr,
    const std::function<TensorFilter(const std::string&, const CheckpointInfo&)>& part = nullptr);

}  // namespace torchpoint
