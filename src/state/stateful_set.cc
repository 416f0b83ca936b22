#include "torchpoint/stateful_set.h"

#include <fmt/format.h>

#include <unordered_set>

#include "torchpoint/error.h"

namespace torchpoint {

void StatefulSet::add_any(const std::string& name, AnyStateful component, bool restore_last) {
  bool ok = !name.empty();
  for (char c : name) {
    ok = ok && ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                c == '_' || c == '-');
  }
  if (!ok) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("component name '{}' must be letters, digits, '_' or '-'", name));
  }
  for (const Entry& e : entries_) {
    if (e.name == name) {
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("a component named '{}' is already registered", name));
    }
  }
  entries_.push_back({name, std::move(component), restore_last});
}

std::vector<std::string> StatefulSet::names() const {
  std::vector<std::string> out;
  for (const Entry& e : entries_) out.push_back(e.name);
  return out;
}

StateDict StatefulSet::state_dict() const {
  StateDict sd;
  for (const Entry& e : entries_) sd.set_child(e.name, e.component.state_dict());
  return sd;
}

RestoreReport StatefulSet::restore(const StateDict& state) {
  RestoreReport report;
  std::vector<std::string> missing, unknown;
  std::unordered_set<std::string> registered;
  for (const Entry& e : entries_) {
    registered.insert(e.name);
    if (state.has_child(e.name)) continue;
    if (allow_missing_.count(e.name)) {
      report.skipped_missing.push_back(e.name);
    } else {
      missing.push_back(e.name);
    }
  }
  for (const std::string& name : state.top_level_names()) {
    if (registered.count(name)) continue;
    if (allow_unknown_.count(name)) {
      report.skipped_unknown.push_back(name);
    } else {
      unknown.push_back(name);
    }
  }
  if (!missing.empty() || !unknown.empty()) {
    std::string message =
        "the checkpoint does not match the registered components; nothing was "
        "restored:";
    if (!missing.empty()) {
      message +=
          fmt::format("\n  registered but not in the checkpoint: {}", fmt::join(missing, ", "));
    }
    if (!unknown.empty()) {
      message +=
          fmt::format("\n  in the checkpoint but not registered: {}", fmt::join(unknown, ", "));
    }
    message +=
        "\n(register the same components as the run that saved it, or opt out with "
        "allow_missing / allow_unknown)";
    throw Error(ErrorCode::Incompatible, message);
  }

  std::vector<const Entry*> order;
  for (const Entry& e : entries_) {
    if (!e.last) order.push_back(&e);
  }
  // Components that draw no random numbers while loading but whose state others may disturb
  // (RNG) go last.
  for (const Entry& e : entries_) {
    if (e.last) order.push_back(&e);
  }
  std::vector<std::pair<const Entry*, StateDict>> undo;
  try {
    for (const Entry* e : order) {
      if (!state.has_child(e->name)) continue;
      StateDict before = e->component.load_replaces_state() ? e->component.state_dict()
                                                            : e->component.state_dict().clone();
      e->component.load_state_dict(state.child(e->name));
      undo.emplace_back(e, std::move(before));
      report.restored.push_back(e->name);
    }
  } catch (...) {
    // Put back what was already restored, newest first, so that a failed restore changes
    // nothing. A failure while undoing is swallowed: the original error is the one to report.
    for (auto it = undo.rbegin(); it != undo.rend(); ++it) {
      try {
        it->first->component.load_state_dict(it->second);
      } catch (...) {  // swallowed on purpose, see above
      }
    }
    throw;
  }
  return report;
}

}  // namespace torchpoint
