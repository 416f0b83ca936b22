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

// A Python value read from a pickle, as plain data: what the files of Python Accelerate's
// save_state hold (optimizer and scheduler state dicts, RNG states, custom objects' state
// dicts). Nothing in it is a Python object; an ndarray is its dtype, shape and raw bytes.
struct PyEntry;
struct PyValue {
  enum class Kind { kNone, kBool, kInt, kFloat, kStr, kBytes, kTuple, kList, kDict, kTensor, kArray };
  Kind kind = Kind::kNone;
  bool boolean = false;
  std::int64_t integer = 0;
  double number = 0;
  // The text of a str (UTF-8), the bytes of a bytes, the raw data of an ndarray.
  std::string text;
  std::vector<PyValue> items;                        // a tuple's or a list's
  std::vector<PyEntry> entries;  // a dict's, in order
  at::Tensor tensor;
  // A dict's class ("dict", "OrderedDict", "Counter"); an ndarray's dtype ("<u4").
  std::string type;
  std::vector<std::int64_t> shape;  // an ndarray's

  static PyValue none();
  static PyValue of(bool b);
  static PyValue of(std::int64_t i);
  static PyValue of(double d);
  static PyValue of(std::string s);
  static PyValue of(at::Tensor t);
  static PyValue tuple(std::vector<PyValue> items);
  static PyValue list(std::vector<PyValue> items);
  static PyValue dict();
  // Adds (or replaces) the entry of str key `key` of a dict.
  PyValue& set(const std::string& key, PyValue value);

  bool is(Kind k) const { return kind == k; }
  // The value of str key `key` of a dict, or null.
  const PyValue* find(std::string_view key) const;
  // Python's name of this value's type: "int", "dict", "torch.Tensor", "numpy.ndarray", ...
  std::string type_name() const;
};

// One key and value of a dict. (Not a std::pair: its constructors' constraints would need
// PyValue complete inside PyValue.)
struct PyEntry {
  PyValue key;
  PyValue value;
};

// The value `pickle` holds (a torch.save data.pkl, or a plain pickle when `load` is never
// needed). Beyond the globals of a state dict, reads NumPy arrays and dtypes (as data: their
// reconstruction functions are never called), bytes written as _codecs.encode(s, "latin1"),
// and collections.Counter. Throws Corruption for a damaged pickle (or one nesting deeper than
// 100 levels or referring to itself), Unsupported naming any other global.
PyValue unpickle_value(std::string_view pickle, const StorageLoader& load, const std::string& where);

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
