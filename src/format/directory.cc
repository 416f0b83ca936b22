// save_file, save_directory, load_directory and the directory half of verify.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "format/checksum.h"
#include "format/container.h"
#include "format/directory_fill.h"
#include "format/directory_save.h"
#include "format/manifest.h"
#include "format/shards.h"
#include "format/staging_gate.h"
#include "format/zero_shards.h"
#include "io/atomic_commit.h"
#include "io/filename.h"
#include "torchpoint/checkpoint_dir.h"
#include "torchpoint/error.h"

namespace torchpoint {

VerifyReport verify_directory(const std::string& path, Env& env);

namespace {

void check_component_name(const std::string& name) {
  bool ok = !name.empty() && name.size() <= 200;
  for (char c : name) {
    bool allowed = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                   c == '_' || c == '-' || c == '.';
    ok = ok && allowed;
  }
  if (!ok || name == "." || name == ".." || name == "manifest") {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("component name '{}' is not usable as a file name; use letters, "
                            "digits, '_', '-' and '.'",
                            name));
  }
  if (looks_like_shard_stem(name)) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("component name '{}' ends like the name of a shard file "
                            "(\"-00001-of-00002\"), which a sharded component's files use: "
                            "choose another name",
                            name));
  }
}

// Creates `dir` and its missing parents, making each new entry durable.
void make_dirs(Env& env, const std::string& dir) {
  if (env.stat(dir).exists) return;
  std::string parent = parent_path(dir);
  if (parent != dir) make_dirs(env, parent);
  try {
    env.mkdir(dir);
  } catch (const Error&) {
    if (!env.stat(dir).is_directory) throw;  // someone else created it meanwhile: fine
    return;
  }
  env.sync_dir(parent);
}

std::string read_manifest_bytes(Env& env, const std::string& manifest_path, Problems& problems) {
  std::unique_ptr<File> file = env.open(manifest_path, OpenMode::Read);
  std::uint64_t size = file->size();
  if (size > kMaxManifestSize) {
    problems.add(fmt::format("{} is {} bytes, over the {} byte limit for a manifest", manifest_path,
                             size, kMaxManifestSize));
    return {};
  }
  std::string bytes(size, '\0');
  file->read_exact(bytes.data(), size, 0);
  return bytes;
}

}  // namespace

void save_file(const std::string& path, const Container& contents, Env& env) {
  // What a killed or failed earlier save of this file left behind (a SIGKILLed auto_resume
  // leaves a whole temporary copy of the state).
  std::string parent = parent_path(path);
  remove_stale_temporaries(env, parent.empty() ? "." : parent, base_name(path));
  PendingFile pending(env, path);
  write_container(env, pending.temp_path(), contents);
  pending.commit();
}

namespace {

// XXH3 of the whole of `file`, of `size` bytes.
std::uint64_t whole_file_checksum(File& file, std::uint64_t size) {
  std::vector<std::uint8_t> buffer(
      static_cast<std::size_t>(std::min<std::uint64_t>(size, kReadBufferSize)));
  return checksum_range(file, 0, size, buffer);
}

// The files a save hook wrote into `dir`: each made durable and checksummed.
std::vector<ManifestExtraFile> collect_extra_files(Env& env, const std::string& dir,
                                                   const std::vector<Component>& components) {
  std::unordered_set<std::string> reserved = {std::string(kManifestFileName)};
  std::unordered_set<std::string> component_names;
  for (const Component& c : components) {
    reserved.insert(component_file_name(c.name));
    reserved.insert(shard_index_file_name(c.name));
    component_names.insert(c.name);
  }
  // "<component>-00001-of-00002.safetensors": a shard the save may write.
  auto is_shard_name = [&](const std::string& name) {
    std::optional<std::string> stem = parse_component_file_name(name);
    constexpr std::size_t kSuffix = std::string_view("-00001-of-00002").size();
    return stem && looks_like_shard_stem(*stem) &&
           component_names.count(stem->substr(0, stem->size() - kSuffix)) > 0;
  };
  std::vector<std::string> names = env.list_dir(dir);
  std::sort(names.begin(), names.end());
  std::vector<ManifestExtraFile> out;
  for (const std::string& name : names) {
    std::string file_path = join_path(dir, name);
    FileInfo info = env.stat(file_path);
    if (reserved.count(name) || is_shard_name(name)) {
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("a save hook wrote {}, a name the checkpoint itself uses: write "
                              "other names",
                              file_path));
    }
    if (info.is_symlink || !info.is_regular) {
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("a save hook made {}, which is {}: a checkpoint holds regular "
                              "files only, directly in its directory",
                              file_path,
                              info.is_symlink     ? "a symbolic link"
                              : info.is_directory ? "a directory"
                                                  : "not a regular file"));
    }
    std::unique_ptr<File> file = env.open(file_path, OpenMode::Read);
    file->sync();  // the hook may not have: the commit must not publish unsynced bytes
    ManifestExtraFile extra;
    extra.name = name;
    extra.size = file->size();
    extra.checksum = whole_file_checksum(*file, extra.size);
    file->close();
    out.push_back(std::move(extra));
  }
  return out;
}

}  // namespace

