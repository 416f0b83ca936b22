// ZeroOptimizer: the partition, the local optimizer over this rank's pieces, the gradient
// reduction of each stage and the gather of the updated parameters.
#include "dist/zero.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/zeros.h>
#include <fmt/format.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <cmath>

#include "compat/torch_compat.h"
#include "torchpoint/error.h"
#include "torchpoint/optimizer_state.h"

namespace torchpoint::detail {
namespace {

// A new optimizer of `user`'s type over `groups`, with its defaults.
std::unique_ptr<torch::optim::Optimizer> same_kind(
    const torch::optim::Optimizer& user, std::vector<torch::optim::OptimizerParamGroup> groups) {
  if (dynamic_cast<const torch::optim::SGD*>(&user) != nullptr) {
    return std::make_unique<torch::optim::SGD>(
        std::move(groups), static_cast<const torch::optim::SGDOptions&>(user.defaults()));
  }
  if (dynamic_cast<const torch::optim::AdamW*>(&user) != nullptr) {
    return std::make_unique<torch::optim::AdamW>(
        std::move(groups), static_cast<const torch::optim::AdamWOptions&>(user.defaults()));
  }
  if (dynamic_cast<const torch::optim::Adam*>(&user) != nullptr) {
    return std::make_unique<torch::optim::Adam>(
        std::move(groups), static_cast<const torch::optim::AdamOptions&>(user.defaults()));
  }
  throw Error(ErrorCode::Unsupported,
              "zero_stage: only SGD, Adam and AdamW can be sharded (their update is element-wise, "
              "so a part of a tensor steps as the whole would); use zero_stage(0) for this "
              "optimizer");
}

// The tensors and the step count of one parameter's state, whatever the optimizer: Adam's and
// AdamW's moments (max_exp_avg_sq with amsgrad), SGD's momentum buffer.
struct Fields {
  std::vector<at::Tensor*> tensors;
  std::int64_t* step = nullptr;
};

Fields fields_of(torch::optim::OptimizerParamState& s) {
  if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(&s)) {
    return {{&a->exp_avg(), &a->exp_avg_sq(), &a->max_exp_avg_sq()}, &a->step()};
  }
  if (auto* w = dynamic_cast<torch::optim::AdamWParamState*>(&s)) {
    return {{&w->exp_avg(), &w->exp_avg_sq(), &w->max_exp_avg_sq()}, &w->step()};
  }
  auto& m = dynamic_cast<torch::optim::SGDParamState&>(s);
  return {{&m.momentum_buffer()}, nullptr};
}

std::unique_ptr<torch::optim::OptimizerParamState> new_state(const torch::optim::Optimizer& o) {
  if (dynamic_cast<const torch::optim::SGD*>(&o) != nullptr) {
    return std::make_unique<torch::optim::SGDParamState>();
  }
  if (dynamic_cast<const torch::optim::AdamW*>(&o) != nullptr) {
    return std::make_unique<torch::optim::AdamWParamState>();
  }
  return std::make_unique<torch::optim::AdamParamState>();
}

}  // namespace

