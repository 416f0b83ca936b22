// Weights from Python: files written by `torch.save(model.state_dict(), path)` and
// `.safetensors` files written by other tools, ready to load into a LibTorch module.
// (The other direction, a torch.load-able export, is `torchpoint export` and
// torch::jit::pickle_save of a dict.)
#pragma once

#include <string>

#include "torchpoint/env.h"
#include "torchpoint/state_dict.h"
#include "torchpoint/tensor_file.h"

namespace torchpoint {

// The tensors of a dict saved by Python's torch.save (the zip format, PyTorch ≥ 1.6), in the
// file's order, as a StateDict ready for load_module_state_dict(). Throws NotFound for a
// missing file, Incompatible when the file does not hold a dict of tensors (naming the first
// entry that is not a tensor), Corruption when it cannot be unpickled, and Unsupported for an
// OrderedDict — what model.state_dict() returns — which LibTorch 1.13's unpickler cannot
// read: save `dict(model.state_dict())` instead (or a .safetensors file).
//
// Example:
//   // Python: torch.save(dict(model.state_dict()), "model.pt")
//   auto sd = torchpoint::load_torch_state_dict("model.pt");
//   torchpoint::load_module_state_dict(*model, sd);
StateDict load_torch_state_dict(const std::string& path, Env& env = Env::posix());

// Any safetensors file. A torchpoint file is fully verified (as load_file does); a file from
// another writer has no checksums, so only its structure is checked (every offset, shape and
// dtype) and `verified` is false.
struct ForeignContainer {
  Container contents;
  bool verified = false;
};
ForeignContainer load_safetensors(const std::string& path, Env& env = Env::posix());

}  // namespace torchpoint
