#include "torchpoint/state_dict.h"

#include <ATen/ops/scalar_tensor.h>
#include <fmt/format.h>

#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include "format/ordered_json.h"
#include "torchpoint/error.h"

namespace torchpoint {

void StateDict::set(const std::string& key, at::Tensor tensor) {
  auto it = index_.find(key);
  if (it != index_.end()) {
    entries_[it->second].second = std::move(tensor);
    return;
  }
  index_.emplace(key, entries_.size());
  entries_.emplace_back(key, std::move(tensor));
}

void StateDict::set(const std::string& key, Json value) {
  auto it = index_.find(key);
  if (it != index_.end()) {
    entries_[it->second].second = std::move(value);
    return;
  }
  index_.emplace(key, entries_.size());
  entries_.emplace_back(key, std::move(value));
}

void StateDict::set_double(const std::string& key, double value) {
  set(key, at::scalar_tensor(value, at::TensorOptions().dtype(at::kDouble)));
}

void StateDict::set_child(const std::string& prefix, const StateDict& child) {
  for (const auto& [key, value] : child.entries_) {
    std::string full = prefix + "." + key;
    if (std::holds_alternative<at::Tensor>(value)) {
      set(full, std::get<at::Tensor>(value));
    } else {
      set(full, std::get<Json>(value));
    }
  }
}

bool StateDict::contains(const std::string& key) const { return index_.count(key) > 0; }

bool StateDict::is_tensor(const std::string& key) const {
  auto it = index_.find(key);
  return it != index_.end() && std::holds_alternative<at::Tensor>(entries_[it->second].second);
}

const at::Tensor& StateDict::tensor(const std::string& key) const {
  auto it = index_.find(key);
  if (it == index_.end()) {
    throw Error(ErrorCode::NotFound,
                fmt::format("{} has no tensor '{}': the checkpoint was saved from a different "
                            "object or version",
                            what_, key));
  }
  const Value& v = entries_[it->second].second;
  if (!std::holds_alternative<at::Tensor>(v)) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("{}: '{}' holds a JSON value, not a tensor", what_, key));
  }
  return std::get<at::Tensor>(v);
}

const Json& StateDict::value(const std::string& key) const {
  auto it = index_.find(key);
  if (it == index_.end()) {
    throw Error(ErrorCode::NotFound,
                fmt::format("{} has no value '{}': the checkpoint was saved from a different "
                            "object or version",
                            what_, key));
  }
  const Value& v = entries_[it->second].second;
  if (!std::holds_alternative<Json>(v)) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("{}: '{}' holds a tensor, not a JSON value", what_, key));
  }
  return std::get<Json>(v);
}

double StateDict::get_double(const std::string& key) const {
  const at::Tensor& t = tensor(key);
  if (t.numel() != 1 || t.scalar_type() != at::kDouble) {
    throw Error(ErrorCode::Incompatible,
                fmt::format("{}: '{}' should be one float64 value, found a {} tensor of shape {}",
                            what_, key, c10::toString(t.scalar_type()), fmt::join(t.sizes(), "x")));
  }
  return t.item<double>();
}

void StateDict::throw_bad_value(const std::string& key, const char* why) const {
  throw Error(ErrorCode::Incompatible,
              fmt::format("{}: '{}' has the wrong type ({})", what_, key, why));
}

StateDict StateDict::child(const std::string& prefix) const {
  StateDict out;
  out.what_ = what_ == "state dict" ? prefix : what_ + "/" + prefix;
  std::string p = prefix + ".";
  for (const auto& [key, value] : entries_) {
    if (!key.starts_with(p)) continue;
    std::string rest = key.substr(p.size());
    if (std::holds_alternative<at::Tensor>(value)) {
      out.set(rest, std::get<at::Tensor>(value));
    } else {
      out.set(rest, std::get<Json>(value));
    }
  }
  return out;
}

bool StateDict::has_child(const std::string& prefix) const {
  std::string p = prefix + ".";
  for (const auto& entry : entries_) {
    if (entry.first.starts_with(p)) return true;
  }
  return false;
}

std::vector<std::string> StateDict::top_level_names() const {
  std::vector<std::string> out;
  std::unordered_set<std::string> seen;
  for (const auto& entry : entries_) {
    std::string first = entry.first.substr(0, entry.first.find('.'));
    if (seen.insert(first).second) out.push_back(first);
  }
  return out;
}

std::vector<std::string> StateDict::keys() const {
  std::vector<std::string> out;
  out.reserve(entries_.size());
  for (const auto& entry : entries_) out.push_back(entry.first);
  return out;
}

void StateDict::erase(const std::string& key) {
  auto it = index_.find(key);
  if (it == index_.end()) return;
  entries_.erase(entries_.begin() + static_cast<std::ptrdiff_t>(it->second));
  index_.clear();
  for (std::size_t i = 0; i < entries_.size(); ++i) index_.emplace(entries_[i].first, i);
}

Container StateDict::to_container() const {
  Container c;
  Json values = Json::object();
  Json order = Json::array();
  for (const auto& [key, value] : entries_) {
    order.push_back(key);
    if (std::holds_alternative<at::Tensor>(value)) {
      c.tensors.emplace_back(key, std::get<at::Tensor>(value));
    } else {
      append_new_key(values, key, std::get<Json>(value));  // keys are unique here
    }
  }
  c.state = {{"values", std::move(values)}, {"order", std::move(order)}};
  return c;
}

StateDict StateDict::from_container(const Container& c) {
  StateDict out;
  std::unordered_map<std::string_view, const at::Tensor*> tensors;
  for (const auto& [name, t] : c.tensors) tensors.emplace(name, &t);
  const Json empty = Json::object();
  auto values_it = c.state.find("values");
  const Json& values = values_it != c.state.end() && values_it->is_object() ? *values_it : empty;
  auto order_it = c.state.find("order");
  if (order_it == c.state.end() || !order_it->is_array()) {
    // A container written by other means: tensors in file order, then any JSON values.
    for (const auto& [name, t] : c.tensors) out.set(name, t);
    for (const auto& [k, v] : values.items()) out.set(k, v);
    return out;
  }
  // Indexed once: ordered_json's find() walks every key, which for each of n keys is O(n^2).
  std::unordered_map<std::string_view, const Json*> value_index;
  value_index.reserve(values.size());
  for (const auto& [k, v] : values.get_ref<const Json::object_t&>()) value_index.emplace(k, &v);
  for (const Json& k : *order_it) {
    if (!k.is_string()) continue;
    const std::string& key = k.get_ref<const std::string&>();
    if (auto t = tensors.find(key); t != tensors.end()) {
      out.set(key, *t->second);
    } else if (auto v = value_index.find(key); v != value_index.end()) {
      out.set(key, *v->second);
    }
  }
  return out;
}

StateDict StateDict::clone() const {
  StateDict out;
  out.set_description(what_);
  for (const auto& [key, value] : entries_) {
    if (std::holds_alternative<at::Tensor>(value)) {
      out.set(key, std::get<at::Tensor>(value).clone());
    } else {
      out.set(key, std::get<Json>(value));
    }
  }
  return out;
}

}  // namespace torchpoint