ZeroOptimizer::ZeroOptimizer(torch::optim::Optimizer& optimizer, ProcessGroup* group, int stage)
    : user_(&optimizer), group_(group), stage_(stage), chunk_(zero_chunk_elements()) {
  if (stage != 1 && stage != 2) {
    throw Error(ErrorCode::InvalidArgument,
                fmt::format("zero_stage({}): the stages are 1 (optimizer state partitioned) and "
                            "2 (gradients too); 0 shards nothing",
                            stage));
  }
  if (group_ != nullptr) {
    world_ = group_->size();
    rank_ = group_->rank();
  }
  std::optional<at::ScalarType> dtype;
  struct Place {
    int group, index;
    std::int64_t offset;
    at::Tensor param;
  };
  std::vector<Place> places;
  for (std::size_t g = 0; g < optimizer.param_groups().size(); ++g) {
    const auto& params = optimizer.param_groups()[g].params();
    for (std::size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      if (!p.requires_grad()) continue;
      if (!p.is_contiguous() || p.is_sparse()) {
        throw Error(ErrorCode::Unsupported,
                    fmt::format("zero_stage: parameter {} of group {} is not a dense contiguous "
                                "tensor, which a flat partition needs",
                                i, g));
      }
      if (dtype && *dtype != p.scalar_type()) {
        throw Error(ErrorCode::Unsupported,
                    "zero_stage: the optimizer's parameters have several dtypes; a flat "
                    "partition needs one (keep master weights in float32)");
      }
      dtype = p.scalar_type();
      places.push_back({static_cast<int>(g), static_cast<int>(i), total_, p});
      params_.push_back(p);
      total_ += p.numel();
    }
  }
  part_ = (total_ + world_ - 1) / world_;
  const auto [lo, hi] = range_of(rank_);
  // The local optimizer's groups: one per user group that has a piece here, in order.
  std::vector<torch::optim::OptimizerParamGroup> groups;
  std::vector<int> group_of;
  for (const Place& place : places) {
    const std::int64_t begin = std::max(lo, place.offset) - place.offset;
    const std::int64_t end = std::min(hi, place.offset + place.param.numel()) - place.offset;
    if (begin >= end) continue;
    Piece piece;
    piece.group = place.group;
    piece.index = place.index;
    piece.offset = place.offset;
    piece.begin = begin;
    piece.numel = end - begin;
    piece.param = place.param;
    piece.view = place.param.detach().view({-1}).narrow(0, begin, end - begin);
    if (group_of.empty() || group_of.back() != place.group) {
      groups.emplace_back(std::vector<at::Tensor>{},
                          optimizer.param_groups()[static_cast<std::size_t>(place.group)]
                              .options()
                              .clone());
      group_of.push_back(place.group);
    }
    groups.back().params().push_back(piece.view);
    pieces_.push_back(std::move(piece));
  }
  local_groups_ = group_of;
  local_ = same_kind(optimizer, std::move(groups));
}

std::pair<std::int64_t, std::int64_t> ZeroOptimizer::range_of(int rank) const {
  const std::int64_t begin = std::min(total_, part_ * rank);
  return {begin, std::min(total_, begin + part_)};
}

std::int64_t ZeroOptimizer::state_bytes() const {
  std::int64_t bytes = 0;
  for (const auto& entry : local_->state()) {
    const torch::optim::OptimizerParamState& s = *entry.second;
    if (const auto* adam = dynamic_cast<const torch::optim::AdamParamState*>(&s)) {
      for (const at::Tensor& t : {adam->exp_avg(), adam->exp_avg_sq(), adam->max_exp_avg_sq()}) {
        if (t.defined()) bytes += static_cast<std::int64_t>(t.nbytes());
      }
    } else if (const auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(&s)) {
      for (const at::Tensor& t :
           {adamw->exp_avg(), adamw->exp_avg_sq(), adamw->max_exp_avg_sq()}) {
        if (t.defined()) bytes += static_cast<std::int64_t>(t.nbytes());
      }
    } else if (const auto* sgd = dynamic_cast<const torch::optim::SGDParamState*>(&s)) {
      if (sgd->momentum_buffer().defined()) {
        bytes += static_cast<std::int64_t>(sgd->momentum_buffer().nbytes());
      }
    }
  }
  return bytes;
}

void ZeroOptimizer::reduce_gradients() {
  at::NoGradGuard no_grad;
  const auto [lo, hi] = range_of(rank_);
  if (stage_ == 1) {
    for (Piece& piece : pieces_) {
      const at::Tensor& grad = piece.param.grad();
      piece.view.mutable_grad() =
          grad.defined() ? grad.reshape({-1}).narrow(0, piece.begin, piece.numel) : at::Tensor();
    }
    return;
  }
  // Stage 2: the flat gradients, padded to N equal parts, summed over the ranks into this
  // rank's part; then averaged as the unsharded backward() averages (sum, then divide by N).
  at::Tensor flat = at::zeros({part_ * world_}, params_.front().options());
  std::vector<bool> had;
  std::int64_t offset = 0;
  for (at::Tensor& p : params_) {
    const at::Tensor& grad = p.grad();
    had.push_back(grad.defined());
    if (grad.defined()) flat.narrow(0, offset, p.numel()).copy_(grad.reshape({-1}));
    offset += p.numel();
    // Freed: from here this process keeps its part only.
    if (grad.defined()) p.mutable_grad() = at::Tensor();
  }
  reduced_ = group_ != nullptr
                 ? group_->reduce_scatter(flat, "backward(): reduce-scattering the gradients")
                 : flat;
  reduced_.div_(static_cast<double>(world_));
  std::size_t k = 0;
  offset = 0;
  for (Piece& piece : pieces_) {
    while (params_[k].unsafeGetTensorImpl() != piece.param.unsafeGetTensorImpl()) ++k;
    piece.view.mutable_grad() =
        had[k] ? reduced_.narrow(0, piece.offset + piece.begin - lo, piece.numel) : at::Tensor();
  }
  (void)hi;
}

