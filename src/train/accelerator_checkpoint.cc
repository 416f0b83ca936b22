// The Accelerator's checkpointing: save_state (one process, or every process writing its own
// files and the main process committing), retention after a save (total_limit), load_state
// step by step, and the import of a directory written by Python Accelerate.
#include <fmt/format.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdio>
#include <exception>
#include <map>
#include <optional>
#include <set>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

#include "checkpoint/committed.h"
#include "compat/torch_compat.h"
#include "dist/zero.h"
#include "format/zero_shards.h"
#include "format/directory_fill.h"
#include "format/directory_save.h"
#include "format/fresh_read.h"
#include "format/shards.h"
#include "io/atomic_commit.h"
#include "io/filename.h"
#include "python/accelerate_files.h"
#include "torchpoint/accelerate_interop.h"
#include "torchpoint/accelerator.h"
#include "torchpoint/checkpoint_dir.h"
#include "torchpoint/checkpoint_manager.h"
#include "torchpoint/error.h"
#include "torchpoint/inspect.h"
#include "torchpoint/module_state.h"
#include "torchpoint/retention.h"
#include "torchpoint/stateful_set.h"

namespace torchpoint {
namespace {

// The RNG file of process `rank`: random_states_<rank>, as Accelerate names it.
std::string random_states_name(int rank) { return fmt::format("{}{}", detail::kRngPrefix, rank); }

std::string join_names(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out;
}

// A model's state as a save hook left it: written as it is.
struct HookedModelState {
  StateDict state;
  StateDict state_dict() const { return state; }
  void load_state_dict(const StateDict&) {
    throw Error(ErrorCode::Unsupported, "a save hook's model state is never loaded into");
  }
};

}  // namespace

// For one save or load, the components and models the hooks left in place of the prepared
// ones: swapped in at construction, swapped back at destruction (also when the save or load
// throws), so that everything between sees and names only those.
struct Accelerator::HookedComponents {
  Accelerator& acc;
  std::vector<Component> components;
  ModelList models;

  HookedComponents(Accelerator& a, std::vector<Component> c, ModelList m)
      : acc(a), components(std::move(c)), models(std::move(m)) {
    std::swap(acc.components_, components);
    std::swap(acc.models_, models);
  }
  ~HookedComponents() {
    std::swap(acc.components_, components);
    std::swap(acc.models_, models);
  }
  HookedComponents(const HookedComponents&) = delete;
  HookedComponents& operator=(const HookedComponents&) = delete;

  // What a save writes after its hooks ran on the main (or a node's local main) process: the
  // model states the hooks left, as components, and the models they stand for.
  static void swap_in(std::optional<HookedComponents>& out, Accelerator& acc,
                      SavedModels& saved) {
    out.emplace(acc,
                acc.components_with_models(saved.weights.size(),
                                           [&](std::size_t j) {
                                             return AnyStateful::value(
                                                 HookedModelState{saved.weights[j]});
                                           }),
                ModelList(acc.models_.begin(),
                          acc.models_.begin() + static_cast<std::ptrdiff_t>(saved.weights.size())));
  }

  // With several processes, after the writers opened the checkpoint in `dir`: the other
  // processes run the save hooks there too, as Accelerate does on every process, then the
  // writers (`save` non-null) list the files all the hooks wrote. Every process throws when any
  // failed.
  // With `kept`, a process that is not a writer keeps there what its hooks left.
  static void run_on_the_others(Accelerator& acc, bool writer, const std::string& dir,
                                DirectorySave* save, const std::string& about,
                                SavedModels* kept = nullptr) {
    std::exception_ptr failure;
    try {
      if (!writer) {
        SavedModels theirs;
        acc.run_save_hooks(acc.save_hooks_->snapshot(), dir, kept ? *kept : theirs);
      }
    } catch (const std::exception&) {
      failure = std::current_exception();
    }
    acc.group_->agree(failure, about + ": the save hooks (nothing was committed)");
    failure = nullptr;
    try {
      if (save != nullptr) save->collect_hook_files();
    } catch (const std::exception&) {
      failure = std::current_exception();
    }
    acc.group_->agree(failure, about + ": the files of the save hooks (nothing was committed)");
  }
};

std::vector<Accelerator::Component> Accelerator::components_with_models(
    std::size_t count, const std::function<AnyStateful(std::size_t)>& model) const {
  std::vector<Component> out;
  std::size_t seen = 0;
  for (const Component& c : components_) {
    if (c.kind != "model") {
      out.push_back(c);
    } else if (seen < count) {
      out.push_back({c.kind, model(seen++)});
    } else {
      ++seen;
    }
  }
  return out;
}

void Accelerator::run_save_hooks(const std::vector<detail::HookList::Hook>& hooks,
                                 const std::string& dir, SavedModels& saved) {
  saved.models = models_;
  for (const auto& m : models_) saved.weights.push_back(module_state_dict(*m));
  for (const auto& hook : hooks) hook(saved.models, &saved.weights, dir);
  if (saved.weights.size() > models_.size()) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("a save hook left {} model states for {} prepared models: a hook may "
                            "change or erase states, not add them",
                            saved.weights.size(), models_.size()));
  }
}

std::string Accelerator::checkpoints_dir() const {
  if (config_.project_dir().empty()) {
    throw Error(ErrorCode::InvalidArgument,
                "automatic checkpoint naming needs a project directory: "
                "ProjectConfiguration().project_dir(\"runs/exp1\")");
  }
  return join_path(config_.project_dir(), "checkpoints");
}

std::vector<std::pair<std::int64_t, std::string>> Accelerator::list_checkpoints() const {
  std::vector<std::pair<std::int64_t, std::string>> out;
  for (auto& [number, path] : detail::committed_checkpoints(checkpoints_dir(), env_)) {
    out.emplace_back(static_cast<std::int64_t>(number), std::move(path));
  }
  return out;
}

namespace {

// Under ZeRO, for the length of a save: each sharded optimizer's whole state in the user's
// optimizer, which the save writes as an unsharded run's (a collective, on every process).
struct GatheredZeroState {
  explicit GatheredZeroState(const std::vector<std::unique_ptr<detail::ZeroOptimizer>>& zero)
      : zero_(zero) {
    for (const auto& z : zero_) {
      if (z) z->gather_into_user();
    }
  }
  ~GatheredZeroState() {
    for (const auto& z : zero_) {
      if (z) z->clear_user_state();
    }
  }
  const std::vector<std::unique_ptr<detail::ZeroOptimizer>>& zero_;
};

// The shard size that splits `models` into about two shards per process (no more than
// `shard_size`), so that dealing whole shards by bytes leaves each process near 1/N.
std::uint64_t split_shard_size(const std::vector<torchpoint::Component>& models, int world,
                               std::uint64_t shard_size) {
  std::uint64_t total = 0;
  for (const torchpoint::Component& m : models) {
    for (const auto& [name, tensor] : m.contents.tensors) total += tensor_bytes(tensor);
  }
  const std::uint64_t parts = 2 * static_cast<std::uint64_t>(world);
  const std::uint64_t split = std::max<std::uint64_t>(1, (total + parts - 1) / parts);
  return shard_size == 0 ? split : std::min(shard_size, split);
}

std::uint64_t bytes_written(const std::vector<WrittenComponent>& files) {
  std::uint64_t bytes = 0;
  for (const WrittenComponent& f : files) bytes += f.linked ? 0 : f.size;
  return bytes;
}

// Orders the files that several processes wrote as one writer lists them: components in the
// order they first appear, each one's shards in order, the shard indexes last.
void sort_as_one_writer(std::vector<WrittenComponent>& files) {
  std::unordered_map<std::string, std::size_t> first;
  for (const WrittenComponent& f : files) first.emplace(f.component, first.size());
  std::stable_sort(files.begin(), files.end(),
                   [&](const WrittenComponent& a, const WrittenComponent& b) {
                     return std::tuple(a.index, first.at(a.component), a.shard) <
                            std::tuple(b.index, first.at(b.component), b.shard);
                   });
}

}  // namespace

