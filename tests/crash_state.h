// The state crash_child saves as checkpoint i: a pure function of i, so the parent can check
// that a surviving checkpoint holds exactly what was saved under its name.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "testing/test_util.h"
#include "torchpoint/checkpoint_dir.h"

namespace torchpoint::testing {

// With TORCHPOINT_CRASH_SHARDED=1 (in the test and, inherited, in the child) the model also
// holds a frozen backbone and is saved sharded and incremental: every save after the first
// hard-links the frozen shards from the previous checkpoint while retention deletes older ones.
inline bool crash_sharded() {
  const char* v = std::getenv("TORCHPOINT_CRASH_SHARDED");
  return v != nullptr && std::string(v) == "1";
}

// The options crash_child saves checkpoint i with; `previous` is checkpoint i-1's path.
inline SaveDirectoryOptions crash_options(const std::string& previous) {
  SaveDirectoryOptions o;
  if (!crash_sharded()) return o;
  o.shard_size = std::uint64_t{2} << 20;
  o.frozen = {"model/frozen_a", "model/frozen_b"};
  o.link_from = previous;
  return o;
}

inline std::vector<Component> crash_state(std::uint64_t i) {
  // Sizes vary with i so that kills land in files of different shapes; one is over 1 MiB so
  // the O_DIRECT path is exercised too.
  std::int64_t rows = 64 + static_cast<std::int64_t>(i % 7) * 32;
  NamedTensors model = {{"w", make_tensor(at::kFloat, {rows, 1024}, i)},
                        {"b", make_tensor(at::kDouble, {rows}, i + 1)}};
  if (crash_sharded()) {
    // Two frozen 2 MiB shards, the same in every checkpoint, and one shard for w and b.
    model.emplace_back("frozen_a", make_tensor(at::kFloat, {512, 1024}, 77));
    model.emplace_back("frozen_b", make_tensor(at::kFloat, {512, 1024}, 78));
  }
  return {
      {"model", {std::move(model), {{"i", i}}}},
      {"optimizer",
       {{{"step", at::scalar_tensor(static_cast<std::int64_t>(i), at::kLong)}}, {{"i", i}}}},
      {"random_states_0", {{{"cpu", make_tensor(at::kByte, {5056}, i + 2)}}, {}}},
  };
}

}  // namespace torchpoint::testing