Json WrittenComponent::to_json() const {
  return {{"file", file_name},
          {"component", component},
          {"size", size},
          {"header_checksum", checksum_hex(header_checksum)},
          {"shard", shard},
          {"shards", shards},
          {"index", index},
          {"linked", linked}};
}

WrittenComponent WrittenComponent::from_json(const Json& json, const std::string& from) {
  try {
    WrittenComponent w;
    w.file_name = json.at("file").get<std::string>();
    w.component = json.at("component").get<std::string>();
    w.size = json.at("size").get<std::uint64_t>();
    std::optional<std::uint64_t> sum =
        parse_checksum_hex(json.at("header_checksum").get<std::string>());
    if (!sum) throw std::invalid_argument("header_checksum is not 16 hex digits");
    w.header_checksum = *sum;
    w.shard = json.at("shard").get<int>();
    w.shards = json.at("shards").get<int>();
    w.index = json.at("index").get<bool>();
    w.linked = json.at("linked").get<bool>();
    return w;
  } catch (const std::exception& e) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("the report of the files {} wrote is malformed ({}): {}", from,
                            e.what(), json.dump()));
  }
}

namespace {

// One file of a save: a whole component, or shard `shard` of `shards` of one.
struct FileTask {
  const Component* component = nullptr;
  int shard = 0;
  int shards = 0;
  Container shard_contents;  // a shard's tensors (sharing the component's memory) and state
  bool compare = false;      // a shard that the link source may hold unchanged
  bool frozen = false;       // its tensors are the frozen ones (plan_shards keeps them apart)
  const Container& contents() const {
    return shards > 0 ? shard_contents : component->contents;
  }
  WrittenComponent out;
};

// How the files of a save are made when something is sharded. Comparing a shard with the link
// source is reading memory (XXH3 of its tensors): kComparers threads, one a core of this kind
// of machine. Writing is mostly waiting for the disk (each write already overlaps its own
// copy-and-hash with its writes on a second thread): kFileWriters threads keep two files in flight,
// and more would only compete for the same disk queue. The two run at once, so an incremental
// save writes what changed while it proves the rest unchanged.
constexpr std::size_t kComparers = 2;
constexpr std::size_t kFileWriters = 2;

// Writes `task`'s file as a container.
void write_file(Env& env, const std::string& dir, FileTask& task) {
  WrittenFile written =
      write_container(env, join_path(dir, task.out.file_name), task.contents(),
                      /*hugging_face_format=*/task.shards > 0);
  task.out.size = written.size;
  task.out.header_checksum = written.header_checksum;
}

// Hard-links `task` from `link_source` when it holds the same shard; false when it must be
// written.
bool link_file(Env& env, const std::string& dir, const LinkSource& link_source, FileTask& task) {
  auto found = link_source.find(task.out.file_name, task.contents());
  if (!found) return false;
  std::string path = join_path(dir, task.out.file_name);
  try {
    env.link(found->first, path);
  } catch (const Error&) {
    // Deliberately swallowed: no hard links here (another file system, a link limit, an Env
    // without them). Writing the same bytes from memory is the copy.
    if (env.stat(path).exists) env.remove_file(path);
    return false;
  }
  task.out.size = found->second.size;
  task.out.header_checksum = found->second.header_checksum;
  task.out.linked = true;
  return true;
}

// Runs every task: the comparable ones on the comparers (those that differ go on to the
// writers), the others on the writers. The first error stops the rest and is rethrown.
void run_tasks(Env& env, const std::string& dir, std::vector<FileTask>& tasks,
               const LinkSource* link_source) {
  std::mutex mutex;
  std::condition_variable changed;
  std::deque<FileTask*> to_write, to_compare;
  for (FileTask& t : tasks) (t.compare && link_source ? to_compare : to_write).push_back(&t);
  // The shards of changing tensors first: they usually differ, and the writers can start on
  // them while the frozen ones are proven unchanged.
  std::stable_partition(to_compare.begin(), to_compare.end(),
                        [](const FileTask* t) { return !t->frozen; });
  std::size_t comparing = to_compare.size();  // not yet settled by a comparer
  std::exception_ptr error;

  auto fail = [&](std::exception_ptr e) {
    std::lock_guard<std::mutex> lock(mutex);
    if (!error) error = e;
    changed.notify_all();
  };
  auto comparer = [&] {
    for (;;) {
      FileTask* task = nullptr;
      {
        std::lock_guard<std::mutex> lock(mutex);
        if (error || to_compare.empty()) return;
        task = to_compare.front();
        to_compare.pop_front();
      }
      try {
        bool linked = link_file(env, dir, *link_source, *task);
        std::lock_guard<std::mutex> lock(mutex);
        if (!linked) to_write.push_back(task);
        --comparing;
        changed.notify_all();
      } catch (...) {
        fail(std::current_exception());
        return;
      }
    }
  };
  auto writer = [&] {
    for (;;) {
      FileTask* task = nullptr;
      {
        std::unique_lock<std::mutex> lock(mutex);
        changed.wait(lock, [&] { return error || !to_write.empty() || comparing == 0; });
        if (error || to_write.empty()) return;  // no more work, or a failure elsewhere
        task = to_write.front();
        to_write.pop_front();
      }
      try {
        write_file(env, dir, *task);
      } catch (...) {
        fail(std::current_exception());
        return;
      }
    }
  };
  // A background save's tensors may still be on their way into its staging buffer: the
  // helper threads wait for them at the same gate as this thread (it is this thread's own).
  const detail::StagingGate* gate = detail::current_staging_gate;
  auto gated = [gate](const std::function<void()>& work) {
    return [gate, work] {
      detail::current_staging_gate = gate;
      work();
      detail::current_staging_gate = nullptr;
    };
  };
  std::vector<std::thread> threads;
  const std::size_t comparers = std::min(kComparers, to_compare.size());
  const std::size_t writers = std::min(kFileWriters, tasks.size());
  try {
    for (std::size_t i = 0; i < comparers; ++i) threads.emplace_back(gated(comparer));
    for (std::size_t i = 1; i < writers; ++i) threads.emplace_back(gated(writer));
  } catch (...) {
    fail(std::current_exception());  // no thread to be had: stop those that started
  }
  if (writers > 0) writer();
  for (std::thread& t : threads) t.join();
  if (error) std::rethrow_exception(error);
}

// The files of `component`: one task, or one per shard (its index is written by the caller).
// Appends the index's weight map and total size to `indexes` when sharded.
struct PlannedIndex {
  const Component* component = nullptr;
  WeightMap weight_map;
  std::uint64_t total_size = 0;
};

void plan_files(const Component& component, const SaveDirectoryOptions& options,
                std::vector<FileTask>& tasks, std::vector<PlannedIndex>& indexes) {
  check_component_name(component.name);
  std::vector<std::vector<std::size_t>> plan =
      plan_shards(component, options.shard_size, options.frozen);
  if (plan.empty()) {
    FileTask task;
    task.component = &component;
    task.out.file_name = component_file_name(component.name);
    task.out.component = component.name;
    tasks.push_back(std::move(task));
    return;
  }
  if (plan.size() > static_cast<std::size_t>(kMaxShards)) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("component '{}' would need {} shards, over the {} that shard names "
                            "allow: raise SaveDirectoryOptions::shard_size",
                            component.name, plan.size(), kMaxShards));
  }
  const int shards = static_cast<int>(plan.size());
  PlannedIndex index;
  index.component = &component;
  std::vector<int> shard_of(component.contents.tensors.size());
  for (std::size_t k = 0; k < plan.size(); ++k) {
    FileTask task;
    task.component = &component;
    task.shard = static_cast<int>(k) + 1;
    task.shards = shards;
    task.compare = true;
    task.frozen = options.frozen.count(
                      fmt::format("{}/{}", component.name,
                                  component.contents.tensors[plan[k].front()].first)) > 0;
    for (std::size_t i : plan[k]) {
      const auto& [name, tensor] = component.contents.tensors[i];
      task.shard_contents.tensors.emplace_back(name, tensor);
      index.total_size += static_cast<std::uint64_t>(tensor.numel()) *
                          static_cast<std::uint64_t>(tensor.element_size());
      shard_of[i] = task.shard;
    }
    // The non-tensor state goes with the last shard, one of the changing tensors' when there
    // are any, so that the frozen shards stay the same from save to save.
    if (task.shard == shards) task.shard_contents.state = component.contents.state;
    task.out.file_name = shard_file_name(component.name, task.shard, shards);
    task.out.component = component.name;
    task.out.shard = task.shard;
    task.out.shards = shards;
    tasks.push_back(std::move(task));
  }
  // The index lists the tensors in the component's own order, which loading restores.
  for (std::size_t i = 0; i < shard_of.size(); ++i) {
    index.weight_map.emplace_back(component.contents.tensors[i].first,
                                  shard_file_name(component.name, shard_of[i], shards));
  }
  indexes.push_back(std::move(index));
}

