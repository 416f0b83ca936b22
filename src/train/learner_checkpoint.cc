// Learner checkpoints: one container file (what luz's callbacks write, e.g. state.ckpt) holding
// the learner's components under prefixes:
//   learner.*    format, position (epoch_end / mid_epoch), stop flag, callbacks with state
//   learner.optimizers  the optimizers' names, in order (absent in files written before names:
//                one optimizer)
//   model.*      optimizer.*  counters.*  records.*
//                (optimizer.*: one optimizer's state; with several, optimizer.<name>.*)
//   sampler.*    progress.*   (data position and the running epoch's sums; during a fit)
//   callbacks.*  (each callback's state, under its name; during a fit)
//   rng.*        (restored last)
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <mutex>

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

// Every optimizer: a lone one's state directly (as in files written before optimizers had
// names), several each under its name. restore_checkpoint() has checked the names; if one
// optimizer refuses its state, those already loaded are put back.
struct OptimizersPart {
  static constexpr bool kLoadReplacesState = true;  // see load_optimizer_state_dict()
  const NamedOptimizers* optimizers;
  StateDict state_dict() const {
    if (optimizers->size() == 1) return optimizer_state_dict(*optimizers->begin()->second);
    StateDict s;
    for (const auto& [name, optimizer] : *optimizers) {
      s.set_child(name, optimizer_state_dict(*optimizer));
    }
    return s;
  }
  void load_state_dict(const StateDict& s) {
    if (optimizers->size() == 1) {
      load_optimizer_state_dict(*optimizers->begin()->second, s);
      return;
    }
    std::vector<std::pair<torch::optim::Optimizer*, StateDict>> undo;
    try {
      for (const auto& [name, optimizer] : *optimizers) {
        StateDict before = optimizer_state_dict(*optimizer);  // replaced, not written into
        load_optimizer_state_dict(*optimizer, s.child(name));
        undo.emplace_back(optimizer.get(), std::move(before));
      }
    } catch (...) {
      for (auto it = undo.rbegin(); it != undo.rend(); ++it) {
        try {
          load_optimizer_state_dict(*it->first, it->second);
        } catch (...) {  // swallowed on purpose: the original error is the one to report
        }
      }
      throw;
    }
  }
};

constexpr const char* kOptimizerNames = "learner.optimizers";

// A restore of the optimizer state needs the same optimizers by name. A file written before
// optimizers had names holds one, which any Learner with one optimizer takes.
void check_optimizer_names(const std::string& path, const StateDict& state,
                           const NamedOptimizers& optimizers) {
  const std::vector<std::string> ours = optimizers.names();
  if (!state.contains(kOptimizerNames)) {
    if (ours.size() == 1) return;
    throw Error(ErrorCode::Incompatible,
                fmt::format("{} holds the state of one optimizer, saved without a name, but this "
                            "Learner has {} optimizers {{{}}}; restore it into a Learner with one "
                            "optimizer, or without the optimizer state",
                            path, ours.size(), fmt::join(ours, ", ")));
  }
  auto saved = state.get<std::vector<std::string>>(kOptimizerNames);
  auto sorted = [](std::vector<std::string> v) {
    std::sort(v.begin(), v.end());
    return v;
  };
  if (sorted(saved) != sorted(ours)) {
    throw Error(ErrorCode::Incompatible,
                fmt::format("{} holds the optimizers {{{}}} but this Learner has {{{}}}; make the "
                            "Learner with optimizers of the same names (NamedOptimizers), or "
                            "restore without the optimizer state",
                            path, fmt::join(saved, ", "), fmt::join(ours, ", ")));
  }
}

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
    run->set_sampler(sampler);
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

// A small StateDict (one process's RNG states and running sums) as bytes for the store: CBOR,
// with each tensor as its dtype, shape and bytes. Read back only from the same build's processes.
std::string pack(const StateDict& state) {
  Json entries = Json::array();
  for (const auto& [key, value] : state.entries()) {
    if (std::holds_alternative<Json>(value)) {
      entries.push_back({{"key", key}, {"json", std::get<Json>(value)}});
      continue;
    }
    at::Tensor t = std::get<at::Tensor>(value).contiguous().cpu();
    const auto* bytes = static_cast<const std::uint8_t*>(t.data_ptr());
    entries.push_back(
        {{"key", key},
         {"dtype", static_cast<int>(t.scalar_type())},
         {"shape", t.sizes().vec()},
         {"data", Json::binary(std::vector<std::uint8_t>(bytes, bytes + t.nbytes()))}});
  }
  std::vector<std::uint8_t> cbor = Json::to_cbor(entries);
  return std::string(cbor.begin(), cbor.end());
}

StateDict unpack(const std::string& bytes) {
  StateDict state;
  for (const Json& e : Json::from_cbor(std::vector<std::uint8_t>(bytes.begin(), bytes.end()))) {
    const std::string key = e.at("key").get<std::string>();
    if (e.contains("json")) {
      state.set(key, e.at("json"));
      continue;
    }
    const auto& data = e.at("data").get_binary();
    at::Tensor t =
        at::empty(e.at("shape").get<std::vector<std::int64_t>>(),
                  at::TensorOptions().dtype(static_cast<at::ScalarType>(e.at("dtype").get<int>())));
    if (static_cast<std::size_t>(t.nbytes()) != data.size()) {
      throw Error(ErrorCode::Corruption,
                  fmt::format("a process sent {} bytes for tensor {} of {} bytes", data.size(), key,
                              t.nbytes()));
    }
    std::memcpy(t.data_ptr(), data.data(), data.size());
    state.set(key, t);
  }
  return state;
}

