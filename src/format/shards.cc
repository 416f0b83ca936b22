#include "format/shards.h"

#include <ATen/core/Tensor.h>
#include <fmt/format.h>

#include <unordered_map>

#include "format/checksum.h"
#include "format/json_depth.h"
#include "format/ordered_json.h"
#include "format/staging_gate.h"
#include "io/filename.h"
#include "torchpoint/error.h"

namespace torchpoint {
namespace {

std::uint64_t payload_bytes(const at::Tensor& t) {
  return static_cast<std::uint64_t>(t.numel()) * static_cast<std::uint64_t>(t.element_size());
}

// Greedy packing in order: a shard closes before the tensor that would take it over `limit`.
void pack(const Component& component, const std::vector<std::size_t>& indexes,
          std::uint64_t limit, std::vector<std::vector<std::size_t>>& out) {
  std::vector<std::size_t> current;
  std::uint64_t current_bytes = 0;
  for (std::size_t i : indexes) {
    std::uint64_t bytes = payload_bytes(component.contents.tensors[i].second);
    if (!current.empty() && current_bytes + bytes > limit) {
      out.push_back(std::move(current));
      current.clear();
      current_bytes = 0;
    }
    current.push_back(i);
    current_bytes += bytes;
  }
  if (!current.empty()) out.push_back(std::move(current));
}

std::uint64_t tensor_checksum(const at::Tensor& tensor) {
  at::Tensor t = tensor.device().is_cpu() ? tensor.contiguous() : tensor.cpu().contiguous();
  std::uint64_t bytes = payload_bytes(t);
  // In a background save the bytes may still be on their way into the staging buffer.
  if (const detail::StagingGate* gate = detail::current_staging_gate; gate && bytes > 0) {
    gate->wait_for(t.data_ptr(), static_cast<std::size_t>(bytes));
  }
  return bytes > 0 ? xxh3(t.data_ptr(), bytes) : Xxh3Stream().digest();
}

[[noreturn]] void corrupt(const std::string& message) {
  throw Error(ErrorCode::Corruption, message);
}

}  // namespace

std::vector<std::vector<std::size_t>> plan_shards(const Component& component,
                                                  std::uint64_t shard_size,
                                                  const std::unordered_set<std::string>& frozen) {
  std::vector<std::vector<std::size_t>> out;
  const NamedTensors& tensors = component.contents.tensors;
  std::uint64_t total = 0;
  for (const auto& [name, tensor] : tensors) total += payload_bytes(tensor);
  if (shard_size == 0 || total <= shard_size) return out;
  std::vector<std::size_t> fixed, changing;
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    bool is_frozen = frozen.count(fmt::format("{}/{}", component.name, tensors[i].first)) > 0;
    (is_frozen ? fixed : changing).push_back(i);
  }
  pack(component, fixed, shard_size, out);
  pack(component, changing, shard_size, out);
  return out;
}

LinkSource::LinkSource(Env& env, const std::string& path) : env_(env), path_(path) {}

void LinkSource::read_manifest() const {
  if (path_.empty()) return;
  try {
    std::string manifest_path = join_path(path_, kManifestFileName);
    FileInfo info = env_.stat(manifest_path);
    if (!info.exists || info.is_symlink || !info.is_regular || info.size > kMaxManifestSize) return;
    committed_ns_ = info.modified_ns;
    Problems throwing;
    Manifest manifest = parse_manifest(env_.read_file(manifest_path), manifest_path, throwing);
    for (const ManifestFile& f : manifest.files) {
      if (f.shards > 0) shards_.emplace(f.name, f);
    }
  } catch (const Error&) {
    // Deliberately swallowed: a checkpoint that cannot be read offers nothing to share, and the
    // save then writes every shard, which is always correct.
    shards_.clear();
  }
}