std::uint64_t task_bytes(const FileTask& task) {
  std::uint64_t bytes = 0;
  for (const auto& [name, tensor] : task.contents().tensors) {
    bytes += static_cast<std::uint64_t>(tensor.numel()) *
             static_cast<std::uint64_t>(tensor.element_size());
  }
  return bytes;
}

// The tasks dealt to `part` out of the same plan on every writer (see WriterPart).
std::vector<FileTask> tasks_of_part(std::vector<FileTask> tasks, WriterPart part) {
  std::vector<std::size_t> order(tasks.size());
  std::vector<std::uint64_t> bytes(tasks.size());
  for (std::size_t i = 0; i < tasks.size(); ++i) {
    order[i] = i;
    bytes[i] = task_bytes(tasks[i]);
  }
  std::stable_sort(order.begin(), order.end(),
                   [&](std::size_t a, std::size_t b) { return bytes[a] > bytes[b]; });
  std::vector<std::uint64_t> load(static_cast<std::size_t>(part.count), 0);
  std::vector<bool> mine(tasks.size(), false);
  for (std::size_t i : order) {
    std::size_t least = load.size() - 1;
    for (std::size_t p = load.size(); p-- > 0;) {
      if (load[p] < load[least]) least = p;
    }
    load[least] += bytes[i];
    mine[i] = least == static_cast<std::size_t>(part.index);
  }
  std::vector<FileTask> out;
  for (std::size_t i = 0; i < tasks.size(); ++i) {
    if (mine[i]) out.push_back(std::move(tasks[i]));
  }
  return out;
}

