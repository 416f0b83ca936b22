// The cheap questions about a directory of checkpoint_<N> checkpoints, answered without reading
// checkpoint data: which are committed, in which order, and the newest that verifies.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "torchpoint/env.h"
#include "torchpoint/error.h"

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

// What a load that chose `path` itself says when it cannot load it (`problem`, of `code`) and
// nothing proves it corrupt: an error naming it, never a quiet fall-back to an older one.
Error not_passed_over(const std::string& path, const std::string& problem, ErrorCode code);
// The line on stderr for a checkpoint passed over as corrupt; `why` is "PATH: problem".
void warn_passed_over(const std::string& why);

// mkdir -p, then the parent's directory entry synced.
void ensure_directory(Env& env, const std::string& dir);

}  // namespace torchpoint::detail
