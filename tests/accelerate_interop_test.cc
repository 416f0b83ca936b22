// Checkpoints of the real Python Accelerate (tests/python/accelerate_checkpoints.py) loaded by
// the Accelerator for every optimizer type, hostile ones refused with nothing changed, and
// torchpoint checkpoints exported for every optimizer type and loaded back by Python.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <memory>

#include "testing/test_util.h"
#include "torchpoint/accelerate_interop.h"
#include "torchpoint/accelerator.h"
#include "torchpoint/grad_scaler.h"
#include "torchpoint/interop.h"
#include "torchpoint/module_state.h"
#include "torchpoint/optimizer_state.h"
#include "torchpoint/tensor_file.h"

namespace torchpoint {
namespace {

using testing::TempDir;

// The model and optimizers of accelerate_checkpoints.py, in LibTorch.
struct PreparedRun {
  torch::nn::Sequential model{torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2)};
  std::shared_ptr<torch::optim::Optimizer> optimizer;
  std::unique_ptr<StepLR> scheduler;
  std::unique_ptr<Accelerator> acc;

  explicit PreparedRun(const std::string& name, Env& env = Env::posix()) {
    torch::manual_seed(0);
    acc = std::make_unique<Accelerator>(ProjectConfiguration(), env, nullptr);
    std::vector<at::Tensor> weights, biases;
    for (const auto& p : model->named_parameters()) {
      (p.key().ends_with("weight") ? weights : biases).push_back(p.value());
    }
    if (name == "sgd") {
      std::vector<torch::optim::OptimizerParamGroup> groups;
      groups.emplace_back(weights);
      groups.emplace_back(biases, std::make_unique<torch::optim::SGDOptions>(
                                      torch::optim::SGDOptions(0.05).momentum(0.9).weight_decay(0.001)));
      optimizer = std::make_shared<torch::optim::SGD>(
          groups, torch::optim::SGDOptions(0.1).momentum(0.9).nesterov(true));
    } else if (name == "adam") {
      optimizer = std::make_shared<torch::optim::Adam>(
          model->parameters(), torch::optim::AdamOptions(1e-2).amsgrad(true));
    } else if (name == "adamw") {
      optimizer = std::make_shared<torch::optim::AdamW>(
          model->parameters(), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
    } else if (name == "rmsprop") {
      optimizer = std::make_shared<torch::optim::RMSprop>(
          model->parameters(), torch::optim::RMSpropOptions(1e-2).momentum(0.5).centered(true));
    } else {
      optimizer = std::make_shared<torch::optim::Adagrad>(
          model->parameters(), torch::optim::AdagradOptions(0.1).lr_decay(0.01));
    }
    acc->prepare(model, optimizer);
    if (name == "adamw") {
      scheduler = std::make_unique<StepLR>(*optimizer, StepLROptions(2).gamma(0.5));
      acc->register_for_checkpointing(*scheduler);
    }
  }

  // What accelerate_checkpoints.py's reference() records, from this side.
  StateDict reference() const {
    StateDict out;
    for (const auto& p : model->named_parameters()) out.set("model." + p.key(), p.value().detach());
    StateDict opt = optimizer_state_dict(*optimizer);
    for (std::size_t g = 0; g < optimizer->param_groups().size(); ++g) {
      out.set(fmt::format("optimizer.lr.{}", g),
              torch::tensor({optimizer->param_groups()[g].options().get_lr()}, torch::kDouble));
    }
    for (const auto& [key, value] : opt.entries()) {
      if (!key.starts_with("state.")) continue;
      if (const at::Tensor* t = std::get_if<at::Tensor>(&value)) {
        out.set("optimizer." + key, *t);
      } else if (key.ends_with(".step")) {
        out.set("optimizer." + key,
                torch::tensor({std::get<Json>(value).get<std::int64_t>()}, torch::kLong));
      }
    }
    if (scheduler) {
      out.set("scheduler.last_epoch", torch::tensor({scheduler->last_epoch()}, torch::kLong));
    }
    out.set("rng", at::detail::getDefaultCPUGenerator().get_state());
    return out;
  }
};

void expect_same(const StateDict& got, const StateDict& want) {
  std::vector<std::string> got_keys = got.keys(), want_keys = want.keys();
  std::sort(got_keys.begin(), got_keys.end());
  std::sort(want_keys.begin(), want_keys.end());
  EXPECT_EQ(got_keys, want_keys);
  for (const std::string& key : want.keys()) {
    if (!got.contains(key)) continue;
    EXPECT_TRUE(testing::bitwise_equal(got.tensor(key), want.tensor(key))) << key;
  }
}

class AccelerateInterop : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new TempDir();
    auto run = testing::run_python_script("accelerate_checkpoints.py", {"write", dir_->path()});
    written_ = run.status == 0;
    output_ = run.output;
  }
  static void TearDownTestSuite() {
    delete dir_;
    dir_ = nullptr;
  }
  void SetUp() override { ASSERT_TRUE(written_) << output_; }
  static std::string path(const std::string& name) { return (*dir_) / name; }
  static StateDict python_reference(const std::string& name) {
    return StateDict::from_container(load_safetensors(path(name + ".reference.safetensors")).contents);
  }

