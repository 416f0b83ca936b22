// Module state: round trip, continuation, and loads that check everything before changing it.
#include "torchpoint/module_state.h"

#include <torch/torch.h>

#include "testing/test_util.h"
#include "torchpoint/error.h"
#include "torchpoint/tensor_file.h"

namespace torchpoint {
namespace {

struct NetImpl : torch::nn::Module {
  explicit NetImpl(int hidden = 8) {
    fc1 = register_module("fc1", torch::nn::Linear(10, hidden));
    bn = register_module("bn", torch::nn::BatchNorm1d(hidden));
    fc2 = register_module("fc2", torch::nn::Linear(hidden, 1));
  }
  torch::Tensor forward(torch::Tensor x) { return fc2(torch::relu(bn(fc1(x)))); }
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
  torch::nn::BatchNorm1d bn{nullptr};
};
TORCH_MODULE(Net);

std::vector<torch::Tensor> snapshot(const torch::nn::Module& m) {
  std::vector<torch::Tensor> out;
  for (const auto& t : m.parameters()) out.push_back(t.clone());
  for (const auto& t : m.buffers()) out.push_back(t.clone());
  return out;
}

bool unchanged(const torch::nn::Module& m, const std::vector<torch::Tensor>& before) {
  auto now = snapshot(m);
  for (std::size_t i = 0; i < now.size(); ++i) {
    if (!testing::bitwise_equal(now[i], before[i])) return false;
  }
  return true;
}

TEST(ModuleState, HoldsParametersThenBuffersByName) {
  Net net;
  StateDict sd = module_state_dict(*net);
  EXPECT_EQ(sd.keys(), (std::vector<std::string>{"fc1.weight", "fc1.bias", "bn.weight", "bn.bias",
                                                 "fc2.weight", "fc2.bias", "bn.running_mean",
                                                 "bn.running_var", "bn.num_batches_tracked"}));
}

TEST(ModuleState, ContinuationThroughAFileIsBitIdentical) {
  torch::manual_seed(0);
  Net a;
  torch::optim::SGD opt_a(a->parameters(), 0.1);
  auto x = torch::randn({32, 10});
  auto y = torch::randn({32, 1});
  auto step = [&](Net& net, torch::optim::SGD& opt) {
    opt.zero_grad();
    auto loss = torch::mse_loss(net->forward(x), y);
    loss.backward();
    opt.step();
    return loss.item<float>();
  };
  for (int i = 0; i < 5; ++i) step(a, opt_a);
  testing::TempDir dir;
  save_file(dir / "m.safetensors", module_state_dict(*a).to_container());

  torch::manual_seed(42);
  Net b;
  torch::optim::SGD opt_b(b->parameters(), 0.1);  // SGD without momentum keeps no state
  LoadReport report =
      load_module_state_dict(*b, StateDict::from_container(load_file(dir / "m.safetensors")));
  EXPECT_TRUE(report.complete()) << report.summary();
  EXPECT_EQ(report.loaded.size(), 9u);
  for (int i = 0; i < 5; ++i) {
    float la = step(a, opt_a), lb = step(b, opt_b);
    EXPECT_EQ(std::memcmp(&la, &lb, sizeof la), 0) << "step " << i;
  }
  auto pa = snapshot(*a), pb = snapshot(*b);
  for (std::size_t i = 0; i < pa.size(); ++i) EXPECT_TRUE(testing::bitwise_equal(pa[i], pb[i]));
}

TEST(ModuleState, StrictLoadListsEveryProblemAndChangesNothing) {
  Net small(8);
  Net big(16);
  StateDict sd = module_state_dict(*big);
  sd.erase("fc2.bias");
  sd.set("extra.weight", torch::ones({1}));
  auto before = snapshot(*small);
  try {
    load_module_state_dict(*small, sd);
    FAIL() << "must throw";
  } catch (const Error& e) {
    std::string m = e.what();
    EXPECT_EQ(e.code(), ErrorCode::Incompatible);
    EXPECT_NE(m.find("missing keys: fc2.bias"), std::string::npos) << m;
    EXPECT_NE(m.find("unexpected keys: extra.weight"), std::string::npos) << m;
    EXPECT_NE(m.find("size mismatch for fc1.weight: checkpoint [16, 10], model [8, 10]"),
              std::string::npos)
        << m;
    EXPECT_NE(m.find("nothing was loaded"), std::string::npos) << m;
  }
  EXPECT_TRUE(unchanged(*small, before));
}

TEST(ModuleState, DtypeMismatchIsReported) {
  Net a;
  StateDict sd = module_state_dict(*a);
  sd.set("fc1.bias", sd.tensor("fc1.bias").to(torch::kDouble));
  try {
    load_module_state_dict(*a, sd);
    FAIL();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("dtype mismatch for fc1.bias"), std::string::npos);
  }
}

TEST(ModuleState, NonStrictLoadsTheMatchingSubsetAndReportsTheRest) {
  Net small(8);
  Net big(16);
  torch::manual_seed(3);
  Net donor(8);
  StateDict sd = module_state_dict(*donor);
  sd.set("fc1.weight", module_state_dict(*big).tensor("fc1.weight"));
  sd.set("unused", 1);
  LoadReport r = load_module_state_dict(*small, sd, /*strict=*/false);
  EXPECT_FALSE(r.complete());
  EXPECT_EQ(r.mismatched.size(), 1u);
  EXPECT_EQ(r.unexpected, std::vector<std::string>{"unused"});
  EXPECT_TRUE(small->fc2->weight.equal(donor->fc2->weight));
  EXPECT_FALSE(small->fc1->weight.sizes() == big->fc1->weight.sizes());
  EXPECT_NE(r.summary().find("size mismatch for fc1.weight"), std::string::npos);
}

TEST(ModuleState, OptimizerStillPointsAtTheLoadedParameters) {
  Net a, b;
  torch::optim::SGD opt(b->parameters(), 0.1);
  load_module_state_dict(*b, module_state_dict(*a));
  EXPECT_EQ(opt.param_groups()[0].params()[0].data_ptr(), b->fc1->weight.data_ptr());
  EXPECT_TRUE(b->fc1->weight.equal(a->fc1->weight));
}

}  // namespace
}  // namespace torchpoint
