#include "torchpoint/inspect.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <set>

#include "checkpoint/file_metadata.h"
#include "format/container.h"
#include "format/dtype.h"
#include "format/manifest.h"
#include "format/zero_shards.h"
#include "format/ordered_json.h"
#include "io/filename.h"
#include "torchpoint/checkpoint_dir.h"
#include "torchpoint/data_position.h"
#include "torchpoint/error.h"

namespace torchpoint {
using detail::file_metadata;
namespace {

// A container's contents as a StateDict. Files written from a StateDict keep their key order
// under "order"; any other container gives its tensors, then its raw state's keys.
StateDict to_state_dict(const Container& container) {
  auto order = container.state.find("order");
  if (order != container.state.end() && order->is_array()) {
    return StateDict::from_container(container);
  }
  StateDict out;
  for (const auto& [name, tensor] : container.tensors) out.set(name, tensor);
  for (const auto& [key, value] : container.state.items()) out.set(key, value);
  return out;
}

std::optional<std::int64_t> integer_value(const StateDict& state, const std::string& key) {
  if (!state.contains(key) || state.is_tensor(key)) return std::nullopt;
  const Json& v = state.value(key);
  if (!v.is_number_integer()) return std::nullopt;
  return v.get<std::int64_t>();
}

bool holds_checkpoints(Env& env, const std::string& dir) {
  if (env.stat(join_path(dir, "checkpoints")).is_directory) return true;
  try {
    for (const std::string& name : env.list_dir(dir)) {
      if (parse_checkpoint_name(name)) return true;
    }
  } catch (const Error&) {
    // Only a hint for the error message that follows: an unreadable directory gives none.
  }
  return false;
}

CheckpointView open_directory(Env& env, const std::string& path) {
  std::string manifest_path = join_path(path, kManifestFileName);
  if (!env.stat(manifest_path).exists) {
    std::string hint =
        holds_checkpoints(env, path)
            ? fmt::format("it holds checkpoints: list them with `torchpoint ls {}`", path)
            : "it is not a torchpoint checkpoint, or its save never committed";
    throw Error(ErrorCode::NotFound,
                fmt::format("{} has no {}: {}", path, kManifestFileName, hint));
  }
  CheckpointView view;
  view.path = path;
  view.is_directory = true;
  DirectoryCheckpoint checkpoint = load_directory(path, env);
  Problems throwing;
  Manifest manifest = parse_manifest(env.read_file(manifest_path), manifest_path, throwing);
  view.format_version = fmt::format("{}.{}", manifest.version_major, manifest.version_minor);
  view.torchpoint_version = manifest.torchpoint_version;
  view.libtorch_version = manifest.libtorch_version;
  view.created_unix_ms = manifest.created_unix_ms;
  view.step = manifest.info.step;
  view.iteration = manifest.info.iteration;
  view.metadata = manifest.info.metadata;
  view.size_bytes = env.stat(manifest_path).size;
  for (std::size_t i = 0; i < checkpoint.components.size(); ++i) {
    const Component& c = checkpoint.components[i];
    ComponentView component;
    component.name = c.name;
    component.file = component_file_name(c.name);
    for (const ManifestFile& f : manifest.files) {
      if (f.component != c.name) continue;
      component.file_size += f.size;
      if (f.shards > 0) {
        component.file = fmt::format("{} shards {}-*-of-{:05d}{}", f.shards, c.name, f.shards,
                                     kContainerExtension);
      }
    }
    for (const ManifestShardIndex& index : manifest.shard_indexes) {
      if (index.component != c.name) continue;
      component.file += " and " + index.name;
      component.file_size += index.size;
    }
    view.size_bytes += component.file_size;
    component.state = to_state_dict(c.contents);
    component.state.set_description(c.name);
    view.components.push_back(std::move(component));
  }
  return view;
}

CheckpointView open_file(Env& env, const std::string& path) {
  CheckpointView view;
  view.path = path;
  Container contents = load_file(path, env);
  view.size_bytes = env.stat(path).size;
  Json metadata = file_metadata(path);
  view.format_version = string_field(metadata, "format_version");
  view.torchpoint_version = string_field(metadata, "torchpoint_version");
  view.libtorch_version = string_field(metadata, "libtorch_version");
  StateDict all = to_state_dict(contents);
  // Components in the order of their first key.
  for (const auto& [key, value] : all.entries()) {
    std::size_t dot = key.find('.');
    std::string component_name = dot == std::string::npos ? "" : key.substr(0, dot);
    std::string name = dot == std::string::npos ? key : key.substr(dot + 1);
    auto it = std::find_if(view.components.begin(), view.components.end(),
                           [&](const ComponentView& c) { return c.name == component_name; });
    if (it == view.components.end()) {
      view.components.push_back({component_name, "", 0, StateDict()});
      it = view.components.end() - 1;
      it->state.set_description(component_name.empty() ? base_name(path) : component_name);
    }
    if (std::holds_alternative<at::Tensor>(value)) {
      it->state.set(name, std::get<at::Tensor>(value));
    } else {
      it->state.set(name, std::get<Json>(value));
    }
  }
  for (const char* source : {"", "counters"}) {
    if (const ComponentView* c = find_component(view, source)) {
      if (!view.step) view.step = integer_value(c->state, "step");
      if (!view.iteration) view.iteration = integer_value(c->state, "iteration");
    }
  }
  return view;
}

void collect_records(const std::string& where, const StateDict& state,
                     std::vector<RecordSeries>& out, std::vector<std::string>* problems) {
  MetricRecords records;
  try {
    records.load_state_dict(state);
  } catch (const Error& e) {
    if (problems) {
      problems->push_back(fmt::format("{}: not readable as metric records: {}", where, e.what()));
    }
    return;
  }
  for (const auto& [set, metric] : records.series()) {
    out.push_back({where, set, metric, records.values(set, metric)});
  }
}

}  // namespace

CheckpointView open_checkpoint(const std::string& path) {
  Env& env = Env::posix();
  FileInfo info = env.stat(path);
  if (!info.exists) {
    throw Error(ErrorCode::NotFound, fmt::format("{} does not exist", path));
  }
  return info.is_directory ? open_directory(env, path) : open_file(env, path);
}

int world_size_of(const Json& metadata) {
  if (!metadata.is_object()) return 1;
  auto acc = metadata.find("accelerator");
  if (acc == metadata.end() || !acc->is_object()) return 1;
  auto world = acc->find("world_size");
  return world != acc->end() && world->is_number_integer() ? world->get<int>() : 1;
}

std::vector<std::string> missing_rank_files(const std::string& path) {
  Env& env = Env::posix();
  std::string manifest_path = path + "/manifest.json";
  if (!env.stat(path).is_directory || !env.stat(manifest_path).is_regular) return {};
  Manifest manifest;
  try {
    std::unique_ptr<File> file = env.open(manifest_path, OpenMode::Read);
    if (file->size() > kMaxManifestSize) return {};
    std::string bytes(file->size(), '\0');
    file->read_exact(bytes.data(), bytes.size(), 0);
    Problems throwing;
    manifest = parse_manifest(bytes, manifest_path, throwing);
  } catch (const std::exception&) {
    return {};  // verify() names what is wrong with the manifest itself
  }
  // Only a checkpoint that says how many processes wrote it (the Accelerator's) has RNG files to
  // expect; save_directory's own and older ones do not.
  const Json& meta = manifest.info.metadata;
  if (!meta.is_object() || !meta.contains("accelerator") || !meta["accelerator"].is_object() ||
      !meta["accelerator"].contains("world_size")) {
    return {};
  }
  const int world = world_size_of(meta);
  // A node's copy of save_on_each_node holds the RNG states of that node's processes only.
  std::vector<int> ranks;
  const Json& acc = meta["accelerator"];
  if (acc.contains("node") && acc["node"].is_object() && acc["node"].contains("ranks") &&
      acc["node"]["ranks"].is_array()) {
    for (const Json& r : acc["node"]["ranks"]) {
      if (r.is_number_integer()) ranks.push_back(r.get<int>());
    }
  } else {
    for (int r = 0; r < world; ++r) ranks.push_back(r);
  }
  std::set<std::string> listed;
  for (const ManifestFile& f : manifest.files) listed.insert(f.component);
  std::vector<std::string> problems;
  for (int r : ranks) {
    std::string name = fmt::format("random_states_{}", r);
    if (!listed.count(name)) {
      problems.push_back(
          fmt::format("{}: written by {} processes, but the manifest lists no {} "
                      "(the RNG states of rank {})",
                      path, world, name, r));
    }
  }
  // Under ZeRO, every process's shard of each sharded optimizer.
  std::vector<detail::ZeroLayout> layouts;
  try {
    layouts = detail::zero_layouts(meta, path);
  } catch (const Error& e) {
    problems.push_back(e.what());
  }
  for (const detail::ZeroLayout& layout : layouts) {
    for (int r = 0; r < layout.world; ++r) {
      std::string name = detail::zero_shard_name(layout.optimizer, r);
      if (!listed.count(name)) {
        problems.push_back(fmt::format(
            "{}: {} was sharded over {} processes (ZeRO), but the manifest lists no {} (rank "
            "{}'s part of its state)",
            path, layout.optimizer, layout.world, name, r));
      }
    }
  }
  return problems;
}

const ComponentView* find_component(const CheckpointView& view, const std::string& name) {
  for (const ComponentView& c : view.components) {
    if (c.name == name) return &c;
  }
  return nullptr;
}

std::string component_names(const CheckpointView& view) {
  std::string out;
  for (const ComponentView& c : view.components) {
    if (!out.empty()) out += ", ";
    out += c.name.empty() ? "(top level: --component \"\")" : c.name;
  }
  return out.empty() ? "(none)" : out;
}

std::vector<TensorRef> sorted_tensors(const ComponentView& component) {
  std::vector<TensorRef> out;
  for (const auto& [key, value] : component.state.entries()) {
    if (std::holds_alternative<at::Tensor>(value)) {
      out.push_back({component.name, key, std::get<at::Tensor>(value)});
    }
  }
  std::sort(out.begin(), out.end(),
            [](const TensorRef& a, const TensorRef& b) { return a.key() < b.key(); });
  return out;
}

std::vector<TensorRef> sorted_tensors(const CheckpointView& view) {
  std::vector<TensorRef> out;
  for (const ComponentView& c : view.components) {
    std::vector<TensorRef> part = sorted_tensors(c);
    out.insert(out.end(), part.begin(), part.end());
  }
  std::sort(out.begin(), out.end(),
            [](const TensorRef& a, const TensorRef& b) { return a.key() < b.key(); });
  return out;
}

std::vector<RecordSeries> metric_records(const CheckpointView& view,
                                         std::vector<std::string>* problems) {
  std::vector<RecordSeries> out;
  for (const ComponentView& c : view.components) {
    if (c.name == "records" && c.state.contains("index")) {
      collect_records("records", c.state, out, problems);
    } else if (c.state.has_child("records") && c.state.child("records").contains("index")) {
      StateDict child = c.state.child("records");
      std::string where = c.name.empty() ? "records" : c.name + "/records";
      child.set_description(where);
      collect_records(where, child, out, problems);
    }
  }
  return out;
}

std::string dtype_name(const at::Tensor& tensor) {
  try {
    return std::string(dtype_info(tensor.scalar_type(), "").name);
  } catch (const Error&) {
    // Tensors read from a checkpoint always have a safetensors dtype; this is for safety only.
    return "?";
  }
}

std::string shape_string(const at::Tensor& tensor) {
  return fmt::format("[{}]", fmt::join(tensor.sizes(), ", "));
}

std::uint64_t tensor_bytes(const at::Tensor& tensor) {
  return static_cast<std::uint64_t>(tensor.numel()) * tensor.element_size();
}

}  // namespace torchpoint