bool ZeroOptimizer::found_inf_anywhere(bool local_inf) {
  if (stage_ == 1 || group_ == nullptr) return local_inf;
  at::Tensor flag = at::zeros({1}, at::kFloat);
  flag.fill_(local_inf ? 1.0 : 0.0);
  group_->allreduce(flag, ProcessGroup::ReduceOp::Max, "the GradScaler's inf check");
  return flag.item<float>() > 0;
}

double ZeroOptimizer::clip_grad_norm(double max_norm, double norm_type) {
  at::NoGradGuard no_grad;
  std::vector<at::Tensor> grads;
  for (const Piece& piece : pieces_) {
    if (piece.view.grad().defined()) grads.push_back(piece.view.grad());
  }
  const bool inf_norm = std::isinf(norm_type);
  at::Tensor local = at::zeros({1}, at::kDouble);
  for (const at::Tensor& g : grads) {
    if (inf_norm) {
      local = at::maximum(local, g.abs().max().to(at::kDouble).reshape({1}));
    } else {
      local += g.to(at::kDouble).abs().pow(norm_type).sum().reshape({1});
    }
  }
  if (group_ != nullptr) {
    group_->allreduce(local, inf_norm ? ProcessGroup::ReduceOp::Max : ProcessGroup::ReduceOp::Sum,
                      "clip_grad_norm_(): the norm over every process's gradients");
  }
  const double total = inf_norm ? local.item<double>()
                                 : std::pow(local.item<double>(), 1.0 / norm_type);
  const double coef = max_norm / (total + 1e-6);
  if (coef < 1.0) {
    for (at::Tensor& g : grads) g.mul_(coef);
  }
  return total;
}

void ZeroOptimizer::step() {
  at::NoGradGuard no_grad;
  // A scheduler changes the user's groups' options: the local groups take them now.
  for (std::size_t lg = 0; lg < local_groups_.size(); ++lg) {
    local_->param_groups()[lg].set_options(
        user_->param_groups()[static_cast<std::size_t>(local_groups_[lg])].options().clone());
  }
  if (!pieces_.empty()) local_->step();
  if (group_ == nullptr) return;
  const auto [lo, hi] = range_of(rank_);
  at::Tensor mine = at::zeros({part_}, params_.front().options());
  for (const Piece& piece : pieces_) {
    mine.narrow(0, piece.offset + piece.begin - lo, piece.numel).copy_(piece.view);
  }
  (void)hi;
  at::Tensor flat = at::cat(group_->allgather(mine, "optimizer step: gathering the parameters"));
  std::int64_t offset = 0;
  for (at::Tensor& p : params_) {
    p.detach().view({-1}).copy_(flat.narrow(0, offset, p.numel()));
    offset += p.numel();
  }
}

