#include "torchpoint/grad_scaler.h"

#include <ATen/core/grad_mode.h>
#include <ATen/ops/full.h>
#include <fmt/format.h>

#include <cmath>
#include <limits>
#include <vector>

#include "torchpoint/error.h"

namespace torchpoint {
namespace {

constexpr const char* kScale = "scale";
constexpr const char* kGrowthFactor = "growth_factor";
constexpr const char* kBackoffFactor = "backoff_factor";
constexpr const char* kGrowthInterval = "growth_interval";
constexpr const char* kGrowthTracker = "_growth_tracker";
constexpr int64_t kMaxGrowthInterval = std::numeric_limits<int32_t>::max();

// Empty when the values are usable, otherwise what is wrong with them.
std::vector<std::string> check_factors(double growth_factor, double backoff_factor,
                                       int64_t growth_interval) {
  std::vector<std::string> problems;
  if (!(growth_factor > 1.0 && std::isfinite(growth_factor))) {
    problems.push_back(fmt::format("growth_factor must be finite and > 1, got {}", growth_factor));
  }
  if (!(backoff_factor > 0.0 && backoff_factor < 1.0)) {
    problems.push_back(fmt::format("backoff_factor must be in (0, 1), got {}", backoff_factor));
  }
  if (growth_interval < 1 || growth_interval > kMaxGrowthInterval) {
    problems.push_back(fmt::format("growth_interval must be in [1, {}], got {}", kMaxGrowthInterval,
                                   growth_interval));
  }
  return problems;
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options) : options_(options) {
  std::vector<std::string> problems = check_factors(
      options_.growth_factor(), options_.backoff_factor(), options_.growth_interval());
  if (!(options_.init_scale() > 0.0 && std::isfinite(options_.init_scale()))) {
    problems.push_back(
        fmt::format("init_scale must be finite and > 0, got {}", options_.init_scale()));
  }
  if (!problems.empty()) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("GradScalerOptions: {}", fmt::join(problems, "; ")));
  }
  scale_ = at::full({1}, options_.init_scale(), at::TensorOptions().dtype(at::kFloat));
}

at::Tensor GradScaler::scale(const at::Tensor& loss) const {
  if (!is_enabled()) return loss;
  return loss.mul(scale_.to(loss.device()));
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!is_enabled()) return;
  OptimizerState& state = per_optimizer_[&optimizer];
  if (state.stage == Stage::kUnscaled) {
    throw Error(ErrorCode::InvalidArgument,
                "GradScaler::unscale_() has already been called on this optimizer since the last "
                "update()");
  }
  if (state.stage == Stage::kStepped) {
    throw Error(ErrorCode::InvalidArgument,
                "GradScaler::unscale_() is being called after step(): call update() first");
  }

  // Collect first so that a refused gradient leaves every gradient untouched.
  std::vector<at::Tensor> grads;
  for (auto& group : optimizer.param_groups()) {
    for (auto& param : group.params()) {
      const at::Tensor& grad = param.grad();
      if (!grad.defined()) continue;
      if (grad.scalar_type() == at::kHalf) {
        throw Error(ErrorCode::InvalidArgument,
                    "GradScaler::unscale_(): attempting to unscale float16 gradients; keep the "
                    "parameters (master weights) in float32, as PyTorch requires");
      }
      grads.push_back(grad.is_sparse() ? grad._values() : grad);
    }
  }

  // PyTorch: inv_scale = scale.double().reciprocal().float().
  const float inv_scale = static_cast<float>(1.0 / static_cast<double>(scale_.item<float>()));
  at::NoGradGuard no_grad;
  bool found_inf = false;
  for (at::Tensor& grad : grads) {
    // Checked before unscaling, as PyTorch's _amp_foreach_non_finite_check_and_unscale_ does.
    if (!grad.isfinite().all().item<bool>()) found_inf = true;
    if (inv_scale == 1.0f) continue;
    if (grad.scalar_type() == at::kBFloat16) {
      // PyTorch multiplies reduced-precision values in float32 and rounds once.
      grad.copy_(grad.to(at::kFloat).mul_(inv_scale));
    } else {
      grad.mul_(inv_scale);
    }
  }
  state.checked = state.checked || !grads.empty();
  state.found_inf = state.found_inf || found_inf;
  state.stage = Stage::kUnscaled;
}

bool GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!is_enabled()) {
    optimizer.step();
    return true;
  }
  // References into an unordered_map stay valid across insertions (unscale_ may insert).
  OptimizerState& state = per_optimizer_[&optimizer];
  if (state.stage == Stage::kStepped) {
    throw Error(ErrorCode::InvalidArgument,
                "GradScaler::step() has already been called since the last update()");
  }
  if (state.stage == Stage::kReady) unscale_(optimizer);
  if (!state.checked) {
    throw Error(ErrorCode::InvalidArgument,
                "GradScaler::step(): no parameter of the optimizer has a gradient, so no inf "
                "check was recorded; call backward() on scaler.scale(loss) first");
  }
  const bool stepped = !state.found_inf;
  if (stepped) optimizer.step();
  state.stage = Stage::kStepped;
  return stepped;
}