std::optional<std::pair<std::string, ManifestFile>> LinkSource::find(
    const std::string& file_name, const Container& contents) const {
  std::call_once(read_, [this] { read_manifest(); });
  auto listed = shards_.find(file_name);
  if (listed == shards_.end()) return std::nullopt;
  const ManifestFile& entry = listed->second;
  std::string file_path = join_path(path_, file_name);
  try {
    FileInfo info = env_.stat(file_path);
    // Written before the manifest, so never newer than it unless changed after the commit.
    if (!info.exists || info.is_symlink || !info.is_regular || info.size != entry.size ||
        info.modified_ns > committed_ns_) {
      return std::nullopt;
    }
    std::unique_ptr<File> file = env_.open(file_path, OpenMode::Read);
    Problems throwing;
    ContainerHeader header = read_container_header(*file, file_path, throwing);
    if (header.foreign || header.header_checksum != entry.header_checksum ||
        header.caller_order.size() != contents.tensors.size() ||
        // No state is written as an empty object, and read back as one.
        header.state != (contents.state.is_null() ? Json::object() : contents.state)) {
      return std::nullopt;
    }
    // Names, dtypes and shapes first: cheap, and they settle most changed shards.
    for (std::size_t i = 0; i < contents.tensors.size(); ++i) {
      const TensorEntry& e = header.entries[header.caller_order[i]];
      const auto& [name, tensor] = contents.tensors[i];
      if (e.name != name || e.dtype.type != tensor.scalar_type() ||
          e.shape != tensor.sizes().vec()) {
        return std::nullopt;
      }
    }
    // Then the bytes, as they are in memory now: a tensor changed in place differs here.
    for (std::size_t i = 0; i < contents.tensors.size(); ++i) {
      const TensorEntry& e = header.entries[header.caller_order[i]];
      if (tensor_checksum(contents.tensors[i].second) != e.checksum) return std::nullopt;
    }
    return std::make_pair(file_path, entry);
  } catch (const std::exception&) {
    // Deliberately swallowed: a shard that cannot be read or compared is written anew.
    return std::nullopt;
  }
}

std::string shard_index_text(const WeightMap& weight_map, std::uint64_t total_size) {
  Json map = Json::object();
  for (const auto& [tensor, file] : weight_map) append_new_key(map, tensor, file);
  Json root = Json::object();
  root["metadata"] = {{"total_size", total_size}};
  root["weight_map"] = std::move(map);
  return root.dump(2) + "\n";
}

WeightMap parse_shard_index(const std::string& text, const std::string& index_path) {
  // The caller checked these bytes against the manifest, so they are the ones torchpoint
  // wrote; the checks below guard against a manifest and index forged together.
  Json root;
  try {
    if (!json_depth_within(text)) throw std::runtime_error("nested too deep");
    root = parse_ordered_json(text);
  } catch (const std::exception&) {
    corrupt(fmt::format("{} is not valid JSON", index_path));
  }
  auto map = root.is_object() ? root.find("weight_map") : root.end();
  if (!root.is_object() || map == root.end() || !map->is_object()) {
    corrupt(fmt::format("{} has no \"weight_map\" object", index_path));
  }
  WeightMap out;
  out.reserve(map->size());
  for (const auto& [tensor, file_name] : map->items()) {
    if (!file_name.is_string()) {
      corrupt(fmt::format("{}: the shard of tensor '{}' is not a file name", index_path, tensor));
    }
    out.emplace_back(tensor, file_name.get<std::string>());
  }
  return out;
}

void check_weight_map(const WeightMap& weight_map,
                      const std::map<std::string, std::vector<std::string>>& shard_tensors,
                      const std::string& index_path, Problems& problems) {
  std::unordered_map<std::string, const std::string*> mapped;
  for (const auto& [tensor, file] : weight_map) {
    if (!mapped.emplace(tensor, &file).second) {
      problems.add(fmt::format("{}: tensor '{}' is mapped twice", index_path, tensor));
    }
  }
  std::size_t held = 0;
  for (const auto& [file, tensors] : shard_tensors) {
    for (const std::string& tensor : tensors) {
      ++held;
      auto it = mapped.find(tensor);
      if (it == mapped.end() || *it->second != file) {
        problems.add(fmt::format("{}: tensor '{}' of {} is {}", index_path, tensor, file,
                                 it == mapped.end() ? "not in the weight map"
                                                    : "mapped to " + *it->second));
      }
    }
  }
  if (held != mapped.size()) {
    problems.add(fmt::format("{}: the weight map names {} tensors, the shards hold {}", index_path,
                             mapped.size(), held));
  }
}

}  // namespace torchpoint
