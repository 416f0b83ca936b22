// Optimizer state by (group, position). LibTorch keys its per-parameter state by the address
// of the parameter's TensorImpl, which means nothing in another process: the position of the
// parameter in its group is what identifies it across a save and a load.
#include "torchpoint/optimizer_state.h"

#include <fmt/format.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/lbfgs.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include <functional>

#include "compat/torch_compat.h"
#include "format/fresh_read.h"
#include "torchpoint/error.h"

namespace torchpoint {
namespace {

namespace optim = torch::optim;

using compat::optimizer_state_key;

// The per-parameter state of one optimizer type, as StateDict entries and back.
struct Codec {
  std::string type;
  std::function<void(const optim::OptimizerOptions&, const std::string&, StateDict&)> save_options;
  std::function<std::unique_ptr<optim::OptimizerOptions>(const StateDict&, const std::string&)>
      load_options;
  std::function<void(const optim::OptimizerParamState&, const std::string&, StateDict&)> save_state;
  // Builds the state of one parameter; checks shapes against `param` (throws Incompatible).
  std::function<std::unique_ptr<optim::OptimizerParamState>(const StateDict&, const std::string&,
                                                            const at::Tensor& param)>
      load_state;
};

thread_local bool take_loaded_state = false;

// Whether `t` is the whole of memory that a torchpoint load read for it alone (FreshData), or
// that a caller under TakeLoadedState made for it alone, already as `param` holds its values:
// then the optimizer takes it instead of a copy, as Python's Optimizer.load_state_dict takes a
// tensor already of the parameter's dtype and device.
bool take_as_is(const at::Tensor& t, const at::Tensor& param) {
  return t.device() == param.device() && t.scalar_type() == param.scalar_type() &&
         t.is_contiguous() && t.storage_offset() == 0 && t.storage().nbytes() == t.nbytes() &&
         (take_loaded_state || FreshData::adopted(t.storage().data_ptr()));
}

// A state tensor for `param` on the parameter's device, with its shape checked: a fresh copy,
// or the loaded tensor itself where take_as_is() allows.
at::Tensor like_param(const StateDict& sd, const std::string& key, const at::Tensor& param) {
  const at::Tensor& t = sd.tensor(key);
  if (t.sizes() != param.sizes()) {
    throw Error(ErrorCode::Incompatible,
                fmt::format("{}: '{}' has shape [{}] but its parameter has shape [{}]: the "
                            "checkpoint belongs to a different model",
                            sd.description(), key, fmt::join(t.sizes(), ", "),
                            fmt::join(param.sizes(), ", ")));
  }
  if (take_as_is(t, param)) return t.detach();
  return t.to(param.device(), param.scalar_type(), /*non_blocking=*/false, /*copy=*/true);
}

at::Tensor any_tensor(const StateDict& sd, const std::string& key, const at::Tensor& param) {
  return sd.tensor(key).to(param.device(), /*non_blocking=*/false, /*copy=*/true);
}

void save_optional(StateDict& sd, const std::string& key, const at::Tensor& t) {
  if (t.defined()) sd.set(key, t.detach());
}

at::Tensor load_optional(const StateDict& sd, const std::string& key, const at::Tensor& param) {
  return sd.contains(key) ? like_param(sd, key, param) : at::Tensor();
}

template <typename Options>
const Options& as(const optim::OptimizerOptions& o) {
  return static_cast<const Options&>(o);
}
template <typename State>
const State& as_state(const optim::OptimizerParamState& s) {
  return static_cast<const State&>(s);
}

Codec sgd_codec() {
  return {
      "SGD",
      [](const optim::OptimizerOptions& o, const std::string& p, StateDict& sd) {
        const auto& s = as<optim::SGDOptions>(o);
        sd.set(p + "lr", s.lr());
        sd.set(p + "momentum", s.momentum());
        sd.set(p + "dampening", s.dampening());
        sd.set(p + "weight_decay", s.weight_decay());
        sd.set(p + "nesterov", s.nesterov());
      },
      [](const StateDict& sd, const std::string& p) -> std::unique_ptr<optim::OptimizerOptions> {
        auto o = std::make_unique<optim::SGDOptions>(sd.get<double>(p + "lr"));
        o->momentum(sd.get<double>(p + "momentum"))
            .dampening(sd.get<double>(p + "dampening"))
            .weight_decay(sd.get<double>(p + "weight_decay"))
            .nesterov(sd.get<bool>(p + "nesterov"));
        return o;
      },
      [](const optim::OptimizerParamState& st, const std::string& p, StateDict& sd) {
        save_optional(sd, p + "momentum_buffer",
                      as_state<optim::SGDParamState>(st).momentum_buffer());
      },
      [](const StateDict& sd, const std::string& p,
         const at::Tensor& param) -> std::unique_ptr<optim::OptimizerParamState> {
        auto s = std::make_unique<optim::SGDParamState>();
        s->momentum_buffer(load_optional(sd, p + "momentum_buffer", param));
        return s;
      }};
}

template <typename Options, typename State>
Codec adam_like_codec(const std::string& type) {
  return {
      type,
      [](const optim::OptimizerOptions& o, const std::string& p, StateDict& sd) {
        const auto& s = as<Options>(o);
        sd.set(p + "lr", s.lr());
        sd.set(p + "betas", Json::array({std::get<0>(s.betas()), std::get<1>(s.betas())}));
        sd.set(p + "eps", s.eps());
        sd.set(p + "weight_decay", s.weight_decay());
        sd.set(p + "amsgrad", s.amsgrad());
      },
      [](const StateDict& sd, const std::string& p) -> std::unique_ptr<optim::OptimizerOptions> {
        auto betas = sd.get<std::vector<double>>(p + "betas");
        if (betas.size() != 2) {
          throw Error(ErrorCode::Incompatible,
                      fmt::format("{}: betas must hold two values", sd.description()));
        }
        auto o = std::make_unique<Options>(sd.get<double>(p + "lr"));
        o->betas(std::make_tuple(betas[0], betas[1]))
            .eps(sd.get<double>(p + "eps"))
            .weight_decay(sd.get<double>(p + "weight_decay"))
            .amsgrad(sd.get<bool>(p + "amsgrad"));
        return o;
      },
      [](const optim::OptimizerParamState& st, const std::string& p, StateDict& sd) {
        const auto& s = as_state<State>(st);
        sd.set(p + "step", s.step());
        save_optional(sd, p + "exp_avg", s.exp_avg());
        save_optional(sd, p + "exp_avg_sq", s.exp_avg_sq());
        save_optional(sd, p + "max_exp_avg_sq", s.max_exp_avg_sq());
      },
      [](const StateDict& sd, const std::string& p,
         const at::Tensor& param) -> std::unique_ptr<optim::OptimizerParamState> {
        auto s = std::make_unique<State>();
        s->step(sd.get<std::int64_t>(p + "step"));
        s->exp_avg(load_optional(sd, p + "exp_avg", param));
        s->exp_avg_sq(load_optional(sd, p + "exp_avg_sq", param));
        s->max_exp_avg_sq(load_optional(sd, p + "max_exp_avg_sq", param));
        return s;
      }};
}

Codec rmsprop_codec() {
  return {
      "RMSprop",
      [](const optim::OptimizerOptions& o, const std::string& p, StateDict& sd) {
        const auto& s = as<optim::RMSpropOptions>(o);
        sd.set(p + "lr", s.lr());
        sd.set(p + "alpha", s.alpha());
        sd.set(p + "eps", s.eps());
        sd.set(p + "weight_decay", s.weight_decay());
        sd.set(p + "momentum", s.momentum());
        sd.set(p + "centered", s.centered());
      },
      [](const StateDict& sd, const std::string& p) -> std::unique_ptr<optim::OptimizerOptions> {
        auto o = std::make_unique<optim::RMSpropOptions>(sd.get<double>(p + "lr"));
        o->alpha(sd.get<double>(p + "alpha"))
            .eps(sd.get<double>(p + "eps"))
            .weight_decay(sd.get<double>(p + "weight_decay"))
            .momentum(sd.get<double>(p + "momentum"))
            .centered(sd.get<bool>(p + "centered"));
        return o;
      },
      [](const optim::OptimizerParamState& st, const std::string& p, StateDict& sd) {
        const auto& s = as_state<optim::RMSpropParamState>(st);
        sd.set(p + "step", s.step());
        save_optional(sd, p + "square_avg", s.square_avg());
        save_optional(sd, p + "momentum_buffer", s.momentum_buffer());
        save_optional(sd, p + "grad_avg", s.grad_avg());
      },
      [](const StateDict& sd, const std::string& p,
         const at::Tensor& param) -> std::unique_ptr<optim::OptimizerParamState> {
        auto s = std::make_unique<optim::RMSpropParamState>();
        s->step(sd.get<std::int64_t>(p + "step"));
        s->square_avg(load_optional(sd, p + "square_avg", param));
        s->momentum_buffer(load_optional(sd, p + "momentum_buffer", param));
        s->grad_avg(load_optional(sd, p + "grad_avg", param));
        return s;
      }};
}

Codec adagrad_codec() {
  return {
      "Adagrad",
      [](const optim::OptimizerOptions& o, const std::string& p, StateDict& sd) {
        const auto& s = as<optim::AdagradOptions>(o);
        sd.set(p + "lr", s.lr());
        sd.set(p + "lr_decay", s.lr_decay());
        sd.set(p + "weight_decay", s.weight_decay());
        sd.set(p + "initial_accumulator_value", s.initial_accumulator_value());
        sd.set(p + "eps", s.eps());
      },
      [](const StateDict& sd, const std::string& p) -> std::unique_ptr<optim::OptimizerOptions> {
        auto o = std::make_unique<optim::AdagradOptions>(sd.get<double>(p + "lr"));
        o->lr_decay(sd.get<double>(p + "lr_decay"))
            .weight_decay(sd.get<double>(p + "weight_decay"))
            .initial_accumulator_value(sd.get<double>(p + "initial_accumulator_value"))
            .eps(sd.get<double>(p + "eps"));
        return o;
      },
      [](const optim::OptimizerParamState& st, const std::string& p, StateDict& sd) {
        const auto& s = as_state<optim::AdagradParamState>(st);
        sd.set(p + "step", s.step());
        save_optional(sd, p + "sum", s.sum());
      },
      [](const StateDict& sd, const std::string& p,
         const at::Tensor& param) -> std::unique_ptr<optim::OptimizerParamState> {
        auto s = std::make_unique<optim::AdagradParamState>();
        s->step(sd.get<std::int64_t>(p + "step"));
        s->sum(load_optional(sd, p + "sum", param));
        return s;
      }};
}

void save_deque(StateDict& sd, const std::string& key, const std::deque<at::Tensor>& d) {
  sd.set(key + ".count", static_cast<std::int64_t>(d.size()));
  for (std::size_t i = 0; i < d.size(); ++i) sd.set(fmt::format("{}.{}", key, i), d[i].detach());
}

std::deque<at::Tensor> load_deque(const StateDict& sd, const std::string& key,
                                  const at::Tensor& param) {
  std::deque<at::Tensor> d;
  auto n = sd.get<std::int64_t>(key + ".count");
  if (n < 0 || n > 1'000'000) {
    throw Error(ErrorCode::Incompatible,
                fmt::format("{}: bad length of {}", sd.description(), key));
  }
  for (std::int64_t i = 0; i < n; ++i)
    d.push_back(any_tensor(sd, fmt::format("{}.{}", key, i), param));
  return d;
}

Codec lbfgs_codec() {
  return {
      "LBFGS",
      [](const optim::OptimizerOptions& o, const std::string& p, StateDict& sd) {
        const auto& s = as<optim::LBFGSOptions>(o);
        sd.set(p + "lr", s.lr());
        sd.set(p + "max_iter", s.max_iter());
        sd.set(p + "max_eval", s.max_eval() ? Json(*s.max_eval()) : Json(nullptr));
        sd.set(p + "tolerance_grad", s.tolerance_grad());
        sd.set(p + "tolerance_change", s.tolerance_change());
        sd.set(p + "history_size", s.history_size());
        sd.set(p + "line_search_fn",
               s.line_search_fn() ? Json(*s.line_search_fn()) : Json(nullptr));
      },
      [](const StateDict& sd, const std::string& p) -> std::unique_ptr<optim::OptimizerOptions> {
        auto o = std::make_unique<optim::LBFGSOptions>(sd.get<double>(p + "lr"));
        o->max_iter(sd.get<std::int64_t>(p + "max_iter"))
            .tolerance_grad(sd.get<double>(p + "tolerance_grad"))
            .tolerance_change(sd.get<double>(p + "tolerance_change"))
            .history_size(sd.get<std::int64_t>(p + "history_size"));
        const Json& max_eval = sd.value(p + "max_eval");
        if (!max_eval.is_null()) o->max_eval(max_eval.get<std::int64_t>());
        const Json& ls = sd.value(p + "line_search_fn");
        if (!ls.is_null()) o->line_search_fn(ls.get<std::string>());
        return o;
      },
      [](const optim::OptimizerParamState& st, const std::string& p, StateDict& sd) {
        const auto& s = as_state<optim::LBFGSParamState>(st);
        sd.set(p + "func_evals", s.func_evals());
        sd.set(p + "n_iter", s.n_iter());
        sd.set_double(p + "t", s.t());
        sd.set_double(p + "prev_loss", s.prev_loss());
        save_optional(sd, p + "d", s.d());
        save_optional(sd, p + "H_diag", s.H_diag());
        save_optional(sd, p + "prev_flat_grad", s.prev_flat_grad());
        save_deque(sd, p + "old_dirs", s.old_dirs());
        save_deque(sd, p + "old_stps", s.old_stps());
        save_deque(sd, p + "ro", s.ro());
        if (s.al()) {
          save_deque(sd, p + "al", std::deque<at::Tensor>(s.al()->begin(), s.al()->end()));
        }
      },
      [](const StateDict& sd, const std::string& p,
         const at::Tensor& param) -> std::unique_ptr<optim::OptimizerParamState> {
        // LBFGS keeps flat vectors over all parameters, under the first parameter's key.
        auto s = std::make_unique<optim::LBFGSParamState>();
        s->func_evals(sd.get<std::int64_t>(p + "func_evals"));
        s->n_iter(sd.get<std::int64_t>(p + "n_iter"));
        s->t(sd.get_double(p + "t"));
        s->prev_loss(sd.get_double(p + "prev_loss"));
        if (sd.contains(p + "d")) s->d(any_tensor(sd, p + "d", param));
        if (sd.contains(p + "H_diag")) s->H_diag(any_tensor(sd, p + "H_diag", param));
        if (sd.contains(p + "prev_flat_grad")) {
          s->prev_flat_grad(any_tensor(sd, p + "prev_flat_grad", param));
        }
        s->old_dirs(load_deque(sd, p + "old_dirs", param));
        s->old_stps(load_deque(sd, p + "old_stps", param));
        s->ro(load_deque(sd, p + "ro", param));
        if (sd.contains(p + "al.count")) {
          std::deque<at::Tensor> al = load_deque(sd, p + "al", param);
          s->al(std::vector<at::Tensor>(al.begin(), al.end()));
        }
        return s;
      }};
}

const Codec* codec_for(const optim::Optimizer& optimizer) {
  static const Codec sgd = sgd_codec();
  static const Codec adam = adam_like_codec<optim::AdamOptions, optim::AdamParamState>("Adam");
  static const Codec adamw = adam_like_codec<optim::AdamWOptions, optim::AdamWParamState>("AdamW");
  static const Codec rmsprop = rmsprop_codec();
  static const Codec adagrad = adagrad_codec();
  static const Codec lbfgs = lbfgs_codec();
  if (dynamic_cast<const optim::SGD*>(&optimizer)) return &sgd;
  if (dynamic_cast<const optim::Adam*>(&optimizer)) return &adam;
  if (dynamic_cast<const optim::AdamW*>(&optimizer)) return &adamw;
  if (dynamic_cast<const optim::RMSprop*>(&optimizer)) return &rmsprop;
  if (dynamic_cast<const optim::Adagrad*>(&optimizer)) return &adagrad;
  if (dynamic_cast<const optim::LBFGS*>(&optimizer)) return &lbfgs;
  return nullptr;
}

const Codec& require_codec(const optim::Optimizer& optimizer) {
  const Codec* codec = codec_for(optimizer);
  if (codec == nullptr) {
    throw Error(ErrorCode::Unsupported,
                fmt::format("optimizer type {} is not one of SGD, Adam, AdamW, RMSprop, Adagrad, "
                            "LBFGS; register it as your own Stateful object instead",
                            typeid(optimizer).name()));
  }
  return *codec;
}

}  // namespace

std::string optimizer_type_name(const optim::Optimizer& optimizer) {
  const Codec* codec = codec_for(optimizer);
  return codec ? codec->type : "";
}

StateDict optimizer_state_dict(const optim::Optimizer& optimizer) {
  const Codec& codec = require_codec(optimizer);
  StateDict sd;
  sd.set_description("optimizer");
  sd.set("type", codec.type);
  const auto& groups = optimizer.param_groups();
  sd.set("param_groups.count", static_cast<std::int64_t>(groups.size()));
  for (std::size_t g = 0; g < groups.size(); ++g) {
    std::string p = fmt::format("param_groups.{}.", g);
    sd.set(p + "num_params", static_cast<std::int64_t>(groups[g].params().size()));
    codec.save_options(groups[g].options(), p, sd);
  }
  const auto& state = optimizer.state();
  for (std::size_t g = 0; g < groups.size(); ++g) {
    const auto& params = groups[g].params();
    for (std::size_t i = 0; i < params.size(); ++i) {
      auto it = state.find(optimizer_state_key(params[i]));
      if (it == state.end()) continue;  // not stepped yet: no state
      codec.save_state(*it->second, fmt::format("state.{}.{}.", g, i), sd);
    }
  }
  return sd;
}

namespace detail {
TakeLoadedState::TakeLoadedState() : previous_(take_loaded_state) { take_loaded_state = true; }
TakeLoadedState::~TakeLoadedState() { take_loaded_state = previous_; }
}  // namespace detail

void load_optimizer_state_dict(optim::Optimizer& optimizer, const StateDict& state) {
  const Codec& codec = require_codec(optimizer);
  std::string saved_type = state.get<std::string>("type");
  if (saved_type != codec.type) {
    throw Error(ErrorCode::Incompatible,
                fmt::format("{} was saved from a {} optimizer but is being loaded into a {}; "
                            "build the same optimizer type as the saved run",
                            state.description(), saved_type, codec.type));
  }
  auto& groups = optimizer.param_groups();
  auto saved_groups = state.get<std::int64_t>("param_groups.count");
  if (saved_groups != static_cast<std::int64_t>(groups.size())) {
    throw Error(ErrorCode::Incompatible,
                fmt::format("{} has {} param groups, the optimizer has {}", state.description(),
                            saved_groups, groups.size()));
  }
  // Build everything first; the optimizer changes only once all of it succeeded.
  std::vector<std::unique_ptr<optim::OptimizerOptions>> options;
  std::vector<std::pair<compat::OptimizerStateKey, std::unique_ptr<optim::OptimizerParamState>>>
      states;
  for (std::size_t g = 0; g < groups.size(); ++g) {
    std::string p = fmt::format("param_groups.{}.", g);
    auto n = state.get<std::int64_t>(p + "num_params");
    const auto& params = groups[g].params();
    if (n != static_cast<std::int64_t>(params.size())) {
      throw Error(ErrorCode::Incompatible,
                  fmt::format("{}: param group {} has {} parameters in the checkpoint and {} in "
                              "the optimizer",
                              state.description(), g, n, params.size()));
    }
    options.push_back(codec.load_options(state, p));
    for (std::size_t i = 0; i < params.size(); ++i) {
      std::string sp = fmt::format("state.{}.{}", g, i);
      if (!state.has_child(sp)) continue;
      states.emplace_back(optimizer_state_key(params[i]),
                          codec.load_state(state, sp + ".", params[i]));
    }
  }
  auto& live = optimizer.state();
  for (std::size_t g = 0; g < groups.size(); ++g) {
    for (const at::Tensor& param : groups[g].params()) live.erase(optimizer_state_key(param));
    groups[g].set_options(std::move(options[g]));
  }
  for (auto& [key, s] : states) live[key] = std::move(s);
}

}  // namespace torchpoint
