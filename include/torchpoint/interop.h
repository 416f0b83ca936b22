// Weights from Python: files written by `torch.save(model.state_dict(), path)` and
// `.safetensors` files written by other tools, ready to load into a LibTorch module.
// And the other direction: save_torch_state_dict writes a file that torch.load reads.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "torchpoint/env.h"
#include "torchpoint/error.h"
#include "torchpoint/state_dict.h"
#include "torchpoint/tensor_file.h"

namespace torchpoint {

// The tensors of a state dict saved by Python's torch.save (the zip format, PyTorch >= 1.6):
// what `torch.save(model.state_dict(), path)` writes (an OrderedDict), or a plain dict of
// names to tensors. Returns them in the file's order as a StateDict ready for
// load_module_state_dict(), on the CPU whatever device they were saved from, with their dtypes
// (float32/64, float16, bfloat16, int8/16/32/64, uint8, bool; and uint16/32/64 and float8,
// which torch 2.x writes with _rebuild_tensor_v3, where this LibTorch has them), sizes,
// strides and storage offsets; tensors that shared a storage in Python share one here, as
// after torch.load. The state dict's `_metadata` (per-module versions) is ignored.
//
// The file is read by torchpoint's own zip reader and pickle interpreter, which accept only
// what a state dict needs (no Python object is ever constructed), and treat the bytes as
// hostile: every record's CRC-32, every length and index, and every tensor's extent within its
// storage are checked first. The archive is read from its directory at the end and record by
// record, never whole into memory; only torchpoint::Error escapes (an allocation that fails
// is Unsupported).
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

// Writes `tensors` as Python's torch.save writes a dict of tensors, so that `torch.load(path)`
// returns {name: tensor} in this order with PyTorch 2.6's default weights_only=True as well as
// with weights_only=False (only globals the weights-only unpickler allows are used) and
// load_torch_state_dict reads it back. Every dtype torch.save writes: those of
// load_torch_state_dict, and uint16/32/64 and float8 where LibTorch has them. Each tensor is
// written contiguous, on the CPU, with its own storage (views of one buffer are not shared in
// the file), without requires_grad. The file is committed atomically: `path` holds the new
// file whole or what it held before. Throws InvalidArgument for an undefined tensor,
// Unsupported for a dtype torch.save cannot hold (complex, quantized...), IOError on a failed
// write. Returns the size of the file. The file is streamed: each storage goes from its tensor's
// memory to the file, so the file is never whole in memory (a tensor that is not contiguous on
// the CPU is copied first, as it must be).
//
// Example:
//   torchpoint::save_torch_state_dict("model.pt", {{"fc.weight", fc->weight}});
//   // Python: torch.load("model.pt")["fc.weight"]
std::uint64_t save_torch_state_dict(const std::string& path,
                                    const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                                    Env& env = Env::posix());
// The bytes save_torch_state_dict writes, in memory.
std::string torch_state_dict_bytes(const std::vector<std::pair<std::string, at::Tensor>>& tensors);

// Any safetensors file. A torchpoint file is fully verified (as load_file does); a file from
// another writer has no checksums, so only its structure is checked (every offset, shape and
// dtype) and `verified` is false.
struct ForeignContainer {
  Container contents;
  bool verified = false;
};
ForeignContainer load_safetensors(const std::string& path, Env& env = Env::posix());

}  // namespace torchpoint
