// Whole Python values in torch.save files, both ways: what Python Accelerate's save_state
// writes besides the model (optimizer.bin, scheduler.bin, random_states_<r>.pkl,
// custom_checkpoint_<i>.pkl) and what its load_state reads back.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "python/torch_pickle.h"
#include "torchpoint/env.h"

namespace torchpoint::detail {

// The value a torch.save file (the zip format) holds, its tensors on the CPU. The file is read
// as load_torch_state_dict reads one (every CRC, length and extent checked; no Python code
// run), with unpickle_value's wider set of plain data. Throws NotFound for a missing file,
// Corruption for a damaged one, Unsupported for a global outside that set (named).
PyValue load_torch_value(const std::string& path, Env& env);

// Writes `value` as torch.save would, its records under `archive`/ (torch.save uses the file's
// stem), committed atomically; the pickle uses only globals that torch.load(weights_only=True)
// accepts, and for NumPy arrays those that Accelerate adds to them. Returns the file's size.
std::uint64_t save_torch_value(const std::string& path, const PyValue& value,
                               std::string_view archive, Env& env);

}  // namespace torchpoint::detail