std::vector<std::pair<std::string, detail::ZeroOptimizer*>> Accelerator::sharded(
    const std::vector<std::string>& names) const {
  std::vector<std::pair<std::string, detail::ZeroOptimizer*>> out;
  for (std::size_t i = 0, k = 0; i < components_.size(); ++i) {
    if (components_[i].kind != "optimizer") continue;
    if (k < zero_.size() && zero_[k]) out.emplace_back(names[i], zero_[k].get());
    ++k;
  }
  return out;
}

std::vector<std::string> Accelerator::zero_shard_names(const std::vector<std::string>& names,
                                                       int world) const {
  std::vector<std::string> out;
  for (const auto& [name, zero] : sharded(names)) {
    for (int r = 0; r < world; ++r) out.push_back(detail::zero_shard_name(name, r));
  }
  return out;
}

std::vector<torchpoint::Component> Accelerator::zero_shards(
    const std::vector<std::string>& names) const {
  std::vector<torchpoint::Component> out;
  for (const auto& [name, zero] : sharded(names)) {
    out.push_back({detail::zero_shard_name(name, zero->rank()), zero->shard_state().to_container()});
  }
  return out;
}

Json Accelerator::zero_layouts(const std::vector<std::string>& names) const {
  Json out = Json::array();
  for (const auto& [name, zero] : sharded(names)) out.push_back(zero->layout(name).to_json());
  return out;
}

namespace {

// The files every rank reported writing (`reports`, by rank), in rank order, or, when the ranks
// shared the models' files, in the order one writer would have listed them.
std::vector<WrittenComponent> reported_files(const std::vector<std::string>& reports,
                                             bool shared_models) {
  std::vector<WrittenComponent> written;
  for (std::size_t r = 0; r < reports.size(); ++r) {
    for (const Json& f : Json::parse(reports[r])) {
      written.push_back(WrittenComponent::from_json(f, fmt::format("rank {}", r)));
    }
  }
  if (shared_models) sort_as_one_writer(written);
  return written;
}

}  // namespace

std::string Accelerator::save_state(const std::string& output_dir, bool overwrite) {
  wait_for_checkpoint();
  if (group_ && saves_per_node()) {
    // Each node's checkpoint must be whole on its own: the optimizer state is gathered into
    // every process for the save and written unsharded by each node's local main process.
    GatheredZeroState gathered(zero_);
    return save_state_per_node(output_dir, overwrite);
  }
  if (group_) return save_state_distributed(output_dir, overwrite);
  return save_state_with(output_dir, overwrite, nullptr, nullptr);
}

SaveHandle Accelerator::save_state_async(const std::string& output_dir, bool overwrite) {
  if (group_ && saves_per_node()) {
    throw Error(ErrorCode::Unsupported,
                "save_state_async() with save_on_each_node on several nodes: every node writes "
                "a whole copy, which only save_state() does; call save_state()");
  }
  if (save_hooks_->any_sees_models()) {
    throw Error(ErrorCode::Unsupported,
                "save_state_async() with a save hook that takes the models and their weights: "
                "the weights are staged before the hooks run in the background, so a hook's "
                "changes could not reach the checkpoint. Call save_state(), or register a hook "
                "that takes the directory only");
  }
  if (!async_) async_ = std::make_unique<AsyncCheckpointer>(env_);
  if (group_) return save_state_async_distributed(output_dir, overwrite);
  SaveHandle handle;
  save_state_with(output_dir, overwrite, async_.get(), &handle);
  return handle;
}

// save_state_distributed() in the background. In the foreground, every process stages what it
// writes (the main process the replicated components unless ZeRO splits the models, every
// process its RNG state and its ZeRO shards, and under ZeRO only the model shards dealt to it)
// and fills in the manifest's metadata. On its background thread, over a connection of its own
// (save_channel_), the exchanges of save_state_distributed() follow in the same order: the main
// process opens the checkpoint and runs its save hooks (directory-only), the others run theirs
// in the same directory, every process writes its files, all agree, and the main process
// commits with every process's report. The foreground makes no message at all.
SaveHandle Accelerator::save_state_async_distributed(const std::string& output_dir,
                                                     bool overwrite) {
  async_->wait();  // the previous save's error first: every process got the same
  const bool automatic = output_dir.empty();
  const std::string path = begin_save(output_dir);
  const int rank = group_->rank(), world = group_->size();
  if (!save_channel_) save_channel_ = group_->side_channel();
  const std::vector<std::string> names = component_names();
  SaveDirectoryOptions options = directory_options(overwrite);
  const bool split_models = zero_stage_ != 0;

  std::vector<torchpoint::Component> files;  // what this process writes: its own, then models
  for (std::size_t i = 0; i < components_.size(); ++i) {
    if (rank == 0 && !(split_models && components_[i].kind == "model")) {
      files.push_back({names[i], components_[i].object.state_dict().to_container()});
    }
  }
  files.push_back({random_states_name(rank), rng_.state_dict().to_container()});
  for (auto& shard : zero_shards(names)) files.push_back(std::move(shard));
  const std::size_t own = files.size();
  SaveDirectoryOptions shared = options;
  std::unordered_set<std::string> my_model_tensors;
  if (split_models) {
    std::vector<torchpoint::Component> models;
    for (std::size_t i = 0; i < components_.size(); ++i) {
      if (components_[i].kind == "model") {
        models.push_back({names[i], components_[i].object.state_dict().to_container()});
      }
    }
    shared.shard_size = split_shard_size(models, world, options.shard_size);
    my_model_tensors = tensors_of_part(models, shared, {rank, world});
    for (auto& m : models) files.push_back(std::move(m));
  }

  std::vector<std::string> all = names;
  for (int r = 0; r < world; ++r) all.push_back(random_states_name(r));
  for (std::string& shard : zero_shard_names(names, world)) all.push_back(std::move(shard));
  CheckpointInfo info;
  info.step = step_;
  info.iteration = config_.iteration();
  info.metadata = {
      {"accelerator", {{"step", step_}, {"components", names}, {"world_size", world}}}};
  if (!logged_metrics_.empty()) info.metadata["metrics"] = logged_metrics_;
  if (Json layouts = zero_layouts(names); !layouts.empty()) info.metadata["zero"] = layouts;
  std::vector<detail::HookList::Hook> hooks = save_hooks_->snapshot();
  if (rank == 0 && !hooks.empty()) {
    options.before_components = [hooks](const std::string& dir) {
      ModelList none;
      for (const auto& hook : hooks) hook(none, nullptr, dir);
    };
  }
  if (automatic) config_.iteration(config_.iteration() + 1);
  last_checkpoint_ = path;

  ProcessGroup* channel = save_channel_.get();
  Env* env = &env_;
  auto write = [this, channel, env, rank, world, path, automatic, all, own, options, shared,
                info, hooks, split_models](const std::vector<torchpoint::Component>& staged) {
    // 1. The main process opens the checkpoint and runs its hooks.
    std::unique_ptr<DirectorySave> save;
    const std::string dir = channel->decided_by_main(
        [&] {
          save = std::make_unique<DirectorySave>(*env, path, all, options);
          return save->temp_path();
        },
        "save_state_async(): opening the checkpoint directory");
    const std::string about = fmt::format("save_state_async() of {}", path);
    if (!hooks.empty()) {
      std::exception_ptr failure;
      try {
        ModelList none;
        if (rank != 0) {
          for (const auto& hook : hooks) hook(none, nullptr, dir);
        }
      } catch (const std::exception&) {
        failure = std::current_exception();
      }
      channel->agree(failure, about + ": the save hooks (nothing was committed)");
      failure = nullptr;
      try {
        if (save) save->collect_hook_files();
      } catch (const std::exception&) {
        failure = std::current_exception();
      }
      channel->agree(failure, about + ": the files of the save hooks (nothing was committed)");
    }
    // 2. Every process writes its files.
    Json reported = Json::array();
    std::exception_ptr failure;
    try {
      std::vector<torchpoint::Component> mine(staged.begin(),
                                              staged.begin() + static_cast<std::ptrdiff_t>(own));
      std::vector<torchpoint::Component> models(
          staged.begin() + static_cast<std::ptrdiff_t>(own), staged.end());
      LinkSource link_source(*env, rank == 0 ? options.link_from : std::string());
      std::vector<WrittenComponent> written =
          write_components(*env, dir, mine, options, &link_source);
      if (!models.empty()) {
        LinkSource shared_link_source(*env, options.link_from);
        for (WrittenComponent& f :
             write_components(*env, dir, models, shared, &shared_link_source, {rank, world})) {
          written.push_back(std::move(f));
        }
      }
      for (const WrittenComponent& f : written) reported.push_back(f.to_json());
    } catch (const std::exception&) {
      failure = std::current_exception();
    }
    channel->agree(failure, about + " (nothing was committed)");
    // 3. The main process commits with every process's report.
    std::vector<std::string> reports =
        channel->gather_strings(reported.dump(), 0, "save_state_async(): sending the files written");
    channel->decided_by_main(
        [&]() -> std::string {
          save->commit(reported_files(reports, split_models), info);
          save.reset();  // releases the lock before retention takes it
          if (automatic) apply_total_limit(path);
          return "";
        },
        "save_state_async(): committing the checkpoint");
  };
  AsyncCheckpointer::StageFilter stage;
  if (split_models) {
    // Of the models, only the tensors this process writes.
    std::unordered_set<std::string> model_names;
    for (std::size_t i = own; i < files.size(); ++i) model_names.insert(files[i].name);
    stage = [model_names = std::move(model_names), mine = std::move(my_model_tensors)](
                const std::string& component, const std::string& tensor) {
      return !model_names.count(component) || mine.count(component + "/" + tensor) > 0;
    };
  }
  return async_->save_with(path, files, std::move(write), stage);
}

