// The model of the benchmark's state S2, shared by torchpoint_bench and torchpoint_dist_bench: a
// transformer-like stack of linear layers and layer norms (parameters only, no forward) with an
// Adam optimizer that has taken a few steps, so that its moments are part of the state.
#pragma once

#include <fmt/format.h>
#include <torch/torch.h>

#include <cstdint>
#include <memory>
#include <string>

namespace torchpoint::bench {

struct BlockImpl : torch::nn::Module {
  BlockImpl(std::int64_t d, std::int64_t ffn) {
    ln1 = register_module("ln1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    q = register_module("q", torch::nn::Linear(d, d));
    k = register_module("k", torch::nn::Linear(d, d));
    v = register_module("v", torch::nn::Linear(d, d));
    o = register_module("o", torch::nn::Linear(d, d));
    ln2 = register_module("ln2", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
    ff1 = register_module("ff1", torch::nn::Linear(d, ffn));
    ff2 = register_module("ff2", torch::nn::Linear(ffn, d));
  }
  torch::nn::LayerNorm ln1{nullptr}, ln2{nullptr};
  torch::nn::Linear q{nullptr}, k{nullptr}, v{nullptr}, o{nullptr}, ff1{nullptr}, ff2{nullptr};
};
TORCH_MODULE(Block);

// Only the parameters matter here, so there is no forward().
struct TinyTransformerImpl : torch::nn::Module {
  TinyTransformerImpl(std::int64_t blocks, std::int64_t d, std::int64_t ffn, std::int64_t vocab,
                      std::int64_t positions) {
    tok = register_module("tok", torch::nn::Embedding(vocab, d));
    pos = register_module("pos", torch::nn::Embedding(positions, d));
    layers = register_module("blocks", torch::nn::ModuleList());
    for (std::int64_t i = 0; i < blocks; ++i) layers->push_back(Block(d, ffn));
    ln_f = register_module("ln_f", torch::nn::LayerNorm(torch::nn::LayerNormOptions({d})));
  }
  torch::nn::Embedding tok{nullptr}, pos{nullptr};
  torch::nn::ModuleList layers{nullptr};
  torch::nn::LayerNorm ln_f{nullptr};
};
TORCH_MODULE(TinyTransformer);

struct S2Model {
  TinyTransformer model{nullptr};
  std::unique_ptr<torch::optim::Adam> adam;
  std::string description;
};

// 24 blocks of d=256 and a 32k vocabulary (about 27M parameters, 314 MiB with Adam's moments), or
// 2 blocks and a 2k vocabulary with `quick`. Gradients are randn, so call torch::manual_seed first
// for the same state in every process.
inline S2Model make_s2_model(bool quick) {
  const std::int64_t blocks = quick ? 2 : 24;
  const std::int64_t d = 256, ffn = 1024, positions = 1024;
  const std::int64_t vocab = quick ? 2000 : 32000;
  S2Model m;
  m.model = TinyTransformer(blocks, d, ffn, vocab, positions);
  m.adam =
      std::make_unique<torch::optim::Adam>(m.model->parameters(), torch::optim::AdamOptions(1e-3));
  constexpr int kAdamSteps = 3;
  for (int step = 0; step < kAdamSteps; ++step) {
    for (auto& p : m.model->parameters()) p.mutable_grad() = torch::randn_like(p);
    m.adam->step();
  }
  std::int64_t numel = 0;
  for (const auto& p : m.model->parameters()) numel += p.numel();
  m.description = fmt::format(
      "transformer-like ({} blocks, d={}, ffn={}, vocab={}): {} params in {} tensors + Adam "
      "state after {} steps",
      blocks, d, ffn, vocab, numel, m.model->parameters().size(), kAdamSteps);
  return m;
}

}  // namespace torchpoint::bench
