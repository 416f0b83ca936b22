// Learner checkpoints: one container file (what luz's callbacks write, e.g. state.ckpt) holding
// the learner's components under prefixes:
//   learner.*    format, position (epoch_end / mid_epoch), stop flag, callbacks with state
//   model.*      optimizer.*  counters.*  records.*
//   sampler.*    progress.*   (data position and the running epoch's sums; during a fit)
//   callbacks.*  (each callback's state, under its name; during a fit)
//   rng.*        (restored last)
#include <fmt/format.h>

#include <cmath>

#include "torchpoint/error.h"
#include "torchpoint/learner.h"
#include "torchpoint/module_state.h"
#include "torchpoint/optimizer_state.h"
#include "torchpoint/rng_state.h"
#include "torchpoint/stateful_set.h"
#include "train/fit_run.h"

namespace torchpoint {
namespace {

constexpr const char* kFormat = "torchpoint.learner";
constexpr std::int64_t kVersion = 1;

Env& env_or_default(Env* env) { return env != nullptr ? *env : Env::posix(); }

// Each part below is a Stateful view of some of the learner's (or the fit's) state, so that
// StatefulSet can check names first and undo a half-done restore.
struct ModelPart {
  torch::nn::Module* model;
  StateDict state_dict() const { return module_state_dict(*model); }
  void load_state_dict(const StateDict& s) { load_module_state_dict(*model, s); }
};

struct OptimizerPart {
  torch::optim::Optimizer* optimizer;
  StateDict state_dict() const { return optimizer_state_dict(*optimizer); }
  void load_state_dict(const StateDict& s) { load_optimizer_state_dict(*optimizer, s); }
};

struct RecordsPart {
  MetricRecords* records;
  StateDict state_dict() const { return records->state_dict(); }
  void load_state_dict(const StateDict& s) { records->load_state_dict(s); }
};

// Completed epochs and steps; with the position also the batch within the running epoch.
struct CountersPart {
  TrainingCounters* counters;
  bool with_position;
  StateDict state_dict() const { return counters->state_dict(); }
  void load_state_dict(const StateDict& s) {
    TrainingCounters loaded;
    loaded.load_state_dict(s);
    if (!with_position) loaded.batch_in_epoch = 0;  // a partly done epoch starts over
    *counters = loaded;
  }
};

// Where the fit is: mid-epoch or at an epoch end, whether a callback asked to stop, the data
// order and position, and the running epoch's sums.
struct PositionPart {
  detail::FitRun* run;
  const TrainingCounters* counters;
  StateDict state_dict() const {
    StateDict s;
    s.set("mid_epoch", run->mid_epoch || counters->batch_in_epoch > 0);
    s.set("stop_requested", run->ctx.stop_requested);
    s.set_child("sampler", run->sampler.state_dict());
    std::vector<std::string> names;
    for (const auto& [name, acc] : run->progress) {
      names.push_back(name);
      s.set_double("progress." + name + ".sum", acc.sum);
      s.set("progress." + name + ".count", acc.count);
    }
    s.set("progress_names", names);
    return s;
  }
  void load_state_dict(const StateDict& s) {
    StateDict sampler_state = s.child("sampler");
    // The order's seed is the saved run's: a resumed fit must see the same order.
    ResumableSampler sampler(run->data->size(), run->options->shuffle(),
                             sampler_state.get<std::uint64_t>("seed"));
    sampler.load_state_dict(sampler_state);
    std::map<std::string, detail::Accumulator> progress;
    for (const std::string& name : s.get<std::vector<std::string>>("progress_names")) {
      progress[name] = {s.get_double("progress." + name + ".sum"),
                        s.get<std::int64_t>("progress." + name + ".count")};
    }
    bool mid_epoch = s.get<bool>("mid_epoch");
    run->sampler = sampler;
    run->progress = std::move(progress);
    run->mid_epoch = mid_epoch;
    run->ctx.stop_requested = s.get<bool>("stop_requested");
  }
};

// Every callback with state, under its name. Loading checks that each saved state has its
// callback before any is changed.
struct CallbacksPart {
  detail::FitRun* run;
  bool strict = true;
  StateDict state_dict() const {
    StateDict s;
    std::vector<std::string> names;
    for (const CallbackPtr& callback : run->callbacks) {
      StateDict own = callback->state_dict();
      if (own.empty()) continue;
      names.push_back(callback->name());
      s.set_child("state." + callback->name(), own);
    }
    s.set("names", names);
    return s;
  }
  void load_state_dict(const StateDict& s) {
    auto names = s.get<std::vector<std::string>>("names");
    std::vector<std::string> missing, present;
    for (const CallbackPtr& callback : run->callbacks) present.push_back(callback->name());
    for (const std::string& name : names) {
      if (std::find(present.begin(), present.end(), name) == present.end()) {
        missing.push_back(name);
      }
    }
    if (!missing.empty() && !strict) {
      run->ctx.warn(fmt::format(
          "the checkpoint holds the state of callback(s) {} that this fit does not have (it "
          "has: {}); that state was not restored",
          fmt::join(missing, ", "),
          present.empty() ? "none" : fmt::format("{}", fmt::join(present, ", "))));
    } else if (!missing.empty()) {
      throw Error(
          ErrorCode::Incompatible,
          fmt::format("the checkpoint holds the state of callback(s) {} but this fit has "
                      "no callback of that name (it has: {}); add them, or do not "
                      "restore callback state",
                      fmt::join(missing, ", "),
                      present.empty() ? "none" : fmt::format("{}", fmt::join(present, ", "))));
    }
    // Put back those already loaded if a later one refuses its state.
    std::vector<std::pair<Callback*, StateDict>> undo;
    try {
      for (const CallbackPtr& callback : run->callbacks) {
        if (std::find(names.begin(), names.end(), callback->name()) == names.end()) continue;
        StateDict before = callback->state_dict().clone();
        callback->load_state_dict(s.child("state." + callback->name()));
        undo.emplace_back(callback.get(), std::move(before));
      }
    } catch (...) {
      for (auto it = undo.rbegin(); it != undo.rend(); ++it) {
        try {
          it->first->load_state_dict(it->second);
        } catch (...) {  // swallowed on purpose: the original error is the one to report
        }
      }
      throw;
    }
  }
};

StateDict read_checkpoint(const std::string& path, Env& env) {
  StateDict state = StateDict::from_container(load_file(path, env));
  state.set_description(path);
  if (!state.contains("learner.format") || state.is_tensor("learner.format") ||
      state.value("learner.format") != kFormat) {
    throw Error(ErrorCode::Incompatible,
                fmt::format("{} is a valid torchpoint file but not a learner checkpoint (no "
                            "learner.format = \"{}\"); it was not written by a Learner",
                            path, kFormat));
  }
  auto version = state.get<std::int64_t>("learner.version");
  if (version > kVersion) {
    throw Error(ErrorCode::Incompatible,
                fmt::format("{} is a learner checkpoint of version {}, newer than this "
                            "torchpoint reads ({}); upgrade torchpoint",
                            path, version, kVersion));
  }
  return state;
}

}  // namespace

void Learner::save_checkpoint(const std::string& path, Env* env) const {
  save_file(path, checkpoint_contents(), env_or_default(env));
}

SaveHandle Learner::save_checkpoint(const std::string& path, AsyncCheckpointer& saver) const {
  return saver.save_file(path, checkpoint_contents());
}

Container Learner::checkpoint_contents() const {
  StateDict state;
  state.set("learner.format", kFormat);
  state.set("learner.version", kVersion);
  Json last_metrics = Json::object();
  if (run_ != nullptr) {
    for (const auto& [name, value] : run_->ctx.metrics) {
      if (std::isfinite(value)) last_metrics[name] = value;
    }
  }
  state.set("learner.metrics", last_metrics);
  state.set_child("model", module_state_dict(*model_));
  state.set_child("optimizer", optimizer_state_dict(*optimizer_));
  state.set_child("counters", counters_.state_dict());
  state.set_child("records", records_.state_dict());
  if (run_ != nullptr) {
    state.set_child("position", PositionPart{run_, &counters_}.state_dict());
    state.set_child("callbacks", CallbacksPart{run_}.state_dict());
    state.set_child("rng", RngState().state_dict());
  }
  return state.to_container();
}

void Learner::restore_checkpoint(const std::string& path, const RestoreOptions& what, Env* env) {
  if ((what.position() || what.callbacks()) && run_ == nullptr) {
    throw Error(ErrorCode::InvalidArgument,
                "restore_checkpoint: the data position and callback state belong to a running "
                "fit; restore them from a callback's on_fit_begin, or turn them off");
  }
  if (what.position() && !what.records()) {
    throw Error(ErrorCode::InvalidArgument,
                "restore_checkpoint: restoring the exact position needs the records and "
                "counters too");
  }
  StateDict state = read_checkpoint(path, env_or_default(env));
  StateDict selected;
  StatefulSet set;
  auto select = [&](const std::string& name) {
    if (!state.has_child(name)) {
      throw Error(ErrorCode::Incompatible,
                  fmt::format("{} has no {} state to restore (it was saved outside a fit, or "
                              "without it); do not ask to restore it",
                              path, name));
    }
    selected.set_child(name, state.child(name));
  };
  if (what.position()) {
    // Registered first, so that its undo snapshot sees the counters as they were.
    select("position");
    set.add("position", PositionPart{run_, &counters_});
  }
  if (what.model()) {
    select("model");
    set.add("model", ModelPart{model_.get()});
  }
  if (what.optimizer()) {
    select("optimizer");
    set.add("optimizer", OptimizerPart{optimizer_.get()});
  }
  if (what.records()) {
    select("records");
    select("counters");
    set.add("records", RecordsPart{&records_});
    set.add("counters", CountersPart{&counters_, what.position()});
  }
  if (what.callbacks()) {
    select("callbacks");
    set.add("callbacks", CallbacksPart{run_, what.strict_callbacks()});
  }
  if (what.position()) {
    select("rng");
    // Why last: anything restored before could draw random numbers.
    set.add("rng", RngState(), /*restore_last=*/true);
  }
  set.restore(selected);
  if (run_ != nullptr && what.records()) {
    run_->resumed_after_epoch = counters_.epoch;
    if (!what.position()) run_->mid_epoch = false;
  }
}

void load_checkpoint(Learner& learner, const std::string& path, Env* env) {
  learner.restore_checkpoint(
      path, RestoreOptions().optimizer(false).records(false).callbacks(false).position(false), env);
}

void load_checkpoint(FitResult& result, const std::string& path, Env* env) {
  if (!result.model) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("load_checkpoint: this FitResult holds no model to load {} into (it "
                            "was not returned by Learner::fit)",
                            path));
  }
  StateDict state = read_checkpoint(path, env_or_default(env));
  if (!state.has_child("model")) {
    throw Error(ErrorCode::Incompatible, fmt::format("{} has no model state to load", path));
  }
  StateDict selected;
  selected.set_child("model", state.child("model"));
  StatefulSet set;
  set.add("model", ModelPart{result.model.get()});
  set.restore(selected);
}

}  // namespace torchpoint
