// Python Accelerate's checkpoint directories described for a person (torchpoint show).
#include "python/accelerate_files.h"

#include <ATen/ops/scalar_tensor.h>
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <set>

#include "format/container.h"
#include "io/atomic_commit.h"
#include "io/filename.h"
#include "python/torch_value.h"
#include "torchpoint/accelerate_interop.h"
#include "torchpoint/checkpoint_dir.h"
#include "torchpoint/error.h"
#include "torchpoint/interop.h"
#include "torchpoint/tensor_file.h"

namespace torchpoint {

namespace detail {
namespace {

constexpr std::size_t kMaxValues = 500;

std::string torch_dtype_name(c10::ScalarType type) {
  static const std::map<c10::ScalarType, std::string> kNames = {
      {at::kFloat, "float32"}, {at::kDouble, "float64"}, {at::kHalf, "float16"},
      {at::kBFloat16, "bfloat16"}, {at::kLong, "int64"}, {at::kInt, "int32"},
      {at::kShort, "int16"}, {at::kChar, "int8"}, {at::kByte, "uint8"}, {at::kBool, "bool"}};
  auto it = kNames.find(type);
  return it != kNames.end() ? it->second : c10::toString(type);
}

std::string tensor_text(const at::Tensor& t) {
  return fmt::format("{} [{}]", torch_dtype_name(t.scalar_type()), fmt::join(t.sizes(), ", "));
}

bool is_scalar(const PyValue& v) {
  return v.is(Kind::kInt) || v.is(Kind::kFloat) || v.is(Kind::kBool) || v.is(Kind::kNone);
}

std::string scalar_text(const PyValue& v) {
  switch (v.kind) {
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return v.boolean ? "True" : "False";
    case Kind::kInt:
      return std::to_string(v.integer);
    default:
      return fmt::format("{}", v.number);
  }
}

// Every leaf of `v` under `path`, as (path, text).
void describe(const PyValue& v, const std::string& path, AccelerateFileView& out,
              std::size_t& more) {
  auto add = [&](std::string text) {
    if (out.values.size() < kMaxValues) {
      out.values.emplace_back(path.empty() ? "(value)" : path, std::move(text));
    } else {
      ++more;
    }
  };
  auto child = [&](const std::string& key) { return path.empty() ? key : path + "." + key; };
  switch (v.kind) {
    case Kind::kStr:
      return add(Json(v.text.size() > 80 ? v.text.substr(0, 77) + "..." : v.text).dump());
    case Kind::kBytes:
      return add(fmt::format("{} bytes", v.text.size()));
    case Kind::kTensor:
      return add(tensor_text(v.tensor));
    case Kind::kArray:
      return add(fmt::format("numpy {} [{}]", v.type, fmt::join(v.shape, ", ")));
    case Kind::kTuple:
    case Kind::kList: {
      const bool tuple = v.is(Kind::kTuple);
      if (v.items.empty()) return add(tuple ? "()" : "[]");
      const bool scalars = std::all_of(v.items.begin(), v.items.end(), is_scalar);
      if (scalars && v.items.size() <= 8) {
        std::vector<std::string> texts;
        for (const PyValue& item : v.items) texts.push_back(scalar_text(item));
        const std::string joined = fmt::format("{}", fmt::join(texts, ", "));
        return add(tuple ? "(" + joined + ")" : "[" + joined + "]");
      }
      if (scalars) {
        const bool ints = std::all_of(v.items.begin(), v.items.end(),
                                      [](const PyValue& i) { return i.is(Kind::kInt); });
        return add(fmt::format("{} {} {}", tuple ? "tuple of" : "list of", v.items.size(),
                               ints ? "ints" : "numbers"));
      }
      for (std::size_t i = 0; i < v.items.size(); ++i) {
        describe(v.items[i], child(std::to_string(i)), out, more);
      }
      return;
    }
    case Kind::kDict:
      if (v.entries.empty()) return add(v.type == "dict" ? "{}" : v.type_name() + "()");
      for (const auto& [key, value] : v.entries) {
        describe(value, child(key.is(Kind::kStr) ? key.text : scalar_text(key)), out, more);
      }
      return;
    default:
      return add(scalar_text(v));
  }
}

// The kind of an Accelerate file: its stem's kind, when it has that kind's extension.
std::string kind_of_file(const std::string& name) {
  const std::size_t dot = name.find('.');
  if (dot == std::string::npos) return "other";
  std::string_view stem = std::string_view(name).substr(0, dot);
  const std::string_view extension = std::string_view(name).substr(dot);
  const bool pickled_model = stem.starts_with("pytorch_");  // pytorch_model.bin
  if (pickled_model) stem.remove_prefix(std::string_view("pytorch_").size());
  const std::string kind = component_kind(stem);
  const std::string_view expected = kind == "model"  ? (pickled_model ? ".bin" : ".safetensors")
                                    : kind == "scaler" ? ".pt"
                                    : kind == "custom" || kind == "random_states" ? ".pkl"
                                                                                  : ".bin";
  return !kind.empty() && extension == expected && (!pickled_model || kind == "model") ? kind
                                                                                       : "other";
}

std::string summary_of(const std::string& kind, const PyValue& v) {
  if (kind == "optimizer") {
    const PyValue* groups = v.find("param_groups");
    const PyValue* state = v.find("state");
    if (groups == nullptr || !groups->is(Kind::kList) || groups->items.empty()) return "";
    std::string type = python_optimizer_type(groups->items[0]);
    return fmt::format("torch.optim.{}, {} param group{}, state for {} parameters",
                       type.empty() ? "(unknown type)" : type, groups->items.size(),
                       groups->items.size() == 1 ? "" : "s",
                       state != nullptr ? state->entries.size() : 0);
  }
  if (kind == "scheduler" || kind == "custom") {
    const PyValue* last = v.find("last_epoch");
    const PyValue* lr = v.find("_last_lr");
    if (last != nullptr && lr != nullptr && lr->is(Kind::kList) && !lr->items.empty()) {
      return fmt::format("an LR scheduler: last_epoch {}, last lr {}", scalar_text(*last),
                         scalar_text(lr->items[0]));
    }
    return v.is(Kind::kDict) ? fmt::format("{} of {} entries", v.type_name(), v.entries.size())
                             : v.type_name();
  }
  if (kind == "random_states") {
    std::vector<std::string> parts;
    if (const PyValue* step = v.find("step")) parts.push_back("step " + scalar_text(*step));
    for (const auto& [key, _] : v.entries) {
      if (!key.is(Kind::kStr) || key.text == "step") continue;
      parts.push_back(key.text == "torch_manual_seed"   ? "torch CPU generator (restored in C++)"
                      : key.text == "random_state"      ? "Python random (not applicable in C++)"
                      : key.text == "numpy_random_seed" ? "NumPy (not applicable in C++)"
                                                        : key.text + " (an accelerator's)");
    }
    return fmt::format("{}", fmt::join(parts, "; "));
  }
  return v.is(Kind::kDict) ? fmt::format("{} of {} entries", v.type_name(), v.entries.size())
                           : v.type_name();
}

}  // namespace
}  // namespace detail

AccelerateView inspect_accelerate_checkpoint(const std::string& dir, Env& env) {
  if (!is_accelerate_checkpoint(dir, env)) {
    throw Error(ErrorCode::NotFound,
                fmt::format("{} is not a checkpoint of Python Accelerate's save_state", dir));
  }
  AccelerateView view;
  view.path = dir;
  std::vector<std::string> names = env.list_dir(dir);
  std::sort(names.begin(), names.end());
  for (const std::string& name : names) {
    const std::string path = join_path(dir, name);
    FileInfo info = env.stat(path);
    if (!info.is_regular) continue;
    AccelerateFileView file;
    file.name = name;
    file.kind = detail::kind_of_file(name);
    file.size = info.size;
    std::size_t more = 0;
    try {
      if (file.kind == "model" && name.ends_with(".safetensors")) {
        ForeignContainer c = load_safetensors(path, env);
        StateDict sd = StateDict::from_container(c.contents);
        std::uint64_t bytes = 0;
        for (const auto& [key, value] : sd.entries()) {
          if (const at::Tensor* t = std::get_if<at::Tensor>(&value)) {
            bytes += t->numel() * t->element_size();
            if (file.values.size() < detail::kMaxValues) {
              file.values.emplace_back(key, detail::tensor_text(*t));
            } else {
              ++more;
            }
          }
        }
        file.summary = fmt::format("{} tensors, {} bytes (safetensors{})", sd.size(), bytes,
                                   c.verified ? ", checksummed" : "");
      } else if (file.kind != "other") {
        detail::PyValue value = detail::load_torch_value(path, env);
        detail::describe(value, "", file, more);
        file.summary = detail::summary_of(file.kind, value);
        if (file.kind == "random_states" && name == "random_states_0.pkl") {
          if (const detail::PyValue* step = value.find("step"); step && step->is(detail::Kind::kInt)) {
            view.step = step->integer;
          }
        }
      } else {
        file.summary = "not a file of Accelerate's save_state";
      }
    } catch (const Error& e) {
      file.problem = e.what();
      file.problem_code = e.code();
    }
    if (more > 0) file.values.emplace_back("...", fmt::format("{} more values", more));
    view.files.push_back(std::move(file));
  }
  return view;
}

bool is_accelerate_checkpoint(const std::string& dir, Env& env) {
  FileInfo info = env.stat(dir);
  if (!info.exists || !info.is_directory) return false;
  if (env.stat(join_path(dir, kManifestFileName)).exists) return false;
  // Accelerate's save_state always writes process 0's random states, as a pickle; torchpoint
  // never writes a .pkl (an uncommitted torchpoint checkpoint is not taken for one).
  return env.stat(join_path(dir, "random_states_0.pkl")).is_regular;
}

}  // namespace torchpoint

