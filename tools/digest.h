// The content digest of `torchpoint digest`, also usable from tests.
#pragma once

#include <string>
#include <vector>

#include "checkpoint_view.h"

namespace torchpoint::tool {

// SHA-256 over the tensors in `tensors` (already in canonical order: sorted by key), encoded
// as follows, integers as 8-byte little-endian unsigned:
//   "torchpoint-digest-v1\n"
//   then for each tensor: len(key) key  len(dtype) dtype  ndim  dim...  len(data) data
// where key is "component/name" (just "name" in a file checkpoint's top level), dtype the
// safetensors name ("F32"), and data the tensor's bytes in row-major order, little endian.
// JSON values and file layout (order, alignment, metadata, checksums) do not enter it.
std::string tensor_digest(const std::vector<TensorRef>& tensors);

}  // namespace torchpoint::tool
