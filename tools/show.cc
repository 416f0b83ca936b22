// torchpoint show PATH: what a checkpoint holds.
#include <fmt/format.h>

#include "torchpoint/inspect.h"
#include "commands.h"
#include "output.h"
#include "torchpoint/accelerate_interop.h"

namespace torchpoint::tool {
namespace {

std::string optional_text(const std::optional<std::int64_t>& v) {
  return v ? std::to_string(*v) : "-";
}

Json optional_json(const std::optional<std::int64_t>& v) { return v ? Json(*v) : Json(nullptr); }

// The process that wrote a per-process component (random_states_<rank>), if it is one.
std::optional<int> rank_of(const std::string& component) {
  const std::string prefix = "random_states_";
  if (!component.starts_with(prefix) || component.size() == prefix.size() ||
      component.size() > prefix.size() + 6) {
    return std::nullopt;
  }
  std::string digits = component.substr(prefix.size());
  if (digits.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
  return std::stoi(digits);
}

// The JSON (non-tensor) entries of a component, as one object.
Json json_values(const ComponentView& c) {
  Json values = Json::object();
  for (const auto& [key, value] : c.state.entries()) {
    if (std::holds_alternative<Json>(value)) values[key] = std::get<Json>(value);
  }
  return values;
}

Json to_json(const CheckpointView& view, const std::vector<RecordSeries>& records,
             const std::vector<std::string>& problems) {
  Json components = Json::array();
  for (const ComponentView& c : view.components) {
    Json tensors = Json::array();
    for (const auto& [key, value] : c.state.entries()) {
      if (!std::holds_alternative<at::Tensor>(value)) continue;
      const at::Tensor& t = std::get<at::Tensor>(value);
      tensors.push_back({{"name", key},
                         {"dtype", dtype_name(t)},
                         {"shape", t.sizes().vec()},
                         {"bytes", tensor_bytes(t)}});
    }
    Json component = {{"name", c.name}};
    if (auto rank = rank_of(c.name)) component["rank"] = *rank;
    if (view.is_directory) {
      component["file"] = c.file;
      component["size_bytes"] = c.file_size;
    }
    component["tensors"] = std::move(tensors);
    component["state"] = json_values(c);
    components.push_back(std::move(component));
  }
  Json series = Json::array();
  for (const RecordSeries& r : records) {
    Json values = Json::array();
    for (double v : r.values) values.push_back(json_double(v));
    series.push_back({{"where", r.where},
                      {"set", r.set},
                      {"metric", r.metric},
                      {"count", r.values.size()},
                      {"last", r.values.empty() ? Json(nullptr) : json_double(r.values.back())},
                      {"values", values}});
  }
  return {
      {"path", view.path},
      {"kind", view.is_directory ? "directory" : "file"},
      {"size_bytes", view.size_bytes},
      {"step", optional_json(view.step)},
      {"iteration", optional_json(view.iteration)},
      {"created_unix_ms", optional_json(view.created_unix_ms)},
      {"versions",
       {{"format", view.format_version},
        {"torchpoint", view.torchpoint_version},
        {"libtorch", view.libtorch_version}}},
      {"processes", view.is_directory ? Json(world_size_of(view.metadata)) : Json(nullptr)},
      {"metadata", view.metadata},
      {"components", components},
      {"records", series},
      {"problems", problems},
  };
}

std::string or_dash(const std::string& s) { return s.empty() ? "-" : s; }

}  // namespace

int run_show(const ShowOptions& options, std::ostream& out) {
  if (is_accelerate_checkpoint(options.path)) return show_accelerate(options.path, options.json, out);
  CheckpointView view = open_checkpoint(options.path);
  std::vector<std::string> problems;
  std::vector<RecordSeries> records = metric_records(view, &problems);
  if (options.json) {
    print_json(out, to_json(view, records, problems));
    return kExitOk;
  }
  out << fmt::format("{} ({} checkpoint, {} bytes)\n", view.path,
                     view.is_directory ? "directory" : "file", view.size_bytes);
  Table summary({"step", optional_text(view.step)});
  summary.add({"iteration", optional_text(view.iteration)});
  if (view.created_unix_ms) summary.add({"created", iso_time(*view.created_unix_ms)});
  summary.add({"versions",
               fmt::format("format {}, torchpoint {}, LibTorch {}", or_dash(view.format_version),
                           or_dash(view.torchpoint_version), or_dash(view.libtorch_version))});
  if (view.is_directory) {
    int world = world_size_of(view.metadata);
    summary.add({"processes", world == 1 ? "1"
                                         : fmt::format("{} (random_states_0 .. {} are each "
                                                       "one process's RNG states)",
                                                       world, world - 1)});
    const Json* node = nullptr;
    if (view.metadata.is_object() && view.metadata.contains("accelerator") &&
        view.metadata["accelerator"].is_object() &&
        view.metadata["accelerator"].contains("node")) {
      node = &view.metadata["accelerator"]["node"];
    }
    if (node != nullptr && node->is_object()) {
      summary.add({"node", fmt::format("{} of {}: this node's copy (save_on_each_node), with the "
                                       "RNG states of ranks {} only",
                                       node->value("index", -1), node->value("count", -1),
                                       node->contains("ranks") ? (*node)["ranks"].dump() : "?")});
    }
    summary.add({"metadata", view.metadata.dump()});
  }
  summary.print(out, "  ");

  for (const ComponentView& c : view.components) {
    std::string title = c.name.empty() ? "(top level)" : c.name;
    out << '\n'
        << (view.is_directory
                ? fmt::format("component {} ({}, {} bytes{})\n", title, c.file, c.file_size,
                              rank_of(c.name) ? fmt::format(", rank {}", *rank_of(c.name)) : "")
            : c.name.empty() ? fmt::format("component {} (keys without a dot)\n", title)
                             : fmt::format("component {} (keys {}.*)\n", title, c.name));
    Table tensors({"TENSOR", "DTYPE", "SHAPE", "BYTES"});
    std::size_t count = 0;
    for (const auto& [key, value] : c.state.entries()) {
      if (!std::holds_alternative<at::Tensor>(value)) continue;
      const at::Tensor& t = std::get<at::Tensor>(value);
      tensors.add({key, dtype_name(t), shape_string(t), std::to_string(tensor_bytes(t))});
      ++count;
    }
    if (count > 0) tensors.print(out, "  ");
    Json values = json_values(c);
    if (!values.empty()) out << "  state: " << values.dump() << '\n';
    if (count == 0 && values.empty()) out << "  (empty)\n";
  }

  if (!records.empty()) {
    out << "\nrecords\n";
    Table table({"WHERE", "SET", "METRIC", "COUNT", "LAST"});
    for (const RecordSeries& r : records) {
      table.add({r.where, r.set, r.metric, std::to_string(r.values.size()),
                 r.values.empty() ? "-" : format_double(r.values.back())});
    }
    table.print(out, "  ");
  }
  for (const std::string& p : problems) out << "warning: " << p << '\n';
  return kExitOk;
}

}  // namespace torchpoint::tool
