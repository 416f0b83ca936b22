// PyValue, the tree a pickle is read into (torch_pickle.h): its constructors and look-ups.
#include "python/torch_pickle.h"

#include <string>
#include <utility>

namespace torchpoint::detail {

PyValue PyValue::none() { return PyValue(); }
PyValue PyValue::of(bool b) {
  PyValue v;
  v.kind = Kind::kBool;
  v.boolean = b;
  return v;
}
PyValue PyValue::of(std::int64_t i) {
  PyValue v;
  v.kind = Kind::kInt;
  v.integer = i;
  return v;
}
PyValue PyValue::of(double d) {
  PyValue v;
  v.kind = Kind::kFloat;
  v.number = d;
  return v;
}
PyValue PyValue::of(std::string s) {
  PyValue v;
  v.kind = Kind::kStr;
  v.text = std::move(s);
  return v;
}
PyValue PyValue::of(at::Tensor t) {
  PyValue v;
  v.kind = Kind::kTensor;
  v.tensor = std::move(t);
  return v;
}
PyValue PyValue::tuple(std::vector<PyValue> items) {
  PyValue v;
  v.kind = Kind::kTuple;
  v.items = std::move(items);
  return v;
}
PyValue PyValue::list(std::vector<PyValue> items) {
  PyValue v = tuple(std::move(items));
  v.kind = Kind::kList;
  return v;
}
PyValue PyValue::dict() {
  PyValue v;
  v.kind = Kind::kDict;
  v.type = "dict";
  return v;
}

PyValue& PyValue::set(const std::string& key, PyValue value) {
  for (auto& [k, existing] : entries) {
    if (k.kind == Kind::kStr && k.text == key) {
      existing = std::move(value);
      return existing;
    }
  }
  entries.push_back({of(key), std::move(value)});
  return entries.back().value;
}

const PyValue* PyValue::find(std::string_view key) const {
  if (kind != Kind::kDict) return nullptr;
  for (const auto& [k, value] : entries) {
    if (k.kind == Kind::kStr && k.text == key) return &value;
  }
  return nullptr;
}

std::string PyValue::type_name() const {
  switch (kind) {
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kStr:
      return "str";
    case Kind::kBytes:
      return "bytes";
    case Kind::kTuple:
      return "tuple";
    case Kind::kList:
      return "list";
    case Kind::kDict:
      return type == "dict" ? "dict" : "collections." + type;
    case Kind::kTensor:
      return "torch.Tensor";
    case Kind::kArray:
      return "numpy.ndarray";
  }
  return "?";
}

}  // namespace torchpoint::detail