WrittenComponent write_index(Env& env, const std::string& dir, const PlannedIndex& planned) {
  std::string text = shard_index_text(planned.weight_map, planned.total_size);
  WrittenComponent index;
  index.file_name = shard_index_file_name(planned.component->name);
  index.component = planned.component->name;
  index.index = true;
  index.size = text.size();
  index.header_checksum = xxh3(text.data(), text.size());
  std::unique_ptr<File> file = env.open(join_path(dir, index.file_name), OpenMode::CreateExclusive);
  file->write_all(text.data(), text.size(), 0);
  file->sync();
  file->close();
  return index;
}

}  // namespace

std::vector<WrittenComponent> write_components(Env& env, const std::string& dir,
                                               const std::vector<Component>& components,
                                               const SaveDirectoryOptions& options,
                                               const LinkSource* link_source, WriterPart part) {
  if (part.count < 1 || part.index < 0 || part.index >= part.count) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("write_components(): part {} of {} does not exist", part.index,
                            part.count));
  }
  std::vector<FileTask> tasks;
  std::vector<PlannedIndex> indexes;
  for (const Component& c : components) plan_files(c, options, tasks, indexes);
  const bool sharded = !indexes.empty();
  if (part.count > 1) {
    tasks = tasks_of_part(std::move(tasks), part);
    if (part.index != 0) indexes.clear();
  }
  if (!sharded) {
    // Nothing sharded: one file after the other on this thread, as they were before shards.
    for (FileTask& task : tasks) write_file(env, dir, task);
  } else {
    run_tasks(env, dir, tasks, link_source);
  }
  std::vector<WrittenComponent> out;
  for (FileTask& task : tasks) out.push_back(std::move(task.out));
  for (const PlannedIndex& index : indexes) out.push_back(write_index(env, dir, index));
  return out;
}

std::unordered_set<std::string> tensors_of_part(const std::vector<Component>& components,
                                                const SaveDirectoryOptions& options,
                                                WriterPart part) {
  std::vector<FileTask> tasks;
  std::vector<PlannedIndex> indexes;
  for (const Component& c : components) plan_files(c, options, tasks, indexes);
  if (part.count > 1) tasks = tasks_of_part(std::move(tasks), part);
  std::unordered_set<std::string> out;
  for (const FileTask& task : tasks) {
    for (const auto& [name, tensor] : task.contents().tensors) {
      out.insert(task.component->name + "/" + name);
    }
  }
  return out;
}

DirectorySave::DirectorySave(Env& env, const std::string& path,
                             const std::vector<std::string>& component_names,
                             const SaveDirectoryOptions& options)
    : env_(env), path_(path), component_names_(component_names) {
  std::unordered_set<std::string> names;
  std::vector<Component> reserved;
  for (const std::string& name : component_names_) {
    check_component_name(name);
    if (!names.insert(name).second) {
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("component '{}' appears twice in the checkpoint {}", name, path));
    }
    reserved.push_back({name, {}});
  }
  std::string parent = parent_path(path);
  make_dirs(env, parent);
  lock_ = std::make_unique<ProjectLock>(env, parent);
  remove_stale_temporaries(env, parent);
  pending_ = std::make_unique<PendingDir>(env, path, options.overwrite);
  if (options.before_components) {
    options.before_components(pending_->temp_path());
    extra_files_ = collect_extra_files(env, pending_->temp_path(), reserved);
  }
}

DirectorySave::~DirectorySave() = default;

const std::string& DirectorySave::temp_path() const { return pending_->temp_path(); }

void DirectorySave::collect_hook_files() {
  std::vector<Component> reserved;
  for (const std::string& name : component_names_) reserved.push_back({name, {}});
  extra_files_ = collect_extra_files(env_, pending_->temp_path(), reserved);
}

void DirectorySave::set_component_names(const std::vector<std::string>& component_names) {
  std::unordered_set<std::string> announced(component_names_.begin(), component_names_.end());
  std::unordered_set<std::string> seen;
  for (const std::string& name : component_names) {
    if (!announced.count(name) || !seen.insert(name).second) {
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("component '{}' of checkpoint {} was not announced when the save "
                              "began, or appears twice",
                              name, path_));
    }
  }
  component_names_ = component_names;
}

