// The content digest of a checkpoint's tensors (inspect.h), what `torchpoint digest` prints.
#include <string>
#include <vector>

#include "inspect/sha256.h"
#include "torchpoint/inspect.h"

namespace torchpoint {
using detail::Sha256;

namespace {

void put_u64(Sha256& h, std::uint64_t v) {
  unsigned char bytes[8];
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<unsigned char>(v >> (8 * i));
  h.update(bytes, 8);
}

void put_string(Sha256& h, const std::string& s) {
  put_u64(h, s.size());
  h.update(s);
}

}  // namespace

std::string tensor_digest(const std::vector<TensorRef>& tensors) {
  Sha256 h;
  h.update("torchpoint-digest-v1\n");
  for (const TensorRef& t : tensors) {
    put_string(h, t.key());
    put_string(h, dtype_name(t.tensor));
    put_u64(h, static_cast<std::uint64_t>(t.tensor.dim()));
    for (std::int64_t d : t.tensor.sizes()) put_u64(h, static_cast<std::uint64_t>(d));
    at::Tensor data = t.tensor.contiguous();
    put_u64(h, tensor_bytes(data));
    if (tensor_bytes(data) > 0) h.update(data.data_ptr(), tensor_bytes(data));
  }
  return h.hex_digest();
}

}  // namespace torchpoint
