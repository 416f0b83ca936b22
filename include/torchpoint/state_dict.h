// StateDict and Stateful: how every part of a training run becomes tensors plus JSON and back.
#pragma once

#include <ATen/core/Tensor.h>

#include <concepts>
#include <memory>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <variant>
#include <vector>

#include "torchpoint/error.h"
#include "torchpoint/tensor_file.h"

namespace torchpoint {

// An ordered map from dotted key ("fc.weight", "state.0.3.exp_avg") to a tensor or a JSON
// value. Components nest by prefix: child("model") is every entry under "model." with that
// prefix removed. Keys keep their insertion order.
//
// JSON numbers round-trip exactly, but JSON has no NaN or infinity: use set_double() for a
// double that may be one (it is stored as a 0-d float64 tensor).
//
// Example:
//   torchpoint::StateDict sd;
//   sd.set("weight", torch::ones({2, 2}));
//   sd.set("epoch", 3);
//   sd.set_double("best", std::numeric_limits<double>::infinity());
class StateDict {
 public:
  using Value = std::variant<at::Tensor, Json>;

  StateDict() = default;

  // Inserts or replaces.
  void set(const std::string& key, at::Tensor tensor);
  void set(const std::string& key, Json value);
  void set_double(const std::string& key, double value);
  // Inserts every entry of `child` under "<prefix>.".
  void set_child(const std::string& prefix, const StateDict& child);

  bool contains(const std::string& key) const;
  bool is_tensor(const std::string& key) const;
  // Throw NotFound naming the key (and `what` this dict is) when absent, InvalidArgument when
  // the entry has the other kind.
  const at::Tensor& tensor(const std::string& key) const;
  const Json& value(const std::string& key) const;
  double get_double(const std::string& key) const;
  template <typename T>
  T get(const std::string& key) const {
    try {
      return value(key).get<T>();
    } catch (const Json::exception& e) {
      throw_bad_value(key, e.what());
    }
  }

  // Entries under "<prefix>.", with the prefix removed.
  StateDict child(const std::string& prefix) const;
  bool has_child(const std::string& prefix) const;
  // Distinct first components of the keys ("model" for "model.fc.weight"), in order.
  std::vector<std::string> top_level_names() const;

  const std::vector<std::pair<std::string, Value>>& entries() const { return entries_; }
  std::vector<std::string> keys() const;
  std::size_t size() const { return entries_.size(); }
  bool empty() const { return entries_.empty(); }
  void erase(const std::string& key);

  // A copy whose tensors are cloned: state_dict() tensors are often views of live parameters
  // or optimizer buffers, which later training steps change.
  StateDict clone() const;

  // Names what this dict holds in error messages ("optimizer", "model/encoder").
  void set_description(std::string what) { what_ = std::move(what); }
  const std::string& description() const { return what_; }

  // To and from a container file: tensors stay tensors; JSON values go to the file's state
  // under "values", with the order of all keys under "order".
  Container to_container() const;
  static StateDict from_container(const Container& container);

 private:
  [[noreturn]] void throw_bad_value(const std::string& key, const char* why) const;

  std::vector<std::pair<std::string, Value>> entries_;
  std::unordered_map<std::string, std::size_t> index_;
  std::string what_ = "state dict";
};

// Anything with `state_dict()` returning a StateDict and `load_state_dict(const StateDict&)`.
template <typename T>
concept Stateful = requires(T& t, const StateDict& sd) {
  { t.state_dict() } -> std::convertible_to<StateDict>;
  t.load_state_dict(sd);
};

namespace detail {
template <typename T>
struct pointee {
  using type = T;
};
template <typename T>
struct pointee<std::shared_ptr<T>> {
  using type = T;
};
template <typename>
inline constexpr bool always_false = false;
// See AnyStateful::load_replaces_state().
template <typename T>
constexpr bool load_replaces_state() {
  if constexpr (requires { T::kLoadReplacesState; }) {
    return T::kLoadReplacesState;
  } else {
    return false;
  }
}
}  // namespace detail

// A Stateful object of any type, held by shared pointer, by reference (the caller keeps it
// alive) or by value. Users register their own objects without inheriting from torchpoint.
//
// Example:
//   struct Counter { int n = 0;
//     StateDict state_dict() const { StateDict s; s.set("n", n); return s; }
//     void load_state_dict(const StateDict& s) { n = s.get<int>("n"); } };
//   Counter c;
//   torchpoint::AnyStateful any = torchpoint::AnyStateful::ref(c);
class AnyStateful {
 public:
  template <typename T>
  AnyStateful(std::shared_ptr<T> object) {  // NOLINT: implicit by design
    static_assert(Stateful<T>,
                  "torchpoint: this type cannot be checkpointed: it needs `StateDict "
                  "state_dict()` and `void load_state_dict(const torchpoint::StateDict&)`");
    impl_ = std::make_shared<Holder<T>>(std::move(object));
  }

  // By value: the object is moved in and owned.
  template <typename T>
  static AnyStateful value(T object) {
    static_assert(Stateful<T>,
                  "torchpoint: this type cannot be checkpointed: it needs `StateDict "
                  "state_dict()` and `void load_state_dict(const torchpoint::StateDict&)`");
    return AnyStateful(std::make_shared<T>(std::move(object)));
  }

  // By reference: the caller keeps `object` alive as long as this AnyStateful is used.
  template <typename T>
  static AnyStateful ref(T& object) {
    static_assert(Stateful<T>,
                  "torchpoint: this type cannot be checkpointed: it needs `StateDict "
                  "state_dict()` and `void load_state_dict(const torchpoint::StateDict&)`");
    return AnyStateful(std::shared_ptr<T>(std::shared_ptr<T>(), &object));
  }

  StateDict state_dict() const { return impl_->state_dict(); }
  void load_state_dict(const StateDict& state) const { impl_->load_state_dict(state); }
  // Whether the object's load_state_dict() puts new tensors in the place of those its
  // state_dict() returned and never writes into them (its type declares
  // `static constexpr bool kLoadReplacesState = true;`): then what state_dict() returned before
  // a load still holds the state as it was, with no copy (what StatefulSet::restore() keeps to
  // put a component back).
  bool load_replaces_state() const { return impl_->load_replaces_state(); }

 private:
  struct Base {
    virtual ~Base() = default;
    virtual StateDict state_dict() = 0;
    virtual void load_state_dict(const StateDict& state) = 0;
    virtual bool load_replaces_state() const = 0;
  };
  template <typename T>
  struct Holder final : Base {
    explicit Holder(std::shared_ptr<T> o) : object(std::move(o)) {}
    StateDict state_dict() override { return object->state_dict(); }
    void load_state_dict(const StateDict& state) override { object->load_state_dict(state); }
    bool load_replaces_state() const override { return detail::load_replaces_state<T>(); }
    std::shared_ptr<T> object;
  };
  std::shared_ptr<Base> impl_;
};

}  // namespace torchpoint