void DirectorySave::commit(const std::vector<WrittenComponent>& files, const CheckpointInfo& info) {
  // Each announced component arrives once: as one file, or as all its shards and its index.
  struct Parts {
    int shards = 0;
    std::unordered_set<int> seen;
    int indexes = 0;
  };
  std::unordered_set<std::string> expected(component_names_.begin(), component_names_.end());
  std::unordered_set<std::string> seen_files;
  std::unordered_map<std::string, Parts> sharded;
  auto refuse = [&](const WrittenComponent& f) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("{}: component '{}' ({}) was written but not announced, or twice",
                            path_, f.component, f.file_name));
  };
  for (const WrittenComponent& f : files) {
    std::string expected_name = f.index        ? shard_index_file_name(f.component)
                                : f.shards > 0 ? shard_file_name(f.component, f.shard, f.shards)
                                               : component_file_name(f.component);
    if (f.file_name != expected_name || !seen_files.insert(f.file_name).second) refuse(f);
    if (f.index) {
      ++sharded[f.component].indexes;
    } else if (f.shards > 0) {
      Parts& parts = sharded[f.component];
      if (parts.shards == 0) parts.shards = f.shards;
      if (parts.shards != f.shards || f.shard < 1 || f.shard > f.shards ||
          !parts.seen.insert(f.shard).second) {
        refuse(f);
      }
    } else if (expected.erase(f.component) != 1) {
      refuse(f);
    }
  }
  for (const auto& [component, parts] : sharded) {
    if (expected.erase(component) != 1 || parts.indexes != 1 || parts.shards == 0 ||
        static_cast<int>(parts.seen.size()) != parts.shards) {
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("{}: component '{}' was written as {} of {} shards with {} "
                              "indexes, or was not announced",
                              path_, component, parts.seen.size(), parts.shards, parts.indexes));
    }
  }
  if (!expected.empty()) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("{}: component '{}' was announced but nobody wrote it", path_,
                            *expected.begin()));
  }
  Manifest manifest;
  manifest.extra_files = extra_files_;
  if (!manifest.extra_files.empty()) manifest.version_minor = std::max(kFormatMinor, 1);
  if (!sharded.empty()) {
    manifest.version_major = kShardedManifestMajor;
    manifest.version_minor = 0;
  }
  if (info.metadata.is_object() && info.metadata.contains("zero")) {
    bool chunked = false;
    try {
      for (const detail::ZeroLayout& layout : detail::zero_layouts(info.metadata, path_)) {
        chunked = chunked || layout.chunk > 0;
      }
    } catch (const Error& e) {
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("{}: the metadata's \"zero\" entry is reserved for the layout of "
                              "ZeRO-sharded optimizer state, and this one is not one ({})",
                              path_, e.what()));
    }
    manifest.version_major = chunked ? kChunkedZeroManifestMajor : kZeroManifestMajor;
    manifest.version_minor = 0;
  }
  manifest.torchpoint_version = torchpoint_version();
  manifest.libtorch_version = libtorch_version();
  manifest.created_unix_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                                 std::chrono::system_clock::now().time_since_epoch())
                                 .count();
  manifest.info = info;
  for (const WrittenComponent& f : files) {
    if (f.index) {
      manifest.shard_indexes.push_back({f.file_name, f.component, f.size, f.header_checksum});
    } else {
      manifest.files.push_back(
          {f.file_name, f.component, f.size, f.header_checksum, f.shard, f.shards});
    }
  }
  // The manifest goes last: a directory holding one lists only files already synced.
  std::string text = serialize_manifest(manifest);
  std::unique_ptr<File> file =
      env_.open(join_path(pending_->temp_path(), kManifestFileName), OpenMode::CreateExclusive);
  file->write_all(text.data(), text.size(), 0);
  file->sync();
  file->close();
  pending_->commit();
}

void save_directory(const std::string& path, const std::vector<Component>& components,
                    const CheckpointInfo& info, Env& env, const SaveDirectoryOptions& options) {
  std::vector<std::string> names;
  for (const Component& c : components) names.push_back(c.name);
  DirectorySave save(env, path, names, options);
  LinkSource link_source(env, options.link_from);
  save.commit(write_components(env, save.temp_path(), components, options, &link_source), info);
}

// Opens the manifest of a directory checkpoint with a clear error when it is not one.
// torchpoint never writes a link into a checkpoint: one there points anywhere (a valid file
// elsewhere, a private one), so it is refused rather than followed.
[[noreturn]] static void refuse_link(const std::string& file_path, const std::string& checkpoint) {
  throw Error(ErrorCode::InvalidArgument,
              fmt::format("{} is a symbolic link; the files of checkpoint {} are never links, "
                          "so it is not followed: replace it with the file itself",
                          file_path, checkpoint));
}

// Checks a file that the manifest covers with one checksum of the whole file (a save hook's
// file, a shard index) against its size and XXH3; throws what is wrong with it. With `bytes`,
// also returns its contents (the small index files are parsed after the check).
static void check_whole_file(Env& env, const std::string& checkpoint, const std::string& name,
                             std::uint64_t expected_size, std::uint64_t expected_sum,
                             std::string* bytes = nullptr) {
  std::string file_path = join_path(checkpoint, name);
  FileInfo info = env.stat(file_path);
  if (info.is_symlink) refuse_link(file_path, checkpoint);
  if (!info.exists) {
    throw Error(ErrorCode::Corruption,
                fmt::format("{}: listed in the manifest but missing", file_path));
  }
  std::unique_ptr<File> file = env.open(file_path, OpenMode::Read);
  std::uint64_t size = file->size();
  std::uint64_t sum = 0;
  if (bytes != nullptr && size == expected_size) {
    bytes->assign(size, '\0');
    file->read_exact(bytes->data(), size, 0);
    sum = xxh3(bytes->data(), size);
  } else {
    sum = whole_file_checksum(*file, size);
  }
  if (size != expected_size || sum != expected_sum) {
    throw Error(ErrorCode::Corruption,
                fmt::format("{} fails its checksum ({} bytes, XXH3 {}; the manifest says {} "
                            "bytes, {}): it was changed after the checkpoint was saved",
                            file_path, size, checksum_hex(sum), expected_size,
                            checksum_hex(expected_sum)));
  }
}

