// The cheap questions about a directory of checkpoint_<N> checkpoints, answered without reading
// checkpoint data: which are committed, in which order, and the newest that verifies.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "torchpoint/env.h"

namespace torchpoint::detail {

// The committed checkpoint_<N> directories of `dir` (those with a manifest.json: it is the
// last file a save writes), by number, never lexically; empty when `dir` does not exist. With
// `any_name`, every committed directory whose name has a checkpoint_number().
std::vector<std::pair<std::uint64_t, std::string>> committed_checkpoints(const std::string& dir,
                                                                         Env& env,
                                                                         bool any_name = false);

// One past the largest checkpoint_number() of a name in `dir`, committed or not (0 when there
// is none).
std::uint64_t next_checkpoint_number(const std::string& dir, Env& env);

// The newest of `oldest_first` that verify() passes. One proven corrupt by its own checksums
// is passed over, with a line on stderr and its reason appended to `skipped`; one that cannot
// be judged (unreadable, written by a newer torchpoint) throws, naming it.
std::optional<std::string> newest_valid(
    const std::vector<std::pair<std::uint64_t, std::string>>& oldest_first, Env& env,
    std::vector<std::string>* skipped = nullptr);

// mkdir -p, then the parent's directory entry synced.
void ensure_directory(Env& env, const std::string& dir);

}  // namespace torchpoint::detail
