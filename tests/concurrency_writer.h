// The state a writer of concurrency_test saves: two models whose every parameter derives from
// the writer's number, so a checkpoint that mixed two writers' files is easy to recognise.
#pragma once

#include <torch/torch.h>

#include <utility>

#include "testing/test_util.h"

namespace torchpoint::testing {

inline at::Tensor writer_tensor(int writer, int which, std::vector<std::int64_t> shape) {
  return make_tensor(at::kFloat, std::move(shape),
                     static_cast<std::uint64_t>(writer) * 100 + which);
}

inline std::pair<torch::nn::Linear, torch::nn::Linear> writer_models(int writer) {
  torch::nn::Linear a(torch::nn::LinearOptions(16, 8)), b(torch::nn::LinearOptions(8, 2));
  torch::NoGradGuard no_grad;
  a->weight.copy_(writer_tensor(writer, 0, {8, 16}));
  a->bias.copy_(writer_tensor(writer, 1, {8}));
  b->weight.copy_(writer_tensor(writer, 2, {2, 8}));
  b->bias.copy_(writer_tensor(writer, 3, {2}));
  return {a, b};
}

}  // namespace torchpoint::testing