static void check_extra_file(Env& env, const std::string& checkpoint, const ManifestExtraFile& f) {
  check_whole_file(env, checkpoint, f.name, f.size, f.checksum);
}

// The weight map of `index` in the checkpoint `checkpoint`, checked against the manifest.
static WeightMap read_shard_index(Env& env, const std::string& checkpoint,
                                  const ManifestShardIndex& index) {
  std::string text;
  check_whole_file(env, checkpoint, index.name, index.size, index.checksum, &text);
  return parse_shard_index(text, join_path(checkpoint, index.name));
}

static Manifest load_manifest(Env& env, const std::string& path, Problems& problems) {
  FileInfo info = env.stat(path);
  if (!info.exists) {
    throw Error(ErrorCode::NotFound, fmt::format("checkpoint directory {} does not exist", path));
  }
  if (!info.is_directory) {
    throw Error(
        ErrorCode::InvalidArgument,
        fmt::format("{} is a file, not a checkpoint directory; load it with load_file", path));
  }
  std::string manifest_path = join_path(path, kManifestFileName);
  FileInfo manifest_info = env.stat(manifest_path);
  if (manifest_info.is_symlink) refuse_link(manifest_path, path);
  if (!manifest_info.exists) {
    throw Error(ErrorCode::NotFound,
                fmt::format("{} has no {}: it is not a torchpoint checkpoint, or its save never "
                            "committed",
                            path, kManifestFileName));
  }
  std::string bytes = read_manifest_bytes(env, manifest_path, problems);
  return parse_manifest(bytes, manifest_path, problems);
}

// The path of the file `f` of the checkpoint `path`, after the checks that need no read: a
// regular file, not a link, of the size the manifest lists.
static std::string checked_listed_file(Env& env, const std::string& path, const ManifestFile& f) {
  std::string file_path = join_path(path, f.name);
  FileInfo info = env.stat(file_path);
  if (info.is_symlink) refuse_link(file_path, path);
  if (!info.exists) {
    throw Error(ErrorCode::Corruption,
                fmt::format("{} is listed in the manifest of {} but missing", f.name, path));
  }
  if (!info.is_regular) {
    env.open(file_path, OpenMode::Read);  // throws, naming what it is (a FIFO, a socket...)
  }
  if (info.size != f.size) {
    throw Error(ErrorCode::Corruption,
                fmt::format("{} is {} bytes but the manifest of {} says {}: the file was "
                            "truncated or replaced",
                            file_path, info.size, path, f.size));
  }
  return file_path;
}

static void check_listed_header(const std::string& file_path, const std::string& path,
                                const ManifestFile& f, std::uint64_t header_checksum) {
  if (header_checksum != f.header_checksum) {
    throw Error(ErrorCode::Corruption,
                fmt::format("{} is not the file the manifest of {} lists (header checksum "
                            "differs): it was replaced",
                            file_path, path));
  }
}

// Loads the container file `f` of the checkpoint `path`, checked against its manifest entry.
static Container load_listed_file(Env& env, const std::string& path, const ManifestFile& f,
                                  const TensorFilter& keep = nullptr,
                                  std::uint64_t* bytes_read = nullptr) {
  std::string file_path = checked_listed_file(env, path, f);
  std::uint64_t header_checksum = 0;
  Container contents = load_container_part(env, file_path, keep, &header_checksum, bytes_read);
  check_listed_header(file_path, path, f, header_checksum);
  return contents;
}

// Loads every shard of `component` and joins them into one container, its tensors in the
// order of the index (the component's own), its state from the last shard.
static Container load_sharded(Env& env, const std::string& path, const Manifest& manifest,
                              const std::string& component) {
  auto index = std::find_if(manifest.shard_indexes.begin(), manifest.shard_indexes.end(),
                            [&](const ManifestShardIndex& i) { return i.component == component; });
  // parse_manifest() checked that each sharded component has exactly one index.
  WeightMap weight_map = read_shard_index(env, path, *index);
  std::vector<std::pair<const ManifestFile*, Container>> shards;
  std::map<std::string, std::vector<std::string>> names;
  for (const ManifestFile& f : manifest.files) {
    if (f.component != component) continue;
    shards.emplace_back(&f, load_listed_file(env, path, f));
    std::vector<std::string>& held = names[f.name];
    for (const auto& [name, tensor] : shards.back().second.tensors) held.push_back(name);
  }
  Problems throwing;
  check_weight_map(weight_map, names, join_path(path, index->name), throwing);
  std::unordered_map<std::string, at::Tensor*> by_name;
  Container out;
  for (auto& [f, contents] : shards) {
    for (auto& [name, tensor] : contents.tensors) by_name.emplace(name, &tensor);
    if (f->shard == f->shards) {
      out.state = std::move(contents.state);
    } else if (!contents.state.empty()) {
      throwing.add(fmt::format("{}: shard {} of {} holds state, which only the last shard does",
                               join_path(path, f->name), f->shard, f->shards));
    }
  }
  out.tensors.reserve(weight_map.size());
  for (const auto& [name, file] : weight_map) {
    out.tensors.emplace_back(name, std::move(*by_name.at(name)));
  }
  return out;
}

