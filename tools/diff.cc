// torchpoint diff A B: tensor by tensor (matched by component and name), then JSON state.

#include <fmt/format.h>

#include <cmath>
#include <cstring>
#include <map>

#include "torchpoint/inspect.h"
#include "commands.h"
#include "output.h"

namespace torchpoint::tool {
namespace {

bool same_bytes(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor ca = a.contiguous(), cb = b.contiguous();
  std::uint64_t n = tensor_bytes(ca);
  return n == 0 || std::memcmp(ca.data_ptr(), cb.data_ptr(), n) == 0;
}

// Largest |a - b| over the elements, where equal values (including equal infinities) and
// NaN against NaN count as 0; NaN against a number gives NaN.
double max_abs_difference(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor da = a.to(at::kDouble).contiguous(), db = b.to(at::kDouble).contiguous();
  const double* pa = da.data_ptr<double>();
  const double* pb = db.data_ptr<double>();
  double worst = 0;
  for (std::int64_t i = 0; i < da.numel(); ++i) {
    if (pa[i] == pb[i] || (std::isnan(pa[i]) && std::isnan(pb[i]))) continue;
    double d = std::fabs(pa[i] - pb[i]);
    if (std::isnan(d)) return d;
    worst = std::max(worst, d);
  }
  return worst;
}

struct Row {
  std::string status;  // equal, different, dtype, shape, only_in_a, only_in_b
  std::string key;
  std::string detail;
  Json json;
};

Row compare(const std::string& key, const at::Tensor* a, const at::Tensor* b) {
  Row row{"", key, "", {{"key", key}}};
  if (!b) {
    row.status = "only_in_a";
    row.detail = fmt::format("{} {}", dtype_name(*a), shape_string(*a));
  } else if (!a) {
    row.status = "only_in_b";
    row.detail = fmt::format("{} {}", dtype_name(*b), shape_string(*b));
  } else if (a->scalar_type() != b->scalar_type()) {
    row.status = "dtype";
    row.detail = fmt::format("{} vs {}", dtype_name(*a), dtype_name(*b));
  } else if (!a->sizes().equals(b->sizes())) {
    row.status = "shape";
    row.detail = fmt::format("{} vs {}", shape_string(*a), shape_string(*b));
  } else if (same_bytes(*a, *b)) {
    row.status = "equal";
  } else {
    row.status = "different";
    double d = max_abs_difference(*a, *b);
    row.detail = fmt::format("max abs diff {}", format_double(d));
    if (d == 0) row.detail += " (same values, different bits: -0.0 vs 0.0 or NaN payloads)";
    row.json["max_abs_diff"] = json_double(d);
  }
  row.json["status"] = row.status;
  if (a) row.json["a"] = {{"dtype", dtype_name(*a)}, {"shape", a->sizes().vec()}};
  if (b) row.json["b"] = {{"dtype", dtype_name(*b)}, {"shape", b->sizes().vec()}};
  return row;
}

const char* label(const std::string& status) {
  if (status == "equal") return "equal";
  if (status == "different") return "DIFFERENT";
  if (status == "dtype") return "DTYPE";
  if (status == "shape") return "SHAPE";
  if (status == "only_in_a") return "ONLY IN A";
  return "ONLY IN B";
}

// JSON entries of every component, by "component/key" like tensors.
std::map<std::string, Json> json_entries(const CheckpointView& view) {
  std::map<std::string, Json> out;
  for (const ComponentView& c : view.components) {
    for (const auto& [key, value] : c.state.entries()) {
      if (std::holds_alternative<Json>(value)) {
        out[c.name.empty() ? key : c.name + "/" + key] = std::get<Json>(value);
      }
    }
  }
  return out;
}

}  // namespace

int run_diff(const DiffOptions& options, std::ostream& out) {
  CheckpointView a = open_checkpoint(options.a);
  CheckpointView b = open_checkpoint(options.b);
  std::map<std::string, const at::Tensor*> ta, tb;
  std::vector<TensorRef> refs_a = sorted_tensors(a), refs_b = sorted_tensors(b);
  for (const TensorRef& r : refs_a) ta[r.key()] = &r.tensor;
  for (const TensorRef& r : refs_b) tb[r.key()] = &r.tensor;
  std::map<std::string, bool> keys;
  for (const auto& [k, t] : ta) keys[k] = true;
  for (const auto& [k, t] : tb) keys[k] = true;

  std::vector<Row> rows;
  std::map<std::string, std::size_t> counts;
  for (const auto& [key, unused] : keys) {
    auto ia = ta.find(key), ib = tb.find(key);
    rows.push_back(
        compare(key, ia == ta.end() ? nullptr : ia->second, ib == tb.end() ? nullptr : ib->second));
    ++counts[rows.back().status];
  }

  std::map<std::string, Json> ja = json_entries(a), jb = json_entries(b);
  std::map<std::string, bool> json_keys;
  for (const auto& [k, v] : ja) json_keys[k] = true;
  for (const auto& [k, v] : jb) json_keys[k] = true;
  Json state_rows = Json::array();
  std::vector<std::string> state_lines;
  for (const auto& [key, unused] : json_keys) {
    auto ia = ja.find(key), ib = jb.find(key);
    Json va = ia == ja.end() ? Json(nullptr) : ia->second;
    Json vb = ib == jb.end() ? Json(nullptr) : ib->second;
    if (ia != ja.end() && ib != jb.end() && va == vb) continue;
    std::string status = ia == ja.end() ? "only_in_b" : ib == jb.end() ? "only_in_a" : "different";
    state_rows.push_back({{"key", key}, {"status", status}, {"a", va}, {"b", vb}});
    state_lines.push_back(fmt::format("{}  {}  {} vs {}", label(status), key,
                                      ia == ja.end() ? "(absent)" : va.dump(),
                                      ib == jb.end() ? "(absent)" : vb.dump()));
  }

  bool identical = counts["equal"] == rows.size() && state_rows.empty();
  if (options.json) {
    Json tensors = Json::array();
    for (const Row& r : rows) tensors.push_back(r.json);
    print_json(out, {{"a", a.path},
                     {"b", b.path},
                     {"identical", identical},
                     {"tensors", tensors},
                     {"state", state_rows}});
    return identical ? kExitOk : kExitCheckFailed;
  }
  out << fmt::format("A: {}\nB: {}\n", a.path, b.path);
  Table table({"RESULT", "TENSOR", "DETAIL"});
  for (const Row& r : rows) table.add({label(r.status), r.key, r.detail});
  table.print(out);
  if (!state_lines.empty()) {
    out << "JSON values that differ:\n";
    for (const std::string& line : state_lines) out << "  " << line << '\n';
  }
  out << fmt::format(
      "{} tensors: {} equal, {} different, {} dtype or shape differs, {} only in A, {} only in "
      "B; {} JSON values differ\n",
      rows.size(), counts["equal"], counts["different"], counts["dtype"] + counts["shape"],
      counts["only_in_a"], counts["only_in_b"], state_rows.size());
  out << (identical ? "identical\n" : "not identical\n");
  return identical ? kExitOk : kExitCheckFailed;
}

}  // namespace torchpoint::tool
