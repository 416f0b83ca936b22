// What a container file's header says about it, read without its tensor data: torchpoint's
// metadata, and the step and metrics a checkpoint file records. For listings of many files.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "torchpoint/state_dict.h"

namespace torchpoint::detail {

// The torchpoint metadata of a container file, parsed from its header; an empty object when
// the header cannot be read or holds none.
Json file_metadata(const std::string& path);

// The step a file checkpoint records: the JSON value "step" at its top level or
// "counters.step" (TrainingCounters under "counters"). nullopt when it has none or the header
// cannot be read.
std::optional<std::int64_t> file_checkpoint_step(const std::string& path);

// The "learner.metrics" of a learner checkpoint file (the epoch's values by monitor name).
std::optional<Json> file_checkpoint_metrics(const std::string& path);

}  // namespace torchpoint::detail