  static TempDir* dir_;
  static bool written_;
  static std::string output_;
};
TempDir* AccelerateInterop::dir_ = nullptr;
bool AccelerateInterop::written_ = false;
std::string AccelerateInterop::output_;

TEST_F(AccelerateInterop, RecognisesAccelerateDirectoriesAndNotTorchpointOnes) {
  EXPECT_TRUE(is_accelerate_checkpoint(path("adamw")));
  EXPECT_FALSE(is_accelerate_checkpoint(path("nothing here")));
  TempDir own;
  PreparedRun s("adam");
  const std::string saved = s.acc->save_state(own / "c");
  EXPECT_FALSE(is_accelerate_checkpoint(saved));
  // Uncommitted (no manifest): still not Accelerate's, so load_state refuses it as before.
  Env::posix().remove_file(saved + "/manifest.json");
  EXPECT_FALSE(is_accelerate_checkpoint(saved));
  testing::expect_error([&] { s.acc->load_state(saved); }, ErrorCode::NotFound, {"manifest"});
}

TEST_F(AccelerateInterop, EveryOptimizerTypeLoadsBitForBit) {
  for (const std::string name : {"sgd", "adam", "adamw", "rmsprop", "adagrad"}) {
    SCOPED_TRACE(name);
    PreparedRun s(name);
    LoadStateReport report = s.acc->load_state(path(name));
    expect_same(s.reference(), python_reference(name));
    EXPECT_EQ(report.step, 0);  // Accelerate counts steps in accumulate(), not used here
    ASSERT_EQ(report.not_applicable.size(), 2u);
    EXPECT_NE(report.not_applicable[0].find("random_state (Python's random module)"),
              std::string::npos);
    EXPECT_NE(report.not_applicable[1].find("numpy_random_seed"), std::string::npos);
  }
}

TEST_F(AccelerateInterop, ARegisteredSchedulerContinuesItsSchedule) {
  PreparedRun s("adamw");
  s.acc->load_state(path("adamw"));
  EXPECT_EQ(s.scheduler->last_epoch(), 3);
  // StepLR(step_size=2, gamma=0.5) from 1e-2: halved at epochs 2 and 4.
  EXPECT_EQ(s.scheduler->get_last_lr()[0], 1e-2 * 0.5);
  s.scheduler->step();
  EXPECT_EQ(s.scheduler->get_last_lr()[0], 1e-2 * 0.5 * 0.5);
}

// Loads `dir` into a fresh AdamW setup and checks that it fails with `code`, naming `parts`,
// and that nothing changed: parameters, optimizer state, scheduler and RNG.
void expect_refused(const std::string& dir, ErrorCode code, const std::vector<std::string>& parts,
                    const std::string& kind = "adamw") {
  PreparedRun s(kind);
  StateDict before = s.reference();
  before = before.clone();
  testing::expect_error([&] { s.acc->load_state(dir); }, code, parts);
  expect_same(s.reference(), before);
  EXPECT_EQ(s.acc->step(), 0);
}

TEST_F(AccelerateInterop, AGradScalerCrossesBothWays) {
  PreparedRun s("adamw");
  GradScaler scaler;
  s.acc->prepare(scaler);
  s.acc->load_state(path("with_scaler"));
  EXPECT_EQ(scaler.get_scale(), 1024.0);
  StateDict state = scaler.state_dict();
  EXPECT_EQ(state.get<std::int64_t>("_growth_tracker"), 3);
  EXPECT_EQ(state.get<std::int64_t>("growth_interval"), 7);

  TempDir work;
  const std::string saved = s.acc->save_state(work / "checkpoint");
  AccelerateExport exported = export_accelerate_checkpoint(saved, work / "to_python");
  EXPECT_NE(std::find(exported.files.begin(), exported.files.end(), "scaler.pt"),
            exported.files.end());
  auto run = testing::run_python_script("accelerate_checkpoints.py",
                                        {"check_scaler", work / "to_python", "1024", "3"});
  EXPECT_EQ(run.status, 0) << run.output;
}

TEST_F(AccelerateInterop, AMissingFileIsNamedAndNothingChanges) {
  expect_refused(path("missing_optimizer"), ErrorCode::NotFound,
                 {"optimizer.bin", "prepared optimizer"});
}