void Accelerator::wait_for_checkpoint() {
  if (async_) async_->wait();
}

std::string Accelerator::begin_save(const std::string& output_dir) {
  if (output_dir.empty() && !config_.automatic_checkpoint_naming()) {
    throw Error(ErrorCode::InvalidArgument,
                "save_state() needs an output directory: pass one, or use "
                "ProjectConfiguration().project_dir(...).automatic_checkpoint_naming(true)");
  }
  if (!sync_gradients_ || unsynced_backward_) {
    throw Error(
        ErrorCode::InvalidArgument,
        !sync_gradients_
            ? fmt::format("save_state() on iteration {} of a gradient accumulation over {}, "
                          "which does not step: the gradients accumulated since the last "
                          "optimizer step are not part of a checkpoint, so a run resumed from "
                          "it would lose them; save when acc.sync_gradients() is true",
                          accumulation_count_ % accumulation_steps_, accumulation_steps_)
            : std::string("save_state() after a backward() under no_sync() that no "
                          "synchronized backward() or optimizer step followed: those "
                          "gradients are not part of a checkpoint, so a run resumed from it "
                          "would lose them; save after the optimizer step"));
  }
  check_no_step_on_scaled_gradients(/*saving=*/true);
  warn_about_uncounted_backwards();
  return output_dir.empty() ? join_path(checkpoints_dir(), checkpoint_name(config_.iteration()))
                            : output_dir;
}

SaveDirectoryOptions Accelerator::directory_options(bool overwrite) const {
  SaveDirectoryOptions options;
  options.overwrite = overwrite;
  options.shard_size = config_.shard_size();
  if (config_.incremental()) options.link_from = last_checkpoint_;
  // The tensors no optimizer step changes: frozen parameters and buffers (Accelerate's and
  // Hugging Face's sharding keeps none apart; here they fill shards that can be shared).
  std::vector<std::string> names = component_names();
  std::size_t model = 0;
  for (std::size_t i = 0; i < components_.size(); ++i) {
    if (components_[i].kind != "model" || model >= models_.size()) continue;
    const torch::nn::Module& module = *models_[model++];
    for (const auto& item : module.named_parameters(/*recurse=*/true)) {
      if (!item.value().requires_grad()) options.frozen.insert(names[i] + "/" + item.key());
    }
    for (const auto& item : module.named_buffers(/*recurse=*/true)) {
      options.frozen.insert(names[i] + "/" + item.key());
    }
  }
  return options;
}

std::string Accelerator::save_state_with(const std::string& output_dir, bool overwrite,
                                         AsyncCheckpointer* saver, SaveHandle* handle) {
  if (saver != nullptr) saver->wait();  // the previous save's error first, if nobody took it
  const bool automatic = output_dir.empty();
  const std::string path = begin_save(output_dir);

  std::vector<std::string> names = component_names();
  SaveDirectoryOptions options = directory_options(overwrite);
  CheckpointInfo info;
  info.step = step_;
  info.iteration = config_.iteration();
  if (!logged_metrics_.empty()) info.metadata["metrics"] = logged_metrics_;
  auto files_of = [&](const std::vector<std::string>& stems) {
    std::vector<torchpoint::Component> files;
    files.reserve(components_.size() + 1);
    for (std::size_t i = 0; i < components_.size(); ++i) {
      files.push_back({stems[i], components_[i].object.state_dict().to_container()});
    }
    files.push_back({random_states_name(0), rng_.state_dict().to_container()});
    for (auto& shard : zero_shards(stems)) files.push_back(std::move(shard));
    return files;
  };
  if (Json layouts = zero_layouts(names); !layouts.empty()) info.metadata["zero"] = layouts;
  if (saver != nullptr) {
    // The hooks take the directory only (save_state_async checked): they run in the background
    // on a copy of the list, while the loop may register or remove some.
    if (!save_hooks_->hooks.empty()) {
      options.before_components = [hooks = save_hooks_->snapshot()](const std::string& dir) {
        ModelList none;
        for (const auto& hook : hooks) hook(none, nullptr, dir);
      };
    }
    info.metadata["accelerator"] = {{"step", step_}, {"components", names}};
    std::vector<torchpoint::Component> files = files_of(names);
    std::function<void()> after_commit;
    if (automatic) after_commit = [this, path] { apply_total_limit(path); };
    *handle = saver->save_directory(path, files, info, options, std::move(after_commit));
    if (automatic) config_.iteration(config_.iteration() + 1);
    // The next save waits for this one first; if it failed, the next finds nothing to link.
    last_checkpoint_ = path;
    return path;
  }
  // Synchronous: the hooks run in the checkpoint's temporary directory with the models and their
  // states; the components are what they left.
  SavedModels saved;
  if (!save_hooks_->hooks.empty()) {
    options.before_components = [&, hooks = save_hooks_->snapshot()](const std::string& dir) {
      run_save_hooks(hooks, dir, saved);
    };
  }
  {
    std::vector<std::string> all = names;
    all.push_back(random_states_name(0));
    for (std::string& shard : zero_shard_names(names, 1)) all.push_back(std::move(shard));
    DirectorySave save(env_, path, all, options);
    std::optional<HookedComponents> hooked;
    if (!save_hooks_->hooks.empty()) {
      HookedComponents::swap_in(hooked, *this, saved);
      names = component_names();
      all = names;
      all.push_back(random_states_name(0));
      for (std::string& shard : zero_shard_names(names, 1)) all.push_back(std::move(shard));
      save.set_component_names(all);
    }
    info.metadata["accelerator"] = {{"step", step_}, {"components", names}};
    LinkSource link_source(env_, options.link_from);
    std::vector<WrittenComponent> written =
        write_components(env_, save.temp_path(), files_of(names), options, &link_source);
    save.commit(written, info);
    last_save_bytes_written_ = bytes_written(written);
  }  // releases the lock before retention takes it
  last_checkpoint_ = path;

  if (automatic) {
    config_.iteration(config_.iteration() + 1);
    apply_total_limit(path);
  }
  return path;
}

