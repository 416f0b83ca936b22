// The state crash_child saves as checkpoint i: a pure function of i, so the parent can check
// that a surviving checkpoint holds exactly what was saved under its name.
#pragma once

#include <cstdint>
#include <vector>

#include "testing/test_util.h"
#include "torchpoint/checkpoint_dir.h"

namespace torchpoint::testing {

inline std::vector<Component> crash_state(std::uint64_t i) {
  // Sizes vary with i so that kills land in files of different shapes; one is over 1 MiB so
  // the O_DIRECT path is exercised too.
  std::int64_t rows = 64 + static_cast<std::int64_t>(i % 7) * 32;
  return {
      {"model",
       {{{"w", make_tensor(at::kFloat, {rows, 1024}, i)},
         {"b", make_tensor(at::kDouble, {rows}, i + 1)}},
        {{"i", i}}}},
      {"optimizer",
       {{{"step", at::scalar_tensor(static_cast<std::int64_t>(i), at::kLong)}}, {{"i", i}}}},
      {"random_states_0", {{{"cpu", make_tensor(at::kByte, {5056}, i + 2)}}, {}}},
  };
}

}  // namespace torchpoint::testing