TEST_F(AccelerateInterop, APickleWithAGlobalOutsidePlainDataIsRefused) {
  expect_refused(path("forbidden_global"), ErrorCode::Unsupported,
                 {"custom_checkpoint_0.pkl", "collections.deque", "never calls"});
}

TEST_F(AccelerateInterop, ACudaRngStateIsRefusedRatherThanDropped) {
  expect_refused(path("cuda_rng"), ErrorCode::Incompatible,
                 {"random_states_0.pkl", "torch_cuda_manual_seed"});
}

TEST_F(AccelerateInterop, ADamagedRecordFailsItsCrc) {
  expect_refused(path("damaged"), ErrorCode::Corruption, {"optimizer.bin", "CRC"});
}

TEST_F(AccelerateInterop, AFileNoObjectTakesIsRefused) {
  expect_refused(path("extra_optimizer"), ErrorCode::Incompatible,
                 {"optimizer_1.bin", "no prepared or registered object"});
}

TEST_F(AccelerateInterop, AnotherOptimizerTypeIsRefusedNamingBoth) {
  expect_refused(path("sgd"), ErrorCode::Incompatible, {"torch.optim.SGD", "AdamW"});
}

TEST_F(AccelerateInterop, AnotherParameterCountIsRefused) {
  PreparedRun s("adamw");
  // The same model, but an optimizer over all but the last parameter.
  std::vector<at::Tensor> params = s.model->parameters();
  params.pop_back();
  Accelerator acc;
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(1e-2));
  StepLR scheduler(opt, StepLROptions(2).gamma(0.5));
  acc.prepare(s.model, opt);
  acc.register_for_checkpointing(scheduler);
  StateDict before = module_state_dict(*s.model).clone();
  testing::expect_error([&] { acc.load_state(path("adamw")); }, ErrorCode::Incompatible,
                        {"optimizer.bin", "has 4 parameters", "has 3"});
  expect_same(module_state_dict(*s.model), before);
  EXPECT_TRUE(opt.state().empty());
}

TEST_F(AccelerateInterop, EveryOptimizerTypeExportsAndPythonLoadsItBitForBit) {
  TempDir work;
  const std::vector<std::string> names = {"sgd", "adam", "adamw", "rmsprop", "adagrad"};
  std::vector<std::string> check = {"check"};  // one Python process judges them all
  for (const std::string& name : names) {
    SCOPED_TRACE(name);
    PreparedRun s(name);
    torch::manual_seed(5);
    for (int step = 0; step < 3; ++step) {
      at::Tensor loss = torch::mse_loss(s.model->forward(torch::randn({5, 4})), torch::randn({5, 2}));
      s.acc->backward(loss);
      s.optimizer->step();
      if (s.scheduler) s.scheduler->step();
      s.optimizer->zero_grad();
    }
    const std::string dir = work / name;
    std::filesystem::create_directories(dir);
    std::string saved = s.acc->save_state(dir + "/checkpoint");
    AccelerateExport exported = export_accelerate_checkpoint(saved, dir + "/to_python");
    EXPECT_TRUE(is_accelerate_checkpoint(dir + "/to_python"));
    save_file(dir + "/reference.safetensors", s.reference().to_container());
    check.insert(check.end(), {name, dir + "/to_python", dir + "/reference.safetensors"});
  }
  auto run = testing::run_python_script("accelerate_checkpoints.py", check);
  EXPECT_EQ(run.status, 0) << run.output;
  for (const std::string& name : names) {
    EXPECT_NE(run.output.find(name + ": "), std::string::npos) << run.output;
  }
}

TEST_F(AccelerateInterop, ExportRefusesAnExistingDirectoryAndWhatAccelerateCannotHold) {
  TempDir work;
  PreparedRun s("adam");
  std::string saved = s.acc->save_state(work / "checkpoint");
  std::filesystem::create_directory(work / "taken");
  testing::expect_error([&] { export_accelerate_checkpoint(saved, work / "taken"); },
                        ErrorCode::InvalidArgument, {"exists"});

  Accelerator acc;
  torch::nn::Linear model(2, 1);
  torch::optim::LBFGS lbfgs(model->parameters(), torch::optim::LBFGSOptions(0.1));
  acc.prepare(model, lbfgs);
  std::string lbfgs_saved = acc.save_state(work / "lbfgs");
  testing::expect_error([&] { export_accelerate_checkpoint(lbfgs_saved, work / "out"); },
                        ErrorCode::Unsupported, {"LBFGS"});
  EXPECT_FALSE(std::filesystem::exists(work / "out"));
}

}  // namespace
}  // namespace torchpoint