bool GradScaler::unscaled(const torch::optim::Optimizer& optimizer) const {
  auto it = per_optimizer_.find(&optimizer);
  return it != per_optimizer_.end() && it->second.stage != Stage::kReady;
}

bool GradScaler::found_inf(const torch::optim::Optimizer& optimizer) const {
  auto it = per_optimizer_.find(&optimizer);
  return it != per_optimizer_.end() && it->second.found_inf;
}

void GradScaler::update() {
  if (!is_enabled()) return;
  bool checked = false;
  bool found_inf = false;
  for (const auto& entry : per_optimizer_) {
    checked = checked || entry.second.checked;
    found_inf = found_inf || entry.second.found_inf;
  }
  if (!checked) {
    throw Error(ErrorCode::InvalidArgument,
                "GradScaler::update(): no inf checks were recorded since the last update(); "
                "call step() (or unscale_()) first");
  }
  // The arithmetic of PyTorch's _amp_update_scale_ kernel: float scale times double factor,
  // rounded back to float.
  float scale = scale_.item<float>();
  if (found_inf) {
    scale = static_cast<float>(scale * options_.backoff_factor());
    growth_tracker_ = 0;
  } else {
    const int64_t successful = growth_tracker_ + 1;
    if (successful == options_.growth_interval()) {
      const auto grown = static_cast<float>(scale * options_.growth_factor());
      // Do not grow the scale past float32 bounds to inf.
      if (std::isfinite(grown)) scale = grown;
      growth_tracker_ = 0;
    } else {
      growth_tracker_ = successful;
    }
  }
  scale_.fill_(scale);
  per_optimizer_.clear();
}

void GradScaler::update(double new_scale) {
  if (!is_enabled()) return;
  scale_.fill_(new_scale);
  per_optimizer_.clear();
}

double GradScaler::get_scale() const {
  if (!is_enabled()) return 1.0;
  return static_cast<double>(scale_.item<float>());
}

StateDict GradScaler::state_dict() const {
  StateDict state;
  state.set_description("grad scaler");
  if (!is_enabled()) return state;
  state.set_double(kScale, get_scale());
  state.set_double(kGrowthFactor, options_.growth_factor());
  state.set_double(kBackoffFactor, options_.backoff_factor());
  state.set(kGrowthInterval, Json(options_.growth_interval()));
  state.set(kGrowthTracker, Json(growth_tracker_));
  return state;
}

void GradScaler::load_state_dict(const StateDict& state) {
  if (!is_enabled()) return;
  const std::string& what = state.description();
  if (state.empty()) {
    throw Error(ErrorCode::Incompatible,
                fmt::format("{} is empty, possibly because it was saved from a disabled "
                            "GradScaler: enable scaling in both runs or in neither",
                            what));
  }
  std::vector<std::string> problems;
  for (const std::string& key : state.keys()) {
    if (key != kScale && key != kGrowthFactor && key != kBackoffFactor && key != kGrowthInterval &&
        key != kGrowthTracker) {
      problems.push_back(fmt::format("unexpected entry '{}'", key));
    }
  }
  for (const char* key : {kScale, kGrowthFactor, kBackoffFactor}) {
    if (!state.contains(key)) {
      problems.push_back(fmt::format("'{}' is missing", key));
    } else if (!state.is_tensor(key)) {
      problems.push_back(fmt::format("'{}' should be a float64 tensor, found a JSON value", key));
    }
  }
  for (const char* key : {kGrowthInterval, kGrowthTracker}) {
    if (!state.contains(key)) {
      problems.push_back(fmt::format("'{}' is missing", key));
    } else if (state.is_tensor(key) || !state.value(key).is_number_integer()) {
      problems.push_back(fmt::format("'{}' should be a JSON integer", key));
    }
  }
  if (!problems.empty()) {
    throw Error(ErrorCode::Incompatible, fmt::format("{} was not saved by a GradScaler: {}", what,
                                                     fmt::join(problems, "; ")));
  }
  // get_double throws Incompatible naming the key for a tensor that is not one float64.
  const double scale = state.get_double(kScale);
  const double growth_factor = state.get_double(kGrowthFactor);
  const double backoff_factor = state.get_double(kBackoffFactor);
  const auto growth_interval = state.get<int64_t>(kGrowthInterval);
  const auto growth_tracker = state.get<int64_t>(kGrowthTracker);
  problems = check_factors(growth_factor, backoff_factor, growth_interval);
  if (growth_tracker < 0) {
    problems.push_back(fmt::format("_growth_tracker must be >= 0, got {}", growth_tracker));
  }
  if (!problems.empty()) {
    throw Error(ErrorCode::Incompatible, fmt::format("{}: {}", what, fmt::join(problems, "; ")));
  }

  scale_.fill_(scale);
  options_.growth_factor(growth_factor)
      .backoff_factor(backoff_factor)
      .growth_interval(growth_interval);
  growth_tracker_ = growth_tracker;
}

}  // namespace torchpoint
