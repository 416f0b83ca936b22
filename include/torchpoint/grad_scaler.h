// GradScaler: dynamic loss scaling for mixed-precision training, with PyTorch's semantics and
// state_dict, on any device (LibTorch 1.13's C++ API has none).
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <unordered_map>

#include "torchpoint/error.h"
#include "torchpoint/state_dict.h"

namespace torchpoint {

// Options of a GradScaler, in LibTorch's builder style. The defaults are PyTorch's
// (torch.cuda.amp.GradScaler).
//
// Example:
//   using torchpoint::GradScalerOptions;
//   torchpoint::GradScaler scaler(GradScalerOptions().init_scale(1024).growth_interval(100));
struct GradScalerOptions {
  // The scale before the first update(). Must be positive and finite.
  TORCH_ARG(double, init_scale) = 65536.0;
  // The scale is multiplied by this after growth_interval consecutive steps without inf/NaN
  // gradients. Must be > 1.
  TORCH_ARG(double, growth_factor) = 2.0;
  // The scale is multiplied by this after a step with an inf/NaN gradient. Must be in (0, 1).
  TORCH_ARG(double, backoff_factor) = 0.5;
  // Consecutive good steps before the scale grows. Must be in [1, 2^31 - 1].
  TORCH_ARG(int64_t, growth_interval) = 2000;
  // When false every method is a pass-through: scale() returns the loss, step() steps.
  TORCH_ARG(bool, enabled) = true;
};

// Scales the loss so that small gradients survive reduced precision, unscales the gradients
// before the optimizer step, skips steps whose gradients hold inf/NaN and adapts the scale,
// exactly as PyTorch's GradScaler does (same float32 arithmetic, same update rule, same
// state_dict fields). Not thread-safe: use one scaler from one thread.
//
// The per-iteration bookkeeping (which optimizers were unscaled or stepped) is not part of the
// state: checkpoint at step boundaries, after update().
//
// Example:
//   torchpoint::GradScaler scaler;
//   optimizer.zero_grad();
//   scaler.scale(loss).backward();
//   scaler.unscale_(optimizer);                       // optional, e.g. to clip gradients
//   torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
//   scaler.step(optimizer);                           // skipped if a gradient is inf/NaN
//   scaler.update();
class GradScaler {
 public:
  // Throws InvalidArgument for options outside the ranges documented on GradScalerOptions.
  explicit GradScaler(GradScalerOptions options = {});

  // Returns `loss` multiplied by the current scale (a one-element float32 tensor, so the
  // result has shape [1] for a 0-d loss, as in PyTorch). Returns `loss` itself when disabled.
  at::Tensor scale(const at::Tensor& loss) const;

  // Multiplies, in place, every defined gradient of `optimizer`'s parameters by the float32
  // reciprocal of the scale (computed as PyTorch does: in double, then rounded to float) and
  // records whether any gradient held an inf or NaN before unscaling. Throws InvalidArgument
  // when called twice for the same optimizer, or after step(), before update(); or for a
  // float16 gradient (as PyTorch: keep master weights in float32). No-op when disabled.
  void unscale_(torch::optim::Optimizer& optimizer);

  // Unscales the gradients unless unscale_() already did, then calls optimizer.step() unless a
  // gradient held an inf or NaN. Returns whether the optimizer stepped. Throws InvalidArgument
  // when called twice before update(), or when no parameter has a gradient. When disabled,
  // just steps and returns true.
  bool step(torch::optim::Optimizer& optimizer);

  // Adapts the scale after the iteration's step() calls: multiplies it by backoff_factor and
  // resets the growth tracker if any optimizer saw an inf/NaN; otherwise counts one more good
  // step and, on reaching growth_interval, multiplies the scale by growth_factor (unless that
  // would overflow float32) and resets the tracker. Throws InvalidArgument if no step() or
  // unscale_() recorded an inf check since the last update(). No-op when disabled.
  void update();
  // Sets the scale to `new_scale` (rounded to float32) instead of adapting it; the growth
  // tracker is unchanged, as in PyTorch.
  void update(double new_scale);

  // Whether unscale_() ran on `optimizer` since the last update(), and whether it found an inf
  // or NaN then (for a caller that steps the optimizer itself: ZeRO's sharded step).
  bool unscaled(const torch::optim::Optimizer& optimizer) const;
  bool found_inf(const torch::optim::Optimizer& optimizer) const;

  // The current scale as a double (exactly the float32 value), or 1.0 when disabled.
  double get_scale() const;
  bool is_enabled() const { return options_.enabled(); }
  // The options, with the factors and interval most recently loaded by load_state_dict().
  const GradScalerOptions& options() const { return options_; }

  // PyTorch's fields: "scale", "growth_factor", "backoff_factor" (float64, exact),
  // "growth_interval", "_growth_tracker" (integers). Empty when disabled.
  StateDict state_dict() const;
  // Restores the fields of state_dict(). Checks everything first: on error (Incompatible,
  // naming the key: missing, extra, wrong type, out of range, or an empty dict from a disabled
  // scaler) nothing changes. Ignores `state` when this scaler is disabled, as PyTorch does.
  void load_state_dict(const StateDict& state);

 private:
  enum class Stage { kReady, kUnscaled, kStepped };
  struct OptimizerState {
    Stage stage = Stage::kReady;
    bool checked = false;  // at least one gradient was checked for inf/NaN
    bool found_inf = false;
  };

  GradScalerOptions options_;
  at::Tensor scale_;  // float32, shape [1], as PyTorch's _scale
  int64_t growth_tracker_ = 0;
  // Keyed by address, as PyTorch keys by id(optimizer); cleared by update().
  std::unordered_map<const torch::optim::Optimizer*, OptimizerState> per_optimizer_;
};

}  // namespace torchpoint
