// Weights written by Python (torch.save of a state dict, and a safetensors file from another
// writer) load into a LibTorch module with the exact values.
#include "torchpoint/interop.h"

#include <sys/wait.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdlib>
#include <fstream>

#include "testing/test_util.h"
#include "torchpoint/error.h"
#include "torchpoint/module_state.h"

namespace torchpoint {
namespace {

class FromPython : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* src = std::getenv("TORCHPOINT_SOURCE_DIR");
    ASSERT_NE(src, nullptr);
    std::string cmd = fmt::format("/usr/bin/python3 {}/tests/python/write_python_weights.py {}",
                                  src, dir_.path());
    int rc = std::system(cmd.c_str());
    ASSERT_TRUE(WIFEXITED(rc) && WEXITSTATUS(rc) == 0)
        << cmd << " failed: install python3-torch (scripts/setup.sh does)";
    std::ifstream in(dir_ / "expected.json");
    expected_ = nlohmann::json::parse(in);
  }

  // Loads `sd` into a fresh Sequential and checks every value against Python's.
  void expect_python_values(const StateDict& sd) {
    auto model =
        torch::nn::Sequential(torch::nn::Linear(4, 3), torch::nn::ReLU(), torch::nn::Linear(3, 2));
    LoadReport report = load_module_state_dict(*model, sd);
    EXPECT_EQ(report.loaded.size(), 4u);
    for (const auto& item : model->named_parameters()) {
      const auto& want = expected_.at(item.key());
      at::Tensor got = item.value().detach().contiguous();
      ASSERT_EQ(got.sizes().vec(), want.at("shape").get<std::vector<std::int64_t>>()) << item.key();
      const float* p = got.data_ptr<float>();
      const auto& values = want.at("values");
      ASSERT_EQ(static_cast<std::size_t>(got.numel()), values.size());
      for (std::size_t i = 0; i < values.size(); ++i) {
        double v = std::strtod(values[i].get<std::string>().c_str(), nullptr);
        EXPECT_EQ(static_cast<float>(v), p[i]) << item.key() << "[" << i << "]";
      }
    }
  }

  testing::TempDir dir_;
  nlohmann::json expected_;
};

TEST_F(FromPython, TorchSaveOfAStateDictLoadsIntoAModule) {
  StateDict sd = load_torch_state_dict(dir_ / "model.pt");
  EXPECT_EQ(sd.keys(), (std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"}));
  expect_python_values(sd);
  // model.state_dict() itself is an OrderedDict, which LibTorch 1.13 cannot unpickle: a clear
  // error that says what to save instead, never a silent empty result.
  testing::expect_error([&] { load_torch_state_dict(dir_ / "ordered.pt"); }, ErrorCode::Unsupported,
                        {"OrderedDict", "dict(model.state_dict())"});
}

TEST_F(FromPython, ForeignSafetensorsLoadAfterStructuralChecks) {
  ForeignContainer c = load_safetensors(dir_ / "plain.safetensors");
  EXPECT_FALSE(c.verified);
  expect_python_values(StateDict::from_container(c.contents));
  // load_file insists on checksums: a foreign file is refused there, with a reason.
  testing::expect_error([&] { load_file(dir_ / "plain.safetensors"); }, ErrorCode::Corruption,
                        {"not a torchpoint file"});
  // A torchpoint file through the same door is fully verified.
  save_file(dir_ / "ours.safetensors", c.contents);
  EXPECT_TRUE(load_safetensors(dir_ / "ours.safetensors").verified);
}

TEST_F(FromPython, DamagedOrWrongFilesAreClearErrors) {
  std::string bytes = testing::read_bytes(dir_ / "plain.safetensors");
  testing::write_bytes(dir_ / "short.safetensors", bytes.substr(0, bytes.size() - 3));
  testing::expect_error([&] { load_safetensors(dir_ / "short.safetensors"); },
                        ErrorCode::Corruption, {"truncated"});
  testing::expect_error([&] { load_torch_state_dict(dir_ / "plain.safetensors"); },
                        ErrorCode::Corruption, {"torch.save"});
  testing::expect_error([&] { load_torch_state_dict(dir_ / "missing.pt"); }, ErrorCode::NotFound);
}

}  // namespace
}  // namespace torchpoint