std::string Accelerator::save_state_distributed(const std::string& output_dir, bool overwrite) {
  const bool automatic = output_dir.empty();
  const std::string path = begin_save(output_dir);
  const int rank = group_->rank(), world = group_->size();
  std::vector<std::string> names = component_names();
  SaveDirectoryOptions options = directory_options(overwrite);
  // Every process runs the save hooks, as Accelerate does, in the one temporary directory, with
  // its models and their states: the main process while it opens the checkpoint, the others once
  // it is open and before anything is written. The main process writes the components its hooks
  // left (the others' changes to their weights are theirs to look at); the files any process's
  // hooks wrote are committed with the checkpoint (a hook that writes one name on every process
  // should write it on the main process only).
  SavedModels saved;
  if (rank == 0 && !save_hooks_->hooks.empty()) {
    options.before_components = [&, hooks = save_hooks_->snapshot()](const std::string& dir) {
      run_save_hooks(hooks, dir, saved);
    };
  }
  std::optional<HookedComponents> hooked;

  // 1. The main process opens the checkpoint: the lock, a temporary directory, the save hooks.
  std::unique_ptr<DirectorySave> save;
  Json opened = Json::parse(group_->decided_by_main(
      [&] {
        std::vector<std::string> all = names;
        for (int r = 0; r < world; ++r) all.push_back(random_states_name(r));
        for (std::string& shard : zero_shard_names(names, world)) all.push_back(std::move(shard));
        save = std::make_unique<DirectorySave>(env_, path, all, options);
        if (!save_hooks_->hooks.empty()) {
          HookedComponents::swap_in(hooked, *this, saved);
          names = component_names();
          all = names;
          for (int r = 0; r < world; ++r) all.push_back(random_states_name(r));
          for (std::string& shard : zero_shard_names(names, world)) {
            all.push_back(std::move(shard));
          }
          save->set_component_names(all);
        }
        return Json{{"dir", save->temp_path()},
                    {"path", path},
                    {"names", names},
                    {"models", save_hooks_->hooks.empty() ? models_.size() : saved.weights.size()}}
            .dump();
      },
      "save_state(): opening the checkpoint directory"));
  // From here a number is used up, as by an asynchronous save: one that fails leaves it unused.
  if (automatic) config_.iteration(config_.iteration() + 1);
  const bool split_models = zero_stage_ != 0;
  SavedModels theirs;
  if (!save_hooks_->hooks.empty()) {
    HookedComponents::run_on_the_others(*this, rank == 0, opened.at("dir").get<std::string>(),
                                        save.get(), fmt::format("save_state() of {}", path),
                                        split_models ? &theirs : nullptr);
  }

  // 2. Every process writes and fsyncs its own files there: the main process the components,
  // each process its RNG states. All succeed, or every process throws (and the main process's
  // DirectorySave removes the temporary directory). Under ZeRO every process also writes its
  // part of the optimizer state, and the models (the same on every process) are split into
  // shards that the processes share out by bytes, so that none writes much more than 1/N.
  // With save hooks, each process writes the model states its own hooks left, of the models
  // the main process's hooks left (hooks that treat every process alike leave the same).
  Json files = Json::array();
  std::uint64_t written_bytes = 0;
  std::exception_ptr failure;
  try {
    const std::string dir = opened.at("dir").get<std::string>();
    if (split_models && rank != 0 && !save_hooks_->hooks.empty()) {
      const std::size_t count = opened.at("models").get<std::size_t>();
      if (theirs.weights.size() < count) {
        throw Error(ErrorCode::InvalidArgument,
                    fmt::format("save_state() of {}: the save hooks left {} model states on "
                                "process {} but {} on the main process; under ZeRO every "
                                "process writes part of the models, so the hooks must leave "
                                "the same models on every process",
                                path, theirs.weights.size(), rank, count));
      }
      theirs.weights.resize(count);
      HookedComponents::swap_in(hooked, *this, theirs);
      names = component_names();
    }
    if (split_models && names != opened.at("names").get<std::vector<std::string>>()) {
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("save_state() of {}: process {} would save the components {} but "
                              "the main process {}; every process must prepare and register "
                              "the same objects in the same order",
                              path, rank, Json(names).dump(), opened.at("names").dump()));
    }
    std::vector<torchpoint::Component> mine, models;
    for (std::size_t i = 0; i < components_.size(); ++i) {
      if (split_models && components_[i].kind == "model") {
        models.push_back({names[i], components_[i].object.state_dict().to_container()});
      } else if (rank == 0) {
        mine.push_back({names[i], components_[i].object.state_dict().to_container()});
      }
    }
    mine.push_back({random_states_name(rank), rng_.state_dict().to_container()});
    for (auto& shard : zero_shards(names)) mine.push_back(std::move(shard));
    LinkSource link_source(env_, rank == 0 ? options.link_from : std::string());
    std::vector<WrittenComponent> written =
        write_components(env_, dir, mine, options, &link_source);
    if (!models.empty()) {
      SaveDirectoryOptions shared = options;
      shared.shard_size = split_shard_size(models, world, options.shard_size);
      LinkSource shared_link_source(env_, options.link_from);
      for (WrittenComponent& f : write_components(env_, dir, models, shared,
                                                  &shared_link_source, {rank, world})) {
        written.push_back(std::move(f));
      }
    }
    written_bytes = bytes_written(written);
    for (const WrittenComponent& f : written) files.push_back(f.to_json());
  } catch (const std::exception&) {
    failure = std::current_exception();
  }
  group_->agree(failure, fmt::format("save_state() of {} (nothing was committed)", path));

  // 3. The main process, holding every process's report of what it wrote (sizes and checksums),
  // writes the manifest listing them all and commits.
  std::vector<std::string> reports =
      group_->gather_strings(files.dump(), 0, "save_state(): sending the files written");
  group_->decided_by_main(
      [&]() -> std::string {
        std::vector<WrittenComponent> written = reported_files(reports, split_models);
        CheckpointInfo info;
        info.step = step_;
        info.iteration = config_.iteration() - (automatic ? 1 : 0);
        info.metadata = {
            {"accelerator", {{"step", step_}, {"components", names}, {"world_size", world}}}};
        if (!logged_metrics_.empty()) info.metadata["metrics"] = logged_metrics_;
        if (Json layouts = zero_layouts(names); !layouts.empty()) info.metadata["zero"] = layouts;
        save->commit(written, info);
        save.reset();  // releases the lock before retention takes it
        if (automatic) apply_total_limit(path);
        return "";
      },
      "save_state(): committing the checkpoint");
  hooked.reset();
  last_checkpoint_ = opened.at("path").get<std::string>();
  last_save_bytes_written_ = written_bytes;
  return last_checkpoint_;
}

