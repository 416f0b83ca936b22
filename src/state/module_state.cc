#include "torchpoint/module_state.h"

#include <fmt/format.h>
#include <torch/csrc/autograd/grad_mode.h>

#include <unordered_set>

#include "torchpoint/error.h"

namespace torchpoint {
namespace {

std::string shape_text(c10::IntArrayRef sizes) {
  return fmt::format("[{}]", fmt::join(sizes, ", "));
}

}  // namespace

std::string LoadReport::summary() const {
  if (complete()) return fmt::format("all {} keys loaded", loaded.size());
  std::string out;
  if (!missing.empty()) out += fmt::format("missing keys: {}\n", fmt::join(missing, ", "));
  if (!unexpected.empty()) out += fmt::format("unexpected keys: {}\n", fmt::join(unexpected, ", "));
  for (const std::string& m : mismatched) out += m + "\n";
  out.pop_back();
  return out;
}

StateDict module_state_dict(const torch::nn::Module& module) {
  StateDict out;
  out.set_description("model");
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    out.set(item.key(), item.value().detach());
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    out.set(item.key(), item.value().detach());
  }
  return out;
}

LoadReport load_module_state_dict(torch::nn::Module& module, const StateDict& state, bool strict) {
  struct Target {
    std::string name;
    at::Tensor tensor;
  };
  std::vector<Target> targets;
  for (const auto& item : module.named_parameters(true))
    targets.push_back({item.key(), item.value()});
  for (const auto& item : module.named_buffers(true)) targets.push_back({item.key(), item.value()});

  LoadReport report;
  std::vector<std::pair<at::Tensor, const at::Tensor*>> copies;
  std::unordered_set<std::string> known;
  for (const Target& t : targets) {
    known.insert(t.name);
    if (!state.is_tensor(t.name)) {
      report.missing.push_back(t.name);
      continue;
    }
    const at::Tensor& saved = state.tensor(t.name);
    if (saved.sizes() != t.tensor.sizes()) {
      report.mismatched.push_back(fmt::format("size mismatch for {}: checkpoint {}, model {}",
                                              t.name, shape_text(saved.sizes()),
                                              shape_text(t.tensor.sizes())));
      continue;
    }
    if (saved.scalar_type() != t.tensor.scalar_type()) {
      report.mismatched.push_back(fmt::format("dtype mismatch for {}: checkpoint {}, model {}",
                                              t.name, c10::toString(saved.scalar_type()),
                                              c10::toString(t.tensor.scalar_type())));
      continue;
    }
    copies.emplace_back(t.tensor, &saved);
    report.loaded.push_back(t.name);
  }
  for (const auto& [key, value] : state.entries()) {
    if (!known.count(key)) report.unexpected.push_back(key);
  }
  if (strict && !report.complete()) {
    throw Error(ErrorCode::Incompatible,
                fmt::format("the {} does not fit this module; nothing was loaded:\n{}\nBuild the "
                            "model as the run that saved it did; to load only the keys that "
                            "match, call load_module_state_dict(module, state, /*strict=*/false)",
                            state.description(), report.summary()));
  }
  // Everything is checked: only now is the module changed. In place, so that optimizers and
  // other holders of these tensors see the new values.
  torch::NoGradGuard no_grad;
  for (auto& [target, saved] : copies) target.copy_(*saved);
  return report;
}

}  // namespace torchpoint