void ZeroOptimizer::gather_into_user() {
  at::NoGradGuard no_grad;
  const auto [lo, hi] = range_of(rank_);
  (void)hi;
  auto& local_state = local_->state();
  // Which fields exist (a field a rank has not made yet, such as max_exp_avg_sq without
  // amsgrad, stays undefined everywhere) and each parameter's step: the largest over the ranks,
  // which is the count of every rank holding a piece of it.
  const std::size_t kFields = 3;
  const auto params = static_cast<std::int64_t>(params_.size());
  // present[i][f]: parameter i's field f exists on some rank (amsgrad's max_exp_avg_sq exists
  // only in the groups that have amsgrad).
  at::Tensor present = at::zeros({params, static_cast<std::int64_t>(kFields)}, at::kFloat);
  at::Tensor steps = at::zeros({static_cast<std::int64_t>(params_.size())}, at::kDouble);
  std::vector<at::Tensor> flats(kFields);
  for (std::size_t f = 0; f < kFields; ++f) {
    flats[f] = at::zeros({part_}, params_.front().options());
  }
  std::size_t k = 0;
  for (const Piece& piece : pieces_) {
    while (params_[k].unsafeGetTensorImpl() != piece.param.unsafeGetTensorImpl()) ++k;
    auto it = local_state.find(compat::optimizer_state_key(piece.view));
    if (it == local_state.end()) continue;
    Fields fields = fields_of(*it->second);
    if (fields.step != nullptr) steps[static_cast<std::int64_t>(k)] = static_cast<double>(*fields.step);
    for (std::size_t f = 0; f < fields.tensors.size(); ++f) {
      if (!fields.tensors[f]->defined()) continue;
      present[static_cast<std::int64_t>(k)][static_cast<std::int64_t>(f)] = 1.0;
      flats[f].narrow(0, piece.offset + piece.begin - lo, piece.numel).copy_(*fields.tensors[f]);
    }
  }
  if (group_ != nullptr) {
    group_->allreduce(present, ProcessGroup::ReduceOp::Max, "save_state(): the optimizer's fields");
    group_->allreduce(steps, ProcessGroup::ReduceOp::Max, "save_state(): the optimizer's steps");
  }
  at::Tensor any_present = std::get<0>(present.max(0));
  std::vector<at::Tensor> whole(kFields);
  for (std::size_t f = 0; f < kFields; ++f) {
    if (any_present[static_cast<std::int64_t>(f)].item<float>() == 0) continue;
    whole[f] = group_ != nullptr
                   ? at::cat(group_->allgather(flats[f], "save_state(): gathering the optimizer state"))
                   : flats[f];
  }
  auto& user_state = user_->state();
  user_state.clear();
  std::int64_t offset = 0;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    const std::int64_t n = p.numel();
    const auto row = static_cast<std::int64_t>(i);
    bool any = steps[row].item<double>() > 0;
    for (std::size_t f = 0; f < kFields; ++f) {
      any = any || present[row][static_cast<std::int64_t>(f)].item<float>() > 0;
    }
    if (any) {
      auto state = new_state(*user_);
      Fields fields = fields_of(*state);
      if (fields.step != nullptr) {
        *fields.step = static_cast<std::int64_t>(steps[static_cast<std::int64_t>(i)].item<double>());
      }
      for (std::size_t f = 0; f < fields.tensors.size(); ++f) {
        if (present[row][static_cast<std::int64_t>(f)].item<float>() > 0) {
          *fields.tensors[f] = whole[f].narrow(0, offset, n).view(p.sizes()).clone();
        }
      }
      user_state[compat::optimizer_state_key(p)] = std::move(state);
    }
    offset += n;
  }
}

void ZeroOptimizer::take_from_user() {
  at::NoGradGuard no_grad;
  auto& user_state = user_->state();
  auto& local_state = local_->state();
  local_state.clear();
  for (const Piece& piece : pieces_) {
    auto it = user_state.find(compat::optimizer_state_key(piece.param));
    if (it == user_state.end()) continue;
    Fields from = fields_of(*it->second);
    auto state = new_state(*user_);
    Fields to = fields_of(*state);
    if (from.step != nullptr) *to.step = *from.step;
    for (std::size_t f = 0; f < from.tensors.size(); ++f) {
      if (!from.tensors[f]->defined()) continue;
      *to.tensors[f] = from.tensors[f]->reshape({-1}).narrow(0, piece.begin, piece.numel).clone();
    }
    local_state[compat::optimizer_state_key(piece.view)] = std::move(state);
  }
  user_state.clear();
}

void ZeroOptimizer::clear_user_state() { user_->state().clear(); }

ZeroLayout ZeroOptimizer::layout(const std::string& name) const {
  ZeroLayout out;
  out.optimizer = name;
  out.stage = stage_;
  out.world = world_;
  out.total = total_;
  out.part = part_;
  out.chunk = chunk_;
  std::int64_t offset = 0;
  for (std::size_t g = 0; g < user_->param_groups().size(); ++g) {
    const auto& params = user_->param_groups()[g].params();
    for (std::size_t i = 0; i < params.size(); ++i) {
      if (!params[i].requires_grad()) continue;
      out.params.push_back({static_cast<int>(g), static_cast<int>(i), offset,
                            params[i].sizes().vec()});
      offset += params[i].numel();
    }
  }
  return out;
}

