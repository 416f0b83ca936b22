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

// The tensors of a state dict saved by Python's torch.save (the zip format, PyTorch >= 1.6):
// what `torch.save(model.state_dict(), path)` writes (an OrderedDict), or a plain dict of
// names to tensors. Returns them in the file's order as a StateDict ready for
// load_module_state_dict(), on the CPU whatever device they were saved from, with their dtypes
// (float32/64, float16, bfloat16, int8/16/32/64, uint8, bool), sizes, strides and storage
// offsets; tensors that shared a storage in Python share one here, as after torch.load. The
// state dict's `_metadata` (per-module versions) is ignored.
//
// The file is read by torchpoint's own zip reader and pickle interpreter, which accept only
// what a state dict needs (no Python object is ever constructed), and treat the bytes as
// hostile: every record's CRC-32, every length and index, and every tensor's extent within its
// storage are checked first.
//
// Throws NotFound for a missing file; Corruption for a file that is not a torch.save zip or is
// damaged (truncated, bad CRC, bad pickle, a tensor outside its storage), naming the file and
// the cause; Unsupported for a compressed record, the pre-1.6 format, another dtype or any
// other Python global (named in the message); Incompatible when the file holds something other
// than a dict of strings to tensors (naming the first entry that is not a tensor). Nothing is
// kept from a failed call. Thread-safe for distinct calls.
//
// Example:
//   // Python: torch.save(model.state_dict(), "model.pt")
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
