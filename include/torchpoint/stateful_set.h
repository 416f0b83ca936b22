// A named set of Stateful components saved and restored together, with nothing skipped
// silently: every component present in a state must be restored and every registered one must
// be present, unless the caller opted out for that component.
#pragma once

#include <set>
#include <string>
#include <vector>

#include "torchpoint/error.h"
#include "torchpoint/state_dict.h"

namespace torchpoint {

// What restore() did.
struct RestoreReport {
  std::vector<std::string> restored;         // in the order they were restored
  std::vector<std::string> skipped_missing;  // registered, absent, opted out
  std::vector<std::string> skipped_unknown;  // present, not registered, opted out
};

// Example:
//   torchpoint::StatefulSet set;
//   set.add("model", torchpoint::ModuleState(model));
//   set.add("optimizer", torchpoint::OptimizerState(optimizer));
//   set.add("rng", torchpoint::AnyStateful::ref(rng), /*restore_last=*/true);
//   torchpoint::save_file("state.ckpt", set.state_dict().to_container());
//   set.restore(torchpoint::StateDict::from_container(torchpoint::load_file("state.ckpt")));
class StatefulSet {
 public:
  // Registers `component` under `name` (letters, digits, '_', '-'; no '.'). Components with
  // `restore_last` (RNG state) are restored after all others, in registration order. Throws
  // InvalidArgument for a bad or duplicate name.
  template <typename T>
  void add(const std::string& name, T component, bool restore_last = false) {
    if constexpr (std::is_same_v<T, AnyStateful>) {
      add_any(name, std::move(component), restore_last);
    } else {
      add_any(name, AnyStateful::value(std::move(component)), restore_last);
    }
  }

  // Opt-outs: restore() tolerates `name` being absent from the state, or present in the state
  // without a registered component.
  void allow_missing(const std::string& name) { allow_missing_.insert(name); }
  void allow_unknown(const std::string& name) { allow_unknown_.insert(name); }

  // Each component's state under "<name>.".
  StateDict state_dict() const;

  // Restores every component from `state`. Checks names first: a component registered but
  // absent, or present but not registered, is an Incompatible error listing all of them (unless
  // opted out), and nothing is changed. If a component then fails to load, the components
  // already restored are put back as they were before the call and the error is rethrown
  // (from a copy of each one's state taken before its load; with no copy for a component whose
  // load replaces its state, see AnyStateful::load_replaces_state()).
  RestoreReport restore(const StateDict& state);

  std::vector<std::string> names() const;

 private:
  struct Entry {
    std::string name;
    AnyStateful component;
    bool last;
  };
  void add_any(const std::string& name, AnyStateful component, bool restore_last);
  std::vector<Entry> entries_;
  std::set<std::string> allow_missing_;
  std::set<std::string> allow_unknown_;
};

}  // namespace torchpoint