// The local optimizer's (group, index) of each piece, in the pieces' order: the constructor
// opened a local group at each change of the user's group.
static std::vector<std::pair<int, int>> local_places(
    const std::vector<ZeroOptimizer::Piece>& pieces) {
  std::vector<std::pair<int, int>> out;
  int lg = -1, li = 0, last_group = -1;
  for (const ZeroOptimizer::Piece& piece : pieces) {
    if (piece.group != last_group) {
      ++lg;
      li = 0;
      last_group = piece.group;
    }
    out.emplace_back(lg, li++);
  }
  return out;
}

StateDict ZeroOptimizer::shard_state() const {
  StateDict local = optimizer_state_dict(*local_);
  StateDict out;
  out.set_description("ZeRO shard");
  out.set("zero.rank", rank_);
  out.set("zero.world", world_);
  const auto places = local_places(pieces_);
  for (std::size_t k = 0; k < pieces_.size(); ++k) {
    const Piece& piece = pieces_[k];
    const std::string at = fmt::format("{}.{}", piece.group, piece.index);
    out.set("zero." + at + ".begin", piece.begin);
    out.set("zero." + at + ".numel", piece.numel);
    const std::string from = fmt::format("state.{}.{}", places[k].first, places[k].second);
    if (!local.has_child(from)) continue;
    // Each tensor in chunks (views), so that a load whose range begins or ends inside the
    // piece reads and verifies only the chunks it needs.
    const StateDict state = local.child(from);
    for (const auto& [field, value] : state.entries()) {
      const std::string key = fmt::format("state.{}.{}", at, field);
      if (!std::holds_alternative<at::Tensor>(value)) {
        out.set(key, std::get<Json>(value));
        continue;
      }
      const at::Tensor& t = std::get<at::Tensor>(value);
      for (std::int64_t c = 0, begin = 0; begin < t.numel(); ++c, begin += chunk_) {
        out.set(fmt::format("{}.{}", key, c),
                t.narrow(0, begin, std::min(chunk_, t.numel() - begin)));
      }
    }
  }
  return out;
}

StateDict ZeroOptimizer::local_state_from(const ZeroLayout& saved,
                                          const std::map<int, ZeroShard>& shards,
                                          const std::string& where) const {
  const ZeroLayout mine = layout(saved.optimizer);
  bool same = mine.params.size() == saved.params.size() && mine.total == saved.total;
  for (std::size_t k = 0; same && k < mine.params.size(); ++k) {
    same = mine.params[k].group == saved.params[k].group &&
           mine.params[k].index == saved.params[k].index &&
           mine.params[k].shape == saved.params[k].shape;
  }
  if (!same) {
    throw Error(ErrorCode::Incompatible,
                fmt::format("{}: {} was saved sharded over {} trainable parameters ({} elements); "
                            "the prepared optimizer has {} ({} elements) in other groups or "
                            "shapes: prepare the same model and param groups",
                            where, saved.optimizer, saved.params.size(), saved.total,
                            mine.params.size(), mine.total));
  }
  StateDict out = optimizer_state_dict(*local_);
  for (const std::string& key : out.keys()) {
    if (key.starts_with("state.")) out.erase(key);
  }
  const auto places = local_places(pieces_);
  std::size_t p = 0;
  for (std::size_t k = 0; k < pieces_.size(); ++k) {
    const Piece& piece = pieces_[k];
    while (saved.params[p].group != piece.group || saved.params[p].index != piece.index) ++p;
    StateDict state =
        zero_piece_state(saved, shards, saved.params[p], piece.begin, piece.numel, where);
    if (!state.empty()) {
      out.set_child(fmt::format("state.{}.{}", places[k].first, places[k].second), state);
    }
  }
  return out;
}

void ZeroOptimizer::set_local_state(const StateDict& state) {
  // local_state_from() assembled every state tensor in new memory of its own: no copy again.
  detail::TakeLoadedState take;
  load_optimizer_state_dict(*local_, state);
  user_->state().clear();
}

}  // namespace torchpoint::detail
