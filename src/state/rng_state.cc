#include "torchpoint/rng_state.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>

#include <mutex>
#include <unordered_set>

#include "torchpoint/error.h"

namespace torchpoint {
namespace {

constexpr const char* kCpuKey = "cpu";
constexpr const char* kCudaPrefix = "cuda.";
constexpr const char* kGeneratorPrefix = "generators.";
constexpr const char* kEnginePrefix = "engines.";

// One at::Generator covered by an RngState: its key, how messages name it, and a handle.
struct Covered {
  std::string key;
  std::string label;
  at::Generator generator;
};

std::vector<Covered> covered_generators(
    const std::vector<std::pair<std::string, at::Generator>>& registered) {
  std::vector<Covered> out;
  out.push_back({kCpuKey, "default CPU generator", at::detail::getDefaultCPUGenerator()});
  // CUDA builds only; a CPU-only LibTorch reports no CUDA and this loop never runs.
  if (at::globalContext().hasCUDA()) {
    const at::CUDAHooksInterface& cuda = at::detail::getCUDAHooks();
    const int devices = cuda.getNumGPUs();
    for (int i = 0; i < devices; ++i) {
      c10::Device device(c10::kCUDA, static_cast<c10::DeviceIndex>(i));
      out.push_back({fmt::format("{}{}", kCudaPrefix, i),
                     fmt::format("default generator of CUDA device {}", i),
                     at::globalContext().defaultGenerator(device)});
    }
  }
  for (const auto& [name, generator] : registered) {
    out.push_back({kGeneratorPrefix + name, fmt::format("generator '{}'", name), generator});
  }
  return out;
}

std::string describe_extra(const std::string& key) {
  if (key.starts_with(kGeneratorPrefix)) {
    return fmt::format(
        "generator '{}' is in the checkpoint but not registered here: register it with "
        "register_generator() before loading",
        key.substr(std::string_view(kGeneratorPrefix).size()));
  }
  if (key.starts_with(kEnginePrefix)) {
    return fmt::format(
        "engine '{}' is in the checkpoint but not registered here: register it with "
        "register_engine() before loading",
        key.substr(std::string_view(kEnginePrefix).size()));
  }
  if (key.starts_with(kCudaPrefix)) {
    return fmt::format(
        "'{}' holds the state of a CUDA device this process does not have: resume with the same "
        "devices",
        key);
  }
  return fmt::format("unexpected entry '{}': it was not saved by an RngState", key);
}

}  // namespace

void RngState::check_new_name(const std::string& name) const {
  if (name.empty()) {
    throw Error(ErrorCode::InvalidArgument,
                "RngState: a generator or engine name must not be empty");
  }
  for (const auto& entry : generators_) {
    if (entry.first == name) {
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("RngState: '{}' is already registered as a generator", name));
    }
  }
  for (const auto& entry : engines_) {
    if (entry.first == name) {
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("RngState: '{}' is already registered as an engine", name));
    }
  }
}

void RngState::register_generator(const std::string& name, at::Generator generator) {
  check_new_name(name);
  if (!generator.defined()) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("RngState: generator '{}' is undefined", name));
  }
  generators_.emplace_back(name, std::move(generator));
}

void RngState::add_engine(const std::string& name, detail::EngineSlot slot) {
  check_new_name(name);
  engines_.emplace_back(name, std::move(slot));
}

StateDict RngState::state_dict() const {
  StateDict state;
  state.set_description("rng");
  for (Covered& covered : covered_generators(generators_)) {
    std::lock_guard<std::mutex> lock(covered.generator.mutex());
    state.set(covered.key, covered.generator.get_state());
  }
  for (const auto& [name, slot] : engines_) state.set(kEnginePrefix + name, Json(slot.save()));
  return state;
}

void RngState::load_state_dict(const StateDict& state) {
  std::vector<Covered> generators = covered_generators(generators_);
  std::vector<std::string> problems;
  std::unordered_set<std::string> known;

  // Check everything before touching anything; each generator state is tried on a clone.
  std::vector<std::pair<Covered*, at::Tensor>> generator_plan;
  for (Covered& covered : generators) {
    known.insert(covered.key);
    const std::string where = fmt::format("{} ('{}')", covered.label, covered.key);
    if (!state.contains(covered.key)) {
      problems.push_back(fmt::format("{} is not in the checkpoint", where));
      continue;
    }
    if (!state.is_tensor(covered.key)) {
      problems.push_back(fmt::format("{} holds a JSON value, not a uint8 tensor", where));
      continue;
    }
    const at::Tensor& saved = state.tensor(covered.key);
    if (!saved.defined() || saved.scalar_type() != at::kByte || saved.dim() != 1 ||
        !saved.device().is_cpu()) {
      problems.push_back(fmt::format(
          "{} should be a 1-d uint8 CPU tensor, found {}", where,
          saved.defined()
              ? fmt::format("a {} tensor of shape [{}] on {}", c10::toString(saved.scalar_type()),
                            fmt::join(saved.sizes(), ", "), saved.device().str())
              : std::string("an undefined tensor")));
      continue;
    }
    at::Generator trial;
    {
      std::lock_guard<std::mutex> lock(covered.generator.mutex());
      trial = covered.generator.clone();
    }
    const int64_t expected = trial.get_state().numel();
    if (saved.numel() != expected) {
      problems.push_back(
          fmt::format("{} has {} bytes of state, expected {}: it was saved from a different "
                      "kind of generator or another LibTorch build",
                      where, saved.numel(), expected));
      continue;
    }
    at::Tensor bytes = saved.contiguous();
    try {
      trial.set_state(bytes);
    } catch (const c10::Error& e) {
      problems.push_back(
          fmt::format("{} refuses its saved state: {}", where, e.what_without_backtrace()));
      continue;
    }
    generator_plan.emplace_back(&covered, std::move(bytes));
  }

  std::vector<std::function<void()>> engine_plan;
  for (const auto& [name, slot] : engines_) {
    const std::string key = kEnginePrefix + name;
    known.insert(key);
    const std::string where = fmt::format("engine '{}' ('{}')", name, key);
    if (!state.contains(key)) {
      problems.push_back(fmt::format("{} is not in the checkpoint", where));
      continue;
    }
    if (state.is_tensor(key) || !state.value(key).is_string()) {
      problems.push_back(fmt::format("{} should be a JSON string of the engine's text", where));
      continue;
    }
    std::function<void()> assign = slot.parse(state.value(key).get<std::string>());
    if (!assign) {
      problems.push_back(fmt::format(
          "{} does not hold a state of this engine type: it was saved from another engine "
          "type or is damaged",
          where));
      continue;
    }
    engine_plan.push_back(std::move(assign));
  }

  for (const std::string& key : state.keys()) {
    if (known.count(key) == 0) problems.push_back(describe_extra(key));
  }

  if (!problems.empty()) {
    throw Error(ErrorCode::Incompatible,
                fmt::format("cannot restore the RNG state from {}: {}; no generator or engine "
                            "was changed",
                            state.description(), fmt::join(problems, "; ")));
  }

  // A clone accepted each of these states, so set_state cannot refuse them now, and
  // assigning an engine cannot fail: from here on everything is restored.
  for (auto& [covered, bytes] : generator_plan) {
    std::lock_guard<std::mutex> lock(covered->generator.mutex());
    covered->generator.set_state(bytes);
  }
  for (const std::function<void()>& assign : engine_plan) assign();
}

}  // namespace torchpoint