// save_on_each_node on several nodes: save_state_distributed() with the local main process of
// every node in the main process's place, each writing a complete checkpoint on its own node's
// disk (the components once per node; the RNG states of that node's processes). Every writer
// announces its temporary directory to every process, which costs one message per node and rank;
// the commit is agreed: every node commits, or the nodes that did take their copy back, and a
// load takes only a checkpoint every node holds (load_state() chooses the newest such one).
std::string Accelerator::save_state_per_node(const std::string& output_dir, bool overwrite) {
  const bool automatic = output_dir.empty();
  const std::string path = begin_save(output_dir);
  const int rank = group_->rank(), world = group_->size(), local = group_->local_size();
  const int node = rank / local, nodes = world / local, first = node * local;
  const bool writer = group_->local_rank() == 0;
  std::vector<std::string> names = component_names();
  auto file_names = [&] {
    std::vector<std::string> all = names;
    for (int r = first; r < first + local; ++r) all.push_back(random_states_name(r));
    return all;
  };
  SaveDirectoryOptions options = directory_options(overwrite);
  SavedModels saved;
  if (writer && !save_hooks_->hooks.empty()) {
    options.before_components = [&, hooks = save_hooks_->snapshot()](const std::string& dir) {
      run_save_hooks(hooks, dir, saved);
    };
  }
  std::optional<HookedComponents> hooked;
  const std::string about = fmt::format("save_state() of {} on every node", path);

  // 1. Each node's local main process opens its checkpoint: lock, temporary directory, hooks.
  std::unique_ptr<DirectorySave> save;
  std::exception_ptr failure;
  try {
    if (writer) {
      save = std::make_unique<DirectorySave>(env_, path, file_names(), options);
      if (!save_hooks_->hooks.empty()) {
        HookedComponents::swap_in(hooked, *this, saved);
        names = component_names();
        save->set_component_names(file_names());
      }
    }
  } catch (const std::exception&) {
    failure = std::current_exception();
  }
  group_->agree(failure, about + ": opening the checkpoint directories (nothing was committed)");
  std::string dir;
  for (int n = 0; n < nodes; ++n) {
    std::string d = group_->broadcast_string(save ? save->temp_path() : "", n * local,
                                             "save_state(): the temporary directory of a node");
    if (n == node) dir = d;
  }
  if (automatic) config_.iteration(config_.iteration() + 1);

  // 2. The other processes' hooks, in their node's directory; then each writer lists the files.
  if (!save_hooks_->hooks.empty()) {
    HookedComponents::run_on_the_others(*this, writer, dir, save.get(), about);
  }

  // 3. Every process writes its files into its node's directory.
  Json files = Json::array();
  failure = nullptr;
  try {
    std::vector<torchpoint::Component> mine;
    if (writer) {
      for (std::size_t i = 0; i < components_.size(); ++i) {
        mine.push_back({names[i], components_[i].object.state_dict().to_container()});
      }
    }
    mine.push_back({random_states_name(rank), rng_.state_dict().to_container()});
    LinkSource link_source(env_, writer ? options.link_from : std::string());
    std::vector<WrittenComponent> written =
        write_components(env_, dir, mine, options, &link_source);
    last_save_bytes_written_ = bytes_written(written);
    for (const WrittenComponent& f : written) files.push_back(f.to_json());
  } catch (const std::exception&) {
    failure = std::current_exception();
  }
  group_->agree(failure, about + " (nothing was committed)");
  std::vector<std::string> reports =
      group_->allgather_strings(files.dump(), "save_state(): sending the files written");

  // 4. Each writer commits its node's checkpoint; all agree, or the ones that committed take
  // theirs back.
  failure = nullptr;
  bool committed = false;
  try {
    if (writer) {
      std::vector<WrittenComponent> written;
      for (int r = first; r < first + local; ++r) {
        for (const Json& f : Json::parse(reports[static_cast<std::size_t>(r)])) {
          written.push_back(WrittenComponent::from_json(f, fmt::format("rank {}", r)));
        }
      }
      CheckpointInfo info;
      info.step = step_;
      info.iteration = config_.iteration() - (automatic ? 1 : 0);
      Json ranks = Json::array();
      for (int r = first; r < first + local; ++r) ranks.push_back(r);
      info.metadata = {{"accelerator",
                        {{"step", step_},
                         {"components", names},
                         {"world_size", world},
                         {"node", {{"index", node}, {"count", nodes}, {"ranks", ranks}}}}}};
      if (!logged_metrics_.empty()) info.metadata["metrics"] = logged_metrics_;
      save->commit(written, info);
      committed = true;
      save.reset();
    }
  } catch (const std::exception&) {
    failure = std::current_exception();
  }
  try {
    group_->agree(failure, about + ": committing (no node keeps it)");
  } catch (const std::exception&) {
    if (committed) {
      ListedCheckpoint mine;
      mine.name = base_name(path);
      mine.path = path;
      mine.is_directory = true;
      try {
        remove_checkpoint(parent_path(path), mine, env_);
      } catch (const std::exception&) {
        // A load takes only a checkpoint every node holds: this copy is never chosen.
      }
    }
    throw;
  }
  if (writer && automatic) apply_total_limit(path);
  hooked.reset();
  last_checkpoint_ = path;
  return path;
}

void Accelerator::apply_total_limit(const std::string& just_written) {
  if (!config_.total_limit()) return;
  std::string dir = checkpoints_dir();
  ProjectLock lock(env_, dir);
  auto all = list_checkpoints();
  const auto limit = static_cast<std::size_t>(*config_.total_limit());
  if (all.size() <= limit) return;
  std::optional<std::uint64_t> resumed_number;
  if (!resumed_from_.empty()) resumed_number = parse_checkpoint_name(base_name(resumed_from_));
  // The library's retention policy with keep_last = total_limit. Committed checkpoints count
  // as valid without being read (verifying every one at each save would read them all), except
  // those that were there, newer than the one this run resumed from (after load_state() of an
  // older one): they hold progress this run lacks, so they are pinned, unless their own
  // checksums prove them corrupt, in which case they go. The checkpoint resumed from is not
  // pinned: total_limit is a maximum.
  std::vector<RetentionEntry> entries;
  for (const auto& [number, path] : all) {
    RetentionEntry e;
    e.name = path;
    const bool newer_than_resumed = resumed_number &&
                                    static_cast<std::uint64_t>(number) > *resumed_number &&
                                    number < first_own_number_ && path != just_written;
    if (newer_than_resumed) {
      if (verify(path, env_).proven_corrupt()) {
        e.status = CheckpointStatus::Corrupt;
      } else {
        e.pinned = "newer than the checkpoint this run resumed from";
      }
    }
    entries.push_back(std::move(e));
  }
  std::vector<RetentionDecision> decisions =
      plan_retention(entries, RetentionPolicy().keep_last(limit).delete_corrupt(true));
  for (std::size_t i = 0; i < entries.size(); ++i) {
    if (decisions[i].keep) continue;
    ListedCheckpoint doomed;
    doomed.name = base_name(entries[i].name);
    doomed.path = entries[i].name;
    doomed.is_directory = true;
    remove_checkpoint(dir, doomed, env_);
  }
}

bool Accelerator::saves_per_node() const {
  if (!config_.save_on_each_node() || !group_ || group_->size() == group_->local_size()) {
    return false;
  }
  if (group_->size() % group_->local_size() != 0) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("save_on_each_node: {} processes in nodes of {}: every node must run "
                            "the same number of processes (torchrun --nproc-per-node)",
                            group_->size(), group_->local_size()));
  }
  return true;
}

std::optional<LoadStateReport> Accelerator::try_load_state() {
  wait_for_checkpoint();
  if (saves_per_node()) {
    // Each node looks at its own disk; all agree whether any holds a checkpoint.
    const int local = group_->local_size();
    bool any = false;
    for (int n = 0; n < group_->size() / local; ++n) {
      const std::string has = group_->broadcast_string(
          group_->local_rank() == 0 && !list_checkpoints().empty() ? "1" : "0", n * local,
          "try_load_state(): whether a node holds checkpoints");
      any = any || has == "1";
    }
    if (!any) return std::nullopt;
    return load_state();
  }
  if (list_checkpoints().empty()) return std::nullopt;
  return load_state();
}

// load_state() of a torchpoint checkpoint, in the order its steps must run: choose (the same
// checkpoint on every process), read (every byte verified before anything changes, and every
// process agreeing that it could), restore (the components, this process's RNG last, then the
// models' memory), report.
struct Accelerator::Loading {
  explicit Loading(Accelerator& accelerator) : acc(accelerator) {}