DirectoryCheckpoint load_directory(const std::string& path, Env& env) {
  Problems throwing;
  Manifest manifest = load_manifest(env, path, throwing);
  DirectoryCheckpoint out;
  out.info = manifest.info;
  out.torchpoint_version = manifest.torchpoint_version;
  out.libtorch_version = manifest.libtorch_version;
  std::unordered_set<std::string> sharded_done;
  for (const ManifestFile& f : manifest.files) {
    if (f.shards == 0) {
      out.components.push_back({f.component, load_listed_file(env, path, f)});
    } else if (sharded_done.insert(f.component).second) {
      out.components.push_back({f.component, load_sharded(env, path, manifest, f.component)});
    }
  }
  for (const ManifestExtraFile& f : manifest.extra_files) {
    check_extra_file(env, path, f);
    out.extra_files.push_back(f.name);
  }
  // A ZeRO-sharded optimizer is given whole, as one process would have saved it.
  if (manifest.version_major >= kZeroManifestMajor) detail::zero_consolidate(out, path);
  return out;
}

std::size_t consolidate_directory(const std::string& path, const std::string& output,
                                  Env& env) {
  std::size_t shards = 0;
  Problems throwing;
  for (const detail::ZeroLayout& layout :
       detail::zero_layouts(load_manifest(env, path, throwing).info.metadata,
                                               path)) {
    shards += static_cast<std::size_t>(layout.world);
  }
  DirectoryCheckpoint checkpoint = load_directory(path, env);
  SaveDirectoryOptions options;
  if (!checkpoint.extra_files.empty()) {
    options.before_components = [&](const std::string& dir) {
      for (const std::string& name : checkpoint.extra_files) {
        const std::string bytes = env.read_file(join_path(path, name));
        std::unique_ptr<File> file = env.open(join_path(dir, name), OpenMode::CreateExclusive);
        file->write_all(bytes.data(), bytes.size(), 0);
        file->sync();
        file->close();
      }
    };
  }
  save_directory(output, checkpoint.components, checkpoint.info, env, options);
  return shards;
}

// True when a component file's JSON state holds no values: only tensors, as a module's.
static bool tensors_only(const Json& state) {
  auto values = state.find("values");
  return values != state.end() && values->is_object() && values->empty();
}

// Checks `component` (whose first manifest entry is `first`) against `tensors` and adds its
// files to `out` to be copied in. False, with nothing added, when the component does not
// consist of exactly those tensors (names, dtypes, shapes) and tensors only: it is then loaded
// as any other, and whoever restores it says what differs. Throws what load_directory() would
// for a damaged file.
static bool fill_component(Env& env, const std::string& path, const Manifest& manifest,
                           const ManifestFile& first, const NamedTensors& tensors,
                           DirectoryFill* out) {
  std::vector<std::string> mismatches;
  if (first.shards == 0) {
    std::string file_path = checked_listed_file(env, path, first);
    FileFill file(env, file_path, tensors, &mismatches);
    if (!file.fits()) return false;
    check_listed_header(file_path, path, first, file.header_checksum());
    if (!tensors_only(file.state())) return false;
    out->files.push_back(std::move(file));
    return true;
  }
  auto index = std::find_if(
      manifest.shard_indexes.begin(), manifest.shard_indexes.end(),
      [&](const ManifestShardIndex& i) { return i.component == first.component; });
  WeightMap weight_map = read_shard_index(env, path, *index);
  std::unordered_map<std::string, const std::string*> shard_of;
  for (const auto& [name, file] : weight_map) shard_of.emplace(name, &file);
  if (shard_of.size() != tensors.size()) return false;
  std::map<std::string, NamedTensors> by_shard;
  for (const auto& [name, tensor] : tensors) {
    auto found = shard_of.find(name);
    if (found == shard_of.end()) return false;
    by_shard[*found->second].emplace_back(name, tensor);
  }
  std::vector<FileFill> files;
  for (const ManifestFile& f : manifest.files) {
    if (f.component != first.component) continue;
    std::string file_path = checked_listed_file(env, path, f);
    FileFill file(env, file_path, by_shard[f.name], &mismatches);
    if (!file.fits()) return false;  // the shard holds other tensors than its index says
    check_listed_header(file_path, path, f, file.header_checksum());
    if (f.shard == f.shards ? !tensors_only(file.state()) : !file.state().empty()) return false;
    by_shard.erase(f.name);
    files.push_back(std::move(file));
  }
  if (!by_shard.empty()) return false;  // the index names a shard the manifest does not list
  for (FileFill& file : files) out->files.push_back(std::move(file));
  return true;
}

