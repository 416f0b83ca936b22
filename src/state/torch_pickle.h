// An interpreter for the pickle that torch.save writes for a state dict (data.pkl, protocol 2):
// a dict or collections.OrderedDict of names to tensors, each tensor rebuilt by
// torch._utils._rebuild_tensor_v2 (or _v3) from a storage named by a persistent id. It constructs
// no Python objects beyond those, and treats the bytes as hostile: bounded stack and memo, every
// length and index checked before use, tensors checked against their storage.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace torchpoint::detail {

// The typed storage classes of torch.save (torch.FloatStorage, ...) and their dtypes: what
// _rebuild_tensor_v2 tensors are built on, read here and written by save_torch_state_dict.
struct StorageType {
  std::string_view name;
  c10::ScalarType dtype;
};
inline constexpr StorageType kStorageTypes[] = {
    {"FloatStorage", c10::ScalarType::Float}, {"DoubleStorage", c10::ScalarType::Double},
    {"HalfStorage", c10::ScalarType::Half},   {"BFloat16Storage", c10::ScalarType::BFloat16},
    {"LongStorage", c10::ScalarType::Long},   {"IntStorage", c10::ScalarType::Int},
    {"ShortStorage", c10::ScalarType::Short}, {"CharStorage", c10::ScalarType::Char},
    {"ByteStorage", c10::ScalarType::Byte},   {"BoolStorage", c10::ScalarType::Bool},
};

// Returns the bytes of storage `key` as a 1-D CPU tensor of `numel` elements of `dtype`, or
// throws. Called once per distinct key.
using StorageLoader =
    std::function<at::Tensor(const std::string& key, c10::ScalarType dtype, std::int64_t numel)>;

// The entries of the dict that `pickle` holds, in the pickle's order. Tensors are views with
// the file's sizes, strides and offsets into storages that `load` returned, so tensors that
// shared a storage in Python share one here (as after torch.load). `where` names the file in
// messages. Throws Corruption for a damaged pickle or a tensor outside its storage,
// Unsupported for a global other than OrderedDict, the tensor rebuilders and the storage
// types, and Incompatible when the result is not a dict of strings to tensors.
std::vector<std::pair<std::string, at::Tensor>> unpickle_state_dict(std::string_view pickle,
                                                                    const StorageLoader& load,
                                                                    const std::string& where);

}  // namespace torchpoint::detail
