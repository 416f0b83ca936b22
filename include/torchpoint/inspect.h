// Looking into a checkpoint from code, as the `torchpoint` command-line tool does (show, verify,
// diff, digest, ls and plot use only this and the other public headers): its components, files,
// tensors, JSON values, versions, world size, metric records and a content digest.
//
// A directory checkpoint's components are its files (model.safetensors -> "model"). A file
// checkpoint (save_file of a StateDict built with set_child, e.g. state.ckpt) has no files per
// component: there the component of an entry is the first dotted part of its key
// ("model.fc.weight" -> component "model", name "fc.weight"), and an entry without a dot
// belongs to the unnamed top-level component "". With that rule a directory checkpoint and a
// file checkpoint of the same state show the same components, tensors and digest.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "torchpoint/state_dict.h"

namespace torchpoint {

struct ComponentView {
  std::string name;             // "" for top-level entries of a file checkpoint
  std::string file;             // file name in a directory checkpoint; "" in a file checkpoint
  std::uint64_t file_size = 0;  // bytes of that file (directory checkpoints)
  StateDict state;              // tensors and JSON values, keys relative to the component
};

struct CheckpointView {
  std::string path;
  bool is_directory = false;
  std::uint64_t size_bytes = 0;  // every file of the checkpoint
  std::string format_version;
  std::string torchpoint_version;
  std::string libtorch_version;
  std::optional<std::int64_t> created_unix_ms;  // directory checkpoints only
  // From the manifest for a directory checkpoint; for a file checkpoint from a JSON value
  // "step"/"iteration" at the top level or in a "counters" component, when there is one.
  std::optional<std::int64_t> step;
  std::optional<std::int64_t> iteration;
  Json metadata = Json::object();  // the manifest's (directory checkpoints)
  std::vector<ComponentView> components;
};

// Loads and verifies the checkpoint at `path` (every checksum). Throws torchpoint::Error:
// NotFound for a missing path or a directory without manifest.json (with a hint when it holds
// checkpoints), Corruption for damaged files, Incompatible for a newer format.
CheckpointView open_checkpoint(const std::string& path);

// The number of processes that wrote a directory checkpoint (the manifest's
// metadata.accelerator.world_size; 1 when absent), from its metadata.
int world_size_of(const Json& metadata);
// What a directory checkpoint's manifest at `path` lacks for the processes that wrote it: one
// problem per rank whose random_states_<rank> file it does not list. Empty when complete, when
// the manifest does not record the number of processes (metadata.accelerator.world_size), and
// for anything that is not a readable directory checkpoint (verify reports those).
std::vector<std::string> missing_rank_files(const std::string& path);

// The component named `name`, or nullptr.
const ComponentView* find_component(const CheckpointView& view, const std::string& name);
// "model, optimizer, records" (the top-level component shows as "(top level)").
std::string component_names(const CheckpointView& view);

struct TensorRef {
  std::string component;
  std::string name;
  at::Tensor tensor;
  // "component/name", or "name" in the top-level component: the key diff and digest match on.
  std::string key() const { return component.empty() ? name : component + "/" + name; }
};

// Every tensor of the checkpoint, or of one component, sorted by key (byte order).
std::vector<TensorRef> sorted_tensors(const CheckpointView& view);
std::vector<TensorRef> sorted_tensors(const ComponentView& component);

// One (set, metric) series of a MetricRecords state found in the checkpoint.
struct RecordSeries {
  std::string where;  // "records" or "<component>/records"
  std::string set;
  std::string metric;
  std::vector<double> values;
};

// The metric records of the checkpoint: a component named "records" holding MetricRecords'
// state_dict ("index" and "series.<i>"), or such a state under the "records." prefix of any
// component. A records state that does not parse is reported in `problems`.
std::vector<RecordSeries> metric_records(const CheckpointView& view,
                                         std::vector<std::string>* problems = nullptr);

// Safetensors name of a tensor's dtype ("F32"); "?" for one the format cannot hold.
std::string dtype_name(const at::Tensor& tensor);
// "[2, 3]".
std::string shape_string(const at::Tensor& tensor);
std::uint64_t tensor_bytes(const at::Tensor& tensor);

// SHA-256 over the tensors in `tensors` (already in canonical order: sorted by key), encoded
// as follows, integers as 8-byte little-endian unsigned:
//   "torchpoint-digest-v1\n"
//   then for each tensor: len(key) key  len(dtype) dtype  ndim  dim...  len(data) data
// where key is "component/name" (just "name" in a file checkpoint's top level), dtype the
// safetensors name ("F32"), and data the tensor's bytes in row-major order, little endian.
// JSON values and file layout (order, alignment, metadata, checksums) do not enter it.
std::string tensor_digest(const std::vector<TensorRef>& tensors);

}  // namespace torchpoint