  Accelerator& acc;
  LoadStateReport report;
  std::string path;
  std::vector<std::string> names;  // the components' file stems
  DirectoryFill loaded;
  int saved_world = 1;
  bool own_rng = true;  // the checkpoint has an RNG file for this process's rank
  int rng_source = 0;    // the rank whose RNG file this process restores
  std::string rng_file;
  std::vector<std::string> orphans;  // RNG files of ranks that no longer exist
  RestoreReport restored;
  // A checkpoint of ZeRO-sharded optimizers: the shard components (not restored as they are),
  // each sharded optimizer's new local state, and the whole state of each optimizer that is
  // not sharded now, by component name.
  std::set<std::string> shard_components;
  std::vector<std::pair<detail::ZeroOptimizer*, StateDict>> zero_states;
  std::map<std::string, StateDict> consolidated;
  bool sharded_checkpoint = false;

  // The shards of the checkpoint's layout `saved` this process needs: those meeting its range
  // when its optimizer is sharded now, every one otherwise.
  bool needs_shard(const detail::ZeroLayout& saved, int rank) const;
  void assemble_zero();

  // With `passed_over`, the automatic choice takes the newest committed checkpoint not in it,
  // which read() then verifies (read_unless_corrupt); without, a checkpoint verified first.
  void choose(const std::string& input_dir, const std::vector<std::string>* passed_over = nullptr);
  void choose_on_every_node();
  void read();
  std::string read_unless_corrupt();
  void restore();
  LoadStateReport finish();
};

void Accelerator::Loading::choose(const std::string& input_dir,
                                  const std::vector<std::string>* passed_over) {
  auto none_valid = [&] {
    return Error(ErrorCode::NotFound,
                 fmt::format("no valid checkpoint under {}{}; save one with save_state() first",
                             acc.checkpoints_dir(),
                             report.skipped.empty() ? ""
                                                    : fmt::format(" ({} invalid ones skipped)",
                                                                  report.skipped.size())));
  };
  auto newest = [&]() -> std::string {
    if (!input_dir.empty()) return input_dir;
    std::string found = detail::newest_valid(detail::committed_checkpoints(acc.checkpoints_dir(),
                                                                           acc.env_),
                                             acc.env_, &report.skipped)
                            .value_or("");
    if (found.empty()) throw none_valid();
    return found;
  };
  if (input_dir.empty() && acc.saves_per_node()) {
    choose_on_every_node();
    return;
  }
  if (input_dir.empty() && passed_over != nullptr) {
    auto newest_unread = [&]() -> std::string {
      const auto committed = detail::committed_checkpoints(acc.checkpoints_dir(), acc.env_);
      for (auto it = committed.rbegin(); it != committed.rend(); ++it) {
        if (std::find(passed_over->begin(), passed_over->end(), it->second) ==
            passed_over->end()) {
          return it->second;
        }
      }
      return "";
    };
    path = acc.group_ ? acc.group_->decided_by_main(newest_unread,
                                                    "load_state(): choosing the checkpoint")
                      : newest_unread();
    if (path.empty()) throw none_valid();
    return;
  }
  // With several processes the main process chooses, so that all load the same one, and every
  // process's report lists what it passed over on the way.
  if (!acc.group_) {
    path = newest();
    return;
  }
  const Json chosen = Json::parse(acc.group_->decided_by_main(
      [&] { return Json{{"path", newest()}, {"skipped", report.skipped}}.dump(); },
      "load_state(): choosing the checkpoint"));
  path = chosen.at("path").get<std::string>();
  report.skipped = chosen.at("skipped").get<std::vector<std::string>>();
}

// save_on_each_node: the newest checkpoint that every node holds committed and valid on its own
// disk, each node's local main process judging its copy; every process then reads its node's.
void Accelerator::Loading::choose_on_every_node() {
  ProcessGroup& group = *acc.group_;
  const int local = group.local_size(), nodes = group.size() / local;
  const bool writer = group.local_rank() == 0;
  const std::string dir = acc.checkpoints_dir();
  // Each node's committed checkpoints, by name.
  std::vector<std::set<std::string>> held(static_cast<std::size_t>(nodes));
  std::vector<std::pair<std::uint64_t, std::string>> candidates;  // node 0's, oldest first
  for (int n = 0; n < nodes; ++n) {
    Json names = Json::array();
    if (writer) {
      for (const auto& [number, p] : detail::committed_checkpoints(dir, acc.env_)) {
        names.push_back(base_name(p));
      }
    }
    Json theirs = Json::parse(group.broadcast_string(
        names.dump(), n * local, "load_state(): the checkpoints each node holds"));
    for (const Json& name : theirs) {
      held[static_cast<std::size_t>(n)].insert(name.get<std::string>());
      if (n == 0) {
        candidates.emplace_back(checkpoint_number(name.get<std::string>()).value_or(0),
                                name.get<std::string>());
      }
    }
  }
  std::sort(candidates.begin(), candidates.end());
  for (auto it = candidates.rbegin(); it != candidates.rend(); ++it) {
    const std::string& name = it->second;
    std::vector<int> missing;
    for (int n = 0; n < nodes; ++n) {
      if (!held[static_cast<std::size_t>(n)].count(name)) missing.push_back(n);
    }
    if (!missing.empty()) {
      std::string which;
      for (int n : missing) which += fmt::format("{}{}", which.empty() ? "" : ", ", n);
      report.skipped.push_back(
          fmt::format("{}: not committed on node{} {}", join_path(dir, name),
                      missing.size() > 1 ? "s" : "", which));
      continue;
    }
    // Every node judges its copy; the verdicts go to every process.
    std::string problems;
    for (int n = 0; n < nodes; ++n) {
      std::string verdict;
      if (writer && n == group.rank() / local) {
        VerifyReport checked = verify(join_path(dir, name), acc.env_);
        if (!checked.ok()) verdict = checked.problems.empty() ? "invalid" : checked.problems[0];
      }
      verdict = group.broadcast_string(verdict, n * local,
                                       "load_state(): each node's verdict on its copy");
      if (!verdict.empty()) problems += fmt::format("; node {}: {}", n, verdict);
    }
    if (problems.empty()) {
      path = join_path(dir, name);
      return;
    }
    report.skipped.push_back(join_path(dir, name) + problems);
    if (acc.is_main_process()) {
      std::fprintf(stderr, "torchpoint: warning: passing over %s%s\n",
                   join_path(dir, name).c_str(), problems.c_str());
    }
  }
  throw Error(ErrorCode::NotFound,
              fmt::format("no checkpoint under {} is committed and valid on every one of the {} "
                          "nodes (save_on_each_node){}; save one with save_state() first",
                          dir, nodes,
                          report.skipped.empty()
                              ? std::string()
                              : fmt::format(" ({} passed over)", report.skipped.size())));
}