DirectoryFill load_directory_filling(
    const std::string& path, Env& env, const std::map<std::string, NamedTensors>& fill,
    const std::function<bool(const std::string&, const CheckpointInfo&)>& skip,
    const std::function<TensorFilter(const std::string&, const CheckpointInfo&)>& part) {
  Problems throwing;
  Manifest manifest = load_manifest(env, path, throwing);
  DirectoryFill out;
  DirectoryCheckpoint& checkpoint = out.checkpoint;
  checkpoint.info = manifest.info;
  checkpoint.torchpoint_version = manifest.torchpoint_version;
  checkpoint.libtorch_version = manifest.libtorch_version;
  std::unordered_set<std::string> done;
  for (const ManifestFile& f : manifest.files) {
    if (!done.insert(f.component).second) continue;  // a later shard of a component
    if (skip && skip(f.component, manifest.info)) continue;
    if (TensorFilter keep = part && f.shards == 0 ? part(f.component, manifest.info) : nullptr) {
      std::uint64_t read = 0;
      checkpoint.components.push_back({f.component, load_listed_file(env, path, f, keep, &read)});
      out.bytes_read += read;
      continue;
    }
    for (const ManifestFile& g : manifest.files) {
      if (g.component == f.component) out.bytes_read += g.size;
    }
    auto wanted = fill.find(f.component);
    if (wanted != fill.end() && fill_component(env, path, manifest, f, wanted->second, &out)) {
      out.filled.push_back(f.component);
      continue;
    }
    checkpoint.components.push_back({f.component, f.shards == 0
                                                      ? load_listed_file(env, path, f)
                                                      : load_sharded(env, path, manifest,
                                                                     f.component)});
  }
  for (const ManifestExtraFile& f : manifest.extra_files) {
    check_extra_file(env, path, f);
    checkpoint.extra_files.push_back(f.name);
  }
  return out;
}

void DirectoryFill::copy() {
  for (FileFill& file : files) file.copy();
}

VerifyReport verify_directory(const std::string& path, Env& env) {
  VerifyReport report{path, {}, {}};
  Problems collect(&report);
  Manifest manifest;
  try {
    manifest = load_manifest(env, path, collect);
  } catch (const Error& e) {
    report.add(e.what(), e.code());
    return report;
  }
  // A manifest of a newer format (or one that could not be read) says nothing this build can
  // check the files against: its problem is the whole verdict.
  if (!report.ok() && report.worst_code() != ErrorCode::Corruption) return report;
  // A damaged manifest's file list is not to be trusted either way: files it seems not to list
  // are not reported as strays.
  const bool manifest_damaged = !report.ok();
  std::unordered_set<std::string> listed;
  // Sharded component -> shard file -> its tensors, as their headers list them.
  std::map<std::string, std::map<std::string, std::vector<std::string>>> shard_tensors;
  for (const ManifestFile& f : manifest.files) {
    listed.insert(f.name);
    std::string file_path = join_path(path, f.name);
    FileInfo info = env.stat(file_path);
    if (info.is_symlink) {
      try {
        refuse_link(file_path, path);
      } catch (const Error& e) {
        report.add(e.what(), e.code());
      }
      continue;
    }
    if (!info.exists) {
      report.add(fmt::format("{}: listed in the manifest but missing", file_path),
                 ErrorCode::Corruption);
      continue;
    }
    if (!info.is_regular) {
      VerifyReport special = verify(file_path, env);  // names what it is (a FIFO, a socket...)
      for (std::size_t i = 0; i < special.problems.size(); ++i) {
        report.add(std::move(special.problems[i]), special.codes[i]);
      }
      continue;
    }
    if (info.size != f.size) {
      report.add(fmt::format("{}: {} bytes, the manifest says {}", file_path, info.size, f.size),
                 ErrorCode::Corruption);
    }
    VerifyReport file_report = verify(file_path, env);
    for (std::size_t i = 0; i < file_report.problems.size(); ++i) {
      report.add(std::move(file_report.problems[i]), file_report.codes[i]);
    }
    if (file_report.ok()) {
      std::uint64_t header_checksum = 0;
      try {
        std::unique_ptr<File> file = env.open(file_path, OpenMode::Read);
        Problems throwing;
        ContainerHeader header = read_container_header(*file, file_path, throwing);
        header_checksum = header.header_checksum;
        if (f.shards > 0) {
          std::vector<std::string>& held = shard_tensors[f.component][f.name];
          for (std::size_t i : header.caller_order) held.push_back(header.entries[i].name);
        }
        if (header_checksum != f.header_checksum) {
          report.add(fmt::format("{}: header checksum differs from the manifest's", file_path),
                     ErrorCode::Corruption);
        }
      } catch (const Error& e) {
        report.add(e.what(), e.code());
      }
    }
  }
  for (const ManifestExtraFile& f : manifest.extra_files) {
    listed.insert(f.name);
    try {
      check_extra_file(env, path, f);
    } catch (const Error& e) {
      report.add(e.what(), e.code());
    }
  }
  for (const ManifestShardIndex& index : manifest.shard_indexes) {
    listed.insert(index.name);
    try {
      WeightMap weight_map = read_shard_index(env, path, index);
      // Checked against the shards whose headers could be read; the others are reported above.
      const auto& held = shard_tensors[index.component];
      int shards = 0;
      for (const ManifestFile& f : manifest.files) shards += f.component == index.component;
      if (static_cast<int>(held.size()) == shards) {
        check_weight_map(weight_map, held, join_path(path, index.name), collect);
      }
    } catch (const Error& e) {
      report.add(e.what(), e.code());
    }
  }
  if (manifest_damaged) return report;
  try {
    for (const std::string& name : env.list_dir(path)) {
      if (parse_component_file_name(name) && !listed.count(name)) {
        report.add(fmt::format("{}: not listed in the manifest", join_path(path, name)),
                   ErrorCode::Corruption);
      }
    }
  } catch (const Error& e) {
    report.add(e.what(), e.code());
  }
  return report;
}

}  // namespace torchpoint