// What differs between the processes of a fit: the RNG states and the running epoch's sums.
StateDict process_part(const detail::FitRun& run) {
  StateDict s;
  s.set_child("rng", RngState().state_dict());
  std::vector<std::string> names;
  for (const auto& [name, acc] : run.progress) {
    names.push_back(name);
    s.set_double("progress." + name + ".sum", acc.sum);
    s.set("progress." + name + ".count", acc.count);
  }
  s.set("progress_names", names);
  return s;
}

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
  if (run_ == nullptr || !run_->group) {
    save_file(path, checkpoint_contents(), env_or_default(env));
    return;
  }
  // Several processes: the main process writes one file holding every process's part.
  ProcessGroup& group = *run_->group;
  std::vector<std::string> parts = group.gather_strings(
      pack(process_part(*run_)), 0, fmt::format("save_checkpoint({}): every process's part", path));
  group.decided_by_main(
      [&] {
        save_file(path, contents_with_parts(parts), env_or_default(env));
        return std::string();
      },
      fmt::format("save_checkpoint({})", path));
}

Container Learner::contents_with_parts(const std::vector<std::string>& parts) const {
  StateDict state = StateDict::from_container(checkpoint_contents());
  state.set("processes.count", static_cast<std::int64_t>(parts.size()));
  for (std::size_t r = 0; r < parts.size(); ++r) {
    state.set_child(fmt::format("processes.{}", r), unpack(parts[r]));
  }
  return state.to_container();
}

SaveHandle Learner::save_checkpoint(const std::string& path, AsyncCheckpointer& saver) const {
  if (run_ == nullptr || !run_->group) return saver.save_file(path, checkpoint_contents());
  // Several processes: every process's part reaches the main process now (one small message
  // each, as in a synchronous save), and the main process stages the one file. Its background
  // thread writes it; every process's background thread learns the outcome from the main
  // process over a store connection of the background saves' own, so that every handle (and the
  // next save) gets the same error.
  ProcessGroup& group = *run_->group;
  std::vector<std::string> parts = group.gather_strings(
      pack(process_part(*run_)), 0, fmt::format("save_checkpoint({}): every process's part", path));
  if (!run_->save_channel) run_->save_channel = group.side_channel();
  std::vector<Component> file;
  if (group.rank() == 0) file.push_back({"learner", contents_with_parts(parts)});
  ProcessGroup* channel = run_->save_channel.get();
  Env* env = &env_or_default(run_->env);
  return saver.save_with(path, file, [channel, env, path](const std::vector<Component>& staged) {
    channel->decided_by_main(
        [&] {
          save_file(path, staged.at(0).contents, *env);
          return std::string();
        },
        fmt::format("save_checkpoint({}) in the background", path));
  });
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
  state.set(kOptimizerNames, Json(optimizers_.names()));
  state.set_child("optimizer", OptimizersPart{&optimizers_}.state_dict());
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
  StateDict state;
  std::exception_ptr failure;
  try {
    state = read_checkpoint(path, env_or_default(env));
  } catch (const std::exception&) {
    if (run_ == nullptr || !run_->group) throw;
    failure = std::current_exception();
  }
  // Several processes: nothing changes on any of them unless every one could read it.
  if (run_ != nullptr && run_->group) {
    run_->group->agree(failure, fmt::format("restore_checkpoint({})", path));
  }
  const int rank = run_ != nullptr && run_->group ? run_->group->rank() : 0;
  const int processes = run_ != nullptr && run_->group ? run_->group->size() : 1;
  const std::int64_t saved_processes =
      state.contains("processes.count") ? state.get<std::int64_t>("processes.count") : 1;
  if (saved_processes > 1 && what.position()) {
    // This process's RNG states; one the file has none for takes rank 0's (reseeded below).
    const std::string own = fmt::format("processes.{}", rank < saved_processes ? rank : 0);
    state.set_child("rng", state.child(own + ".rng"));
  }
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
    check_optimizer_names(path, state, optimizers_);
    select("optimizer");
    set.add("optimizer", OptimizersPart{&optimizers_});
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
  if (saved_processes > 1 && what.position()) {
    // The running epoch's sums: this process's own on the same number of processes; otherwise
    // rank 0 takes the sum of every saved process's and the others start at zero, so that the
    // epoch's metrics (summed over the processes) are unchanged.
    std::map<std::string, detail::Accumulator> progress;
    for (std::int64_t r = 0; r < saved_processes; ++r) {
      if (processes == saved_processes ? r != rank : rank != 0) continue;
      StateDict part = state.child(fmt::format("processes.{}", r));
      for (const std::string& name : part.get<std::vector<std::string>>("progress_names")) {
        progress[name].sum += part.get_double("progress." + name + ".sum");
        progress[name].count += part.get<std::int64_t>("progress." + name + ".count");
      }
    }
    run_->progress = std::move(progress);
    if (rank >= saved_processes) {
      at::Generator generator = at::detail::getDefaultCPUGenerator();
      std::lock_guard<std::mutex> lock(generator.mutex());
      generator.set_current_seed(generator.current_seed() + static_cast<std::uint64_t>(rank));
    }
    if (processes != saved_processes && rank == 0) {
      run_->ctx.warn(fmt::format(
          "{} was saved by {} process(es) and is restored by {}: the epoch continues with no "
          "sample repeated or skipped, but its batches differ from the saved run's from here on",
          path, saved_processes, processes));
    }
  }
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