void Accelerator::Loading::read() {
  // The models' parameters and buffers are read straight into their memory, after everything
  // else is restored: no copy of a model is made or held (see load_directory_filling).
  names = acc.component_names();
  std::map<std::string, NamedTensors> fill;
  for (std::size_t i = 0, model = 0; i < acc.components_.size(); ++i) {
    if (acc.components_[i].kind != "model" || model >= acc.models_.size()) continue;
    const torch::nn::Module& module = *acc.models_[model++];
    NamedTensors& tensors = fill[names[i]];
    for (const auto& item : module.named_parameters(/*recurse=*/true)) {
      tensors.emplace_back(item.key(), item.value());
    }
    for (const auto& item : module.named_buffers(/*recurse=*/true)) {
      tensors.emplace_back(item.key(), item.value());
    }
  }
  std::exception_ptr failure;
  try {
    std::optional<std::vector<detail::ZeroLayout>> layouts;
    auto skip = [&](const std::string& component, const CheckpointInfo& info) {
      if (!layouts) layouts = detail::zero_layouts(info.metadata, path);
      for (const detail::ZeroLayout& layout : *layouts) {
        for (int r = 0; r < layout.world; ++r) {
          if (component == detail::zero_shard_name(layout.optimizer, r)) {
            return !needs_shard(layout, r);
          }
        }
      }
      return false;
    };
    // Of a shard it needs, a sharded optimizer reads only the pieces that meet its range.
    auto part = [&](const std::string& component, const CheckpointInfo& info) -> TensorFilter {
      if (!layouts) layouts = detail::zero_layouts(info.metadata, path);
      for (const detail::ZeroLayout& layout : *layouts) {
        for (int r = 0; r < layout.world; ++r) {
          if (component != detail::zero_shard_name(layout.optimizer, r)) continue;
          for (const auto& [name, zero] : acc.sharded(acc.component_names())) {
            if (name != layout.optimizer) continue;
            const auto [lo, hi] = zero->range_of(zero->rank());
            return detail::zero_shard_filter(layout, lo, hi);
          }
        }
      }
      return nullptr;
    };
    // Processes of one node read the same files at once: through the page cache, the device
    // is read once for all of them.
    SharedReads shared(acc.group_ && acc.group_->local_size() > 1);
    loaded = load_directory_filling(path, acc.env_, fill, skip, part);
    report.bytes_read = loaded.bytes_read;
    assemble_zero();
  } catch (const std::exception&) {
    if (!acc.group_) throw;
    failure = std::current_exception();
  }
  // Nothing changes on any process unless every process could read and verify it.
  if (acc.group_) acc.group_->agree(failure, fmt::format("load_state(): reading {}", path));
  const Json& meta = loaded.checkpoint.info.metadata;
  if (meta.contains("accelerator") && meta["accelerator"].contains("world_size")) {
    saved_world = meta["accelerator"]["world_size"].get<int>();
  }
  std::size_t saved_custom = 0, registered_custom = 0;
  for (const auto& c : loaded.checkpoint.components) {
    if (c.name.starts_with(detail::kCustomPrefix)) ++saved_custom;
  }
  for (const Component& c : acc.components_) {
    if (c.kind == "custom") ++registered_custom;
  }
  if (saved_custom != registered_custom) {
    throw Error(ErrorCode::Incompatible,
                fmt::format("{} holds {} objects saved with register_for_checkpointing but {} are "
                            "registered now; register the same objects in the same order",
                            path, saved_custom, registered_custom));
  }
}

// read() of a checkpoint that was chosen without being verified first: "" once it is read, or
// why it is to be passed over when every process that failed proved it corrupt (the read
// verifies every byte it uses before anything changes, so nothing changed). Anything else
// (an I/O error, a checkpoint of a newer torchpoint) is not proof: the checkpoint may be
// intact, and resuming from an older one would lose its progress, so that is an error.
std::string Accelerator::Loading::read_unless_corrupt() {
  try {
    read();
    return "";
  } catch (const std::exception& e) {
    const auto* error = dynamic_cast<const Error*>(&e);
    const bool corrupt = error != nullptr && error->code() == ErrorCode::Corruption;
    // Every process throws here when any failed; all pass over it only if none failed otherwise.
    try {
      std::exception_ptr not_proof = corrupt ? nullptr : std::current_exception();
      if (acc.group_) {
        acc.group_->agree(not_proof, "load_state(): whether the newest checkpoint is corrupt");
      } else if (not_proof) {
        std::rethrow_exception(not_proof);
      }
    } catch (const std::exception& why) {
      const auto* cause = dynamic_cast<const Error*>(&why);
      throw detail::not_passed_over(path, why.what(),
                                    cause != nullptr ? cause->code() : ErrorCode::IOError);
    }
    return e.what();
  }
}

bool Accelerator::Loading::needs_shard(const detail::ZeroLayout& saved, int rank) const {
  for (const auto& [name, zero] : acc.sharded(acc.component_names())) {
    if (name != saved.optimizer) continue;
    const auto [lo, hi] = zero->range_of(zero->rank());
    const std::vector<int> meeting = saved.ranks_meeting(lo, hi);
    return std::find(meeting.begin(), meeting.end(), rank) != meeting.end();
  }
  return true;
}

// Before anything changes: each sharded optimizer's state for its new pieces, and the whole
// state of an optimizer saved sharded but not sharded now (any number of processes, any stage,
// either way).
void Accelerator::Loading::assemble_zero() {
  const std::vector<detail::ZeroLayout> layouts =
      detail::zero_layouts(loaded.checkpoint.info.metadata, path);
  sharded_checkpoint = !layouts.empty();
  const auto now = acc.sharded(names);
  for (const detail::ZeroLayout& layout : layouts) {
    std::map<int, detail::ZeroShard> shards;
    std::size_t main_index = loaded.checkpoint.components.size();
    for (std::size_t j = 0; j < loaded.checkpoint.components.size(); ++j) {
      const torchpoint::Component& c = loaded.checkpoint.components[j];
      if (c.name == layout.optimizer) main_index = j;
      for (int r = 0; r < layout.world; ++r) {
        if (c.name != detail::zero_shard_name(layout.optimizer, r)) continue;
        shard_components.insert(c.name);
        shards.emplace(r, detail::ZeroShard::parse(StateDict::from_container(c.contents), layout,
                                                   r, path));
      }
    }
    auto target = std::find_if(now.begin(), now.end(),
                               [&](const auto& z) { return z.first == layout.optimizer; });
    if (target != now.end()) {
      zero_states.emplace_back(target->second,
                               target->second->local_state_from(layout, shards, path));
    } else if (main_index < loaded.checkpoint.components.size()) {
      consolidated[layout.optimizer] = detail::zero_consolidate(
          layout, StateDict::from_container(loaded.checkpoint.components[main_index].contents),
          shards, path);
    }
  }
}

void Accelerator::Loading::restore() {
  const int rank = acc.process_index();
  // This process's RNG file; a process the checkpoint has none for (more processes now, or a
  // node's checkpoint of save_on_each_node holding that node's ranks only) takes the lowest
  // rank's there and reseeds its CPU generator below.
  std::set<int> present;
  for (const auto& c : loaded.checkpoint.components) {
    if (!c.name.starts_with(detail::kRngPrefix)) continue;
    std::string digits = c.name.substr(std::string(detail::kRngPrefix).size());
    if (!digits.empty() && digits.size() < 10 &&
        digits.find_first_not_of("0123456789") == std::string::npos) {
      present.insert(std::stoi(digits));
    }
  }
  own_rng = present.empty() ? rank < saved_world : present.count(rank) > 0;
  rng_source = own_rng || present.empty() ? (own_rng ? rank : 0) : *present.begin();
  rng_file = random_states_name(rng_source);
  StatefulSet set;
  for (std::size_t i = 0; i < acc.components_.size(); ++i) {
    set.add(names[i], acc.components_[i].object);
  }
  for (const std::string& name : loaded.filled) set.allow_missing(name);
  // Everything else may draw random numbers while loading; the restored streams must not move.
  set.add(rng_file, AnyStateful::ref(acc.rng_), /*restore_last=*/true);
  StateDict all;
  for (const auto& c : loaded.checkpoint.components) {
    if (c.name.starts_with(detail::kRngPrefix) && c.name != rng_file) {
      // Another process's: restored there, or (when it no longer exists) reported below.
      std::string digits = c.name.substr(std::string(detail::kRngPrefix).size());
      bool number = !digits.empty() && digits.size() < 10 &&
                    digits.find_first_not_of("0123456789") == std::string::npos;
      if (number && std::stoi(digits) >= acc.num_processes()) orphans.push_back(c.name);
      continue;
    }
    if (shard_components.count(c.name)) continue;  // assembled by assemble_zero()
    auto whole = consolidated.find(c.name);
    all.set_child(c.name, whole != consolidated.end() ? whole->second
                                                      : StateDict::from_container(c.contents));
  }
  restored = set.restore(all);
  // The sharded optimizers: their pieces' state from the shards, or (a checkpoint saved
  // without sharding) their part of the whole state just restored.
  for (auto& [zero, state] : zero_states) zero->set_local_state(state);
  if (!sharded_checkpoint) {
    for (auto& z : acc.zero_) {
      if (z) z->take_from_user();
    }
  }
  // Last, when nothing else can fail: only an I/O error, or the files changing since they were
  // verified, can stop it, and its error says the model may hold part of the checkpoint.
  loaded.copy();
  if (!own_rng) {
    std::uint64_t seed =
        at::detail::getDefaultCPUGenerator().current_seed() + static_cast<std::uint64_t>(rank);
    torch::manual_seed(seed);
    report.notes.push_back(fmt::format(
        "{} was saved by {} process(es) and has no RNG states for rank {}: it restored rank {}'s "
        "and seeded its CPU generator with rank {}'s seed + {} = {}",
        path, saved_world, rank, rng_source, rng_source, rank, seed));
  }
}

LoadStateReport Accelerator::Loading::finish() {
  const DirectoryCheckpoint& checkpoint = loaded.checkpoint;
  if (saved_world != acc.num_processes()) {
    std::string note = fmt::format(
        "{} was saved by {} process(es) and is loaded by {}: the data position (samples of the "
        "epoch consumed by all processes) continues the epoch with no sample repeated or "
        "skipped, but the batches differ from the saved run's from here on{}",
        path, saved_world, acc.num_processes(),
        orphans.empty() ? std::string()
                        : "; the RNG states of ranks that no longer exist are not restored "
                          "anywhere: " +
                              join_names(orphans));
    if (acc.is_main_process()) std::fprintf(stderr, "torchpoint: warning: %s\n", note.c_str());
    report.notes.push_back(std::move(note));
  }
  report.saved_world_size = saved_world;
  acc.reset_after_load(/*zero_restored=*/true);
  acc.step_ = checkpoint.info.step;
  acc.continue_numbering_after(path);
  acc.resumed_from_ = path;
  acc.last_checkpoint_ = path;
  report.path = path;
  for (const std::string& name : names) {
    if (std::find(loaded.filled.begin(), loaded.filled.end(), name) != loaded.filled.end() ||
        std::find(restored.restored.begin(), restored.restored.end(), name) !=
            restored.restored.end()) {
      report.components.push_back(name);
    }
  }
  report.components.push_back(rng_file);
  report.step = acc.step_;
  report.libtorch_version = checkpoint.libtorch_version;
  if (!checkpoint.libtorch_version.empty() &&
      checkpoint.libtorch_version != compat::torch_version()) {
    report.notes.push_back(fmt::format(
        "{} was written by LibTorch {} and is loaded by LibTorch {}: every value was restored "
        "bit for bit, but the two versions' kernels may compute the following steps "
        "differently",
        path, checkpoint.libtorch_version, compat::torch_version()));
  }
  return std::move(report);
}

LoadStateReport Accelerator::load_state(const std::string& input_dir) {
  wait_for_checkpoint();
  // The automatic choice reads the newest committed checkpoint at once: its read verifies every
  // byte before anything changes, so a separate verify first would read the checkpoint twice.
  // One that proves corrupt is passed over for the next older one, as a verify would have.
  // Not with load hooks, which act on the chosen folder themselves before it is read.
  const bool read_verifies =
      input_dir.empty() && !saves_per_node() && load_hooks_->snapshot().empty();
  if (read_verifies) {
    std::vector<std::string> passed_over, skipped;
    for (;;) {
      Loading loading(*this);
      loading.report.skipped = skipped;
      loading.choose(input_dir, &passed_over);
      const std::string why = loading.read_unless_corrupt();
      if (why.empty()) {
        loading.restore();
        return loading.finish();
      }
      passed_over.push_back(loading.path);
      skipped = std::move(loading.report.skipped);
      skipped.push_back(fmt::format("{}: {}", loading.path, why));
      if (is_main_process()) detail::warn_passed_over(skipped.back());
    }
  }
  Loading loading(*this);
  loading.choose(input_dir);
  // The hooks may take models out of the list (they loaded them): the ones left are read from
  // model, model_1, ... in their order.
  ModelList models = models_;
  for (const auto& hook : load_hooks_->snapshot()) hook(models, nullptr, loading.path);
  std::optional<HookedComponents> hooked;
  if (models != models_) {
    if (models.size() > models_.size()) {
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("a load hook left {} models for {} prepared ones: a hook may take "
                              "models out of the list, not add them",
                              models.size(), models_.size()));
    }
    hooked.emplace(*this, components_with_models(models.size(), [&](std::size_t j) {
      return AnyStateful::value(ModuleAdapter{models[j]});
    }), models);
  }
  if (is_accelerate_checkpoint(loading.path, env_)) {
    return load_accelerate_state(loading.path, std::move(loading.report));
  }
  loading.read();
  loading.restore();
  return loading.finish();
}

void Accelerator::reset_after_load(bool zero_restored) {
  // The optimizers' state was restored unsharded: each process keeps its part.
  if (!zero_restored) {
    for (auto& z : zero_) {
      if (z) z->take_from_user();
    }
  }
  scaled_pending_ = false;  // the parameters were just replaced; no gradient is pending
  // Every save is at a step boundary, where the accumulation count starts again.
  accumulation_count_ = 0;
  sync_gradients_ = true;
  unsynced_backward_ = false;
}

void Accelerator::continue_numbering_after(const std::string& path) {
  if (config_.automatic_checkpoint_naming()) {
    // The next save continues the numbering instead of starting again at checkpoint_0; after
    // resuming from an older checkpoint, it goes after the newest one rather than collide.
    std::int64_t next = config_.iteration();
    if (auto n = parse_checkpoint_name(base_name(path))) next = static_cast<std::int64_t>(*n) + 1;
    for (const auto& [number, p] : list_checkpoints()) next = std::max(next, number + 1);
    config_.iteration(next);
    first_own_number_ = next;
  }
}

LoadStateReport Accelerator::load_accelerate_state(const std::string& path,
                                                   LoadStateReport report) {
  const std::vector<std::string> names = component_names();
  std::vector<detail::WantedComponent> wanted;
  for (std::size_t i = 0; i < components_.size(); ++i) {
    const Component& c = components_[i];
    // The state now shows the layout the translation must produce; a model's and a sampler's
    // are not needed.
    const bool needs_current = c.kind != "model" && c.kind != "sampler";
    wanted.push_back({names[i], c.kind, needs_current ? c.object.state_dict() : StateDict()});
  }
  const std::string rng_name = random_states_name(process_index());
  detail::AccelerateRead read;
  std::exception_ptr failure;
  try {
    read = detail::read_accelerate_directory(path, wanted, rng_name, rng_.state_dict(),
                                             process_index(), env_);
  } catch (const std::exception&) {
    if (!group_) throw;
    failure = std::current_exception();
  }
  if (group_) group_->agree(failure, fmt::format("load_state(): reading {}", path));
  StatefulSet set;
  for (std::size_t i = 0; i < components_.size(); ++i) {
    set.add(names[i], components_[i].object);
    if (components_[i].kind == "sampler") set.allow_missing(names[i]);
  }
  // Everything else may draw random numbers while loading; the restored streams must not move.
  set.add(rng_name, AnyStateful::ref(rng_), /*restore_last=*/true);
  set.restore(read.all);
  reset_after_load();
  step_ = read.step;
  continue_numbering_after(path);
  resumed_from_ = path;
  // Not a torchpoint checkpoint: an incremental save has nothing to link from it.
  last_checkpoint_.clear();
  report.path = path;
  report.components = read.files;
  report.step = step_;
  report.saved_world_size = 0;  // Accelerate does not record it
  report.not_applicable = read.not_applicable;
  for (const std::string& n : read.not_in_checkpoint) {
    report.notes.push_back(fmt::format("not in {}, left as it was: {}", path, n));
  }
  for (std::string& n : read.notes) report.notes.push_back(std::move(n));
  report.notes.push_back(fmt::format(
      "{} was written by Python Accelerate: its values were restored bit for bit, but "
      "PyTorch's Python optimizers and LibTorch's compute the following steps with other "
      "kernels, which may differ in the last bits",
      path));
  return report;
}

}  // namespace torchpoint
