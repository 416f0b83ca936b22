// LR schedulers: the learning rates equal PyTorch's own schedulers' bit for bit (the reference
// comes from running them through the project venv's torch), a run saved and restored at any step
// continues exactly, and bad states are refused with a clear error.
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <torch/torch.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "testing/test_util.h"
#include "torchpoint/error.h"
#include "torchpoint/lr_scheduler.h"
#include "torchpoint/state_dict.h"
#include "torchpoint/tensor_file.h"

namespace tp = torchpoint;
namespace optim = torch::optim;

namespace {

// ---------------------------------------------------------------------------------------------
// A tiny training job: a Linear model, a real optimizer with one or two param groups.

// The optimizers of tests/python/lr_reference.py, with the same options.
std::unique_ptr<optim::OptimizerOptions> options_for(const std::string& kind, double lr) {
  if (kind == "SGD")
    return std::make_unique<optim::SGDOptions>(optim::SGDOptions(lr).momentum(0.9));
  if (kind == "Adam") return std::make_unique<optim::AdamOptions>(lr);
  if (kind == "AdamW") return std::make_unique<optim::AdamWOptions>(lr);
  if (kind == "RMSprop") {
    return std::make_unique<optim::RMSpropOptions>(optim::RMSpropOptions(lr).momentum(0.5));
  }
  if (kind == "Adagrad") return std::make_unique<optim::AdagradOptions>(lr);
  throw std::invalid_argument("unknown optimizer " + kind);
}

// Two groups: the weight and the bias, each with its lr; one group: every parameter.
std::unique_ptr<optim::Optimizer> make_optimizer(const std::string& kind, torch::nn::Linear& model,
                                                 const std::vector<double>& lrs) {
  std::vector<std::vector<at::Tensor>> params;
  if (lrs.size() == 1) {
    params = {model->parameters()};
  } else {
    params = {{model->weight}, {model->bias}};
  }
  std::vector<optim::OptimizerParamGroup> groups;
  for (std::size_t i = 0; i < lrs.size(); ++i) {
    groups.emplace_back(params[i], options_for(kind, lrs[i]));
  }
  const double lr = lrs[0];
  std::unique_ptr<optim::Optimizer> optimizer;
  if (kind == "SGD") {
    optimizer = std::make_unique<optim::SGD>(groups, optim::SGDOptions(lr).momentum(0.9));
  } else if (kind == "Adam") {
    optimizer = std::make_unique<optim::Adam>(groups, optim::AdamOptions(lr));
  } else if (kind == "AdamW") {
    optimizer = std::make_unique<optim::AdamW>(groups, optim::AdamWOptions(lr));
  } else if (kind == "RMSprop") {
    optimizer = std::make_unique<optim::RMSprop>(groups, optim::RMSpropOptions(lr).momentum(0.5));
  } else {
    optimizer = std::make_unique<optim::Adagrad>(groups, optim::AdagradOptions(lr));
  }
  // LibTorch 2.x replaces a group's option that equals the class default (Adam's lr 0.001)
  // with the optimizer's own ("merge by comparison"); PyTorch keeps the group's. Set them again.
  for (std::size_t i = 0; i < lrs.size(); ++i)
    optimizer->param_groups()[i].options().set_lr(lrs[i]);
  return optimizer;
}

// SGD's or RMSprop's momentum, Adam's or AdamW's beta1; nullptr for Adagrad.
double* momentum_of(optim::OptimizerOptions& options) {
  if (auto* o = dynamic_cast<optim::SGDOptions*>(&options)) return &o->momentum();
  if (auto* o = dynamic_cast<optim::RMSpropOptions*>(&options)) return &o->momentum();
  if (auto* o = dynamic_cast<optim::AdamOptions*>(&options)) return &std::get<0>(o->betas());
  if (auto* o = dynamic_cast<optim::AdamWOptions*>(&options)) return &std::get<0>(o->betas());
  return nullptr;
}

// What the param groups hold after construction or a step.
struct Sample {
  std::vector<double> lr;
  std::vector<double> momentum;  // empty when the optimizer has none
};

// One scheduler configuration, spelled for PyTorch and for torchpoint.
struct Case {
  std::string name;
  std::string optimizer;    // "SGD", "Adam", "AdamW", "RMSprop", "Adagrad"
  std::vector<double> lrs;  // one per param group
  std::string scheduler;    // PyTorch's class name
  tp::Json kwargs;          // PyTorch's keyword arguments
  std::function<std::unique_ptr<tp::LRScheduler>(optim::Optimizer&)> make;  // the same settings
  int steps = 40;
  std::vector<double> metrics = {};  // ReduceLROnPlateau: one per step
};

// Names the case in gtest's messages.
void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

struct Job {
  explicit Job(const Case& c)
      : model(3, 2),
        optimizer(make_optimizer(c.optimizer, model, c.lrs)),
        scheduler(c.make(*optimizer)) {}

  // One training step, then one scheduler step, in PyTorch's order.
  void advance(const Case& c, int i) {
    optimizer->zero_grad();
    model->forward(torch::ones({4, 3})).pow(2).mean().backward();
    optimizer->step();
    if (auto* plateau = dynamic_cast<tp::ReduceLROnPlateau*>(scheduler.get())) {
      plateau->step(c.metrics.at(static_cast<std::size_t>(i)));
    } else {
      scheduler->step();
    }
  }

  Sample sample() const {
    Sample s;
    for (auto& group : optimizer->param_groups()) {
      s.lr.push_back(group.options().get_lr());
      if (double* m = momentum_of(group.options())) s.momentum.push_back(*m);
    }
    return s;
  }

  torch::nn::Linear model;
  std::unique_ptr<optim::Optimizer> optimizer;
  std::unique_ptr<tp::LRScheduler> scheduler;
};

std::string hex(double v) { return fmt::format("{:a}", v); }

// Bit-for-bit equality of two lists of doubles, reported in hexadecimal.
::testing::AssertionResult same_bits(const std::vector<double>& want,
                                     const std::vector<double>& got) {
  bool same = want.size() == got.size();
  for (std::size_t i = 0; same && i < want.size(); ++i) {
    same = std::bit_cast<std::uint64_t>(want[i]) == std::bit_cast<std::uint64_t>(got[i]);
  }
  if (same) return ::testing::AssertionSuccess();
  std::vector<std::string> w, g;
  for (double v : want) w.push_back(hex(v));
  for (double v : got) g.push_back(hex(v));
  return ::testing::AssertionFailure()
         << "want [" << fmt::format("{}", fmt::join(w, ", ")) << "], got ["
         << fmt::format("{}", fmt::join(g, ", ")) << "]";
}

// ---------------------------------------------------------------------------------------------
// The reference: PyTorch's own schedulers, run by tests/python/lr_reference.py.

std::string reference_script() {
  if (const char* src = std::getenv("TORCHPOINT_SOURCE_DIR")) {
    return std::string(src) + "/tests/python/lr_reference.py";
  }
  // Run outside CTest: the script sits next to this file.
  std::string here = __FILE__;
  return here.substr(0, here.rfind('/')) + "/python/lr_reference.py";
}

tp::Json spec_of(const Case& c) {
  tp::Json spec = {{"optimizer", c.optimizer},
                   {"lrs", c.lrs},
                   {"scheduler", c.scheduler},
                   {"kwargs", c.kwargs},
                   {"steps", c.steps}};
  if (!c.metrics.empty()) spec["metrics"] = c.metrics;
  return spec;
}

// Runs lr_reference.py on `spec` (one, or an array of them); its output, or nullopt with the
// reason in `error`.
std::optional<std::string> run_reference(const tp::Json& spec, std::string& error) {
  // JSON numbers print exactly, and the JSON text holds no single quote.
  std::string command =
      fmt::format("{} '{}' '{}' 2>&1", tp::testing::python(), reference_script(), spec.dump());
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) {
    error = "popen failed for: " + command;
    return std::nullopt;
  }
  std::string output;
  char buffer[4096];
  while (std::size_t n = std::fread(buffer, 1, sizeof buffer, pipe)) output.append(buffer, n);
  const int status = pclose(pipe);
  const int rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  if (rc == 3 || rc == 126 || rc == 127) {
    error = fmt::format(
        "{} cannot run PyTorch, which these tests compare against: make the project venv "
        "(scripts/venv.sh) or set TORCHPOINT_PYTHON.\nOutput:\n{}",
        tp::testing::python(), output);
    return std::nullopt;
  }
  if (rc != 0) {
    error = fmt::format("{} failed with status {}:\n{}", command, rc, output);
    return std::nullopt;
  }
  return output;
}

// The samples in the script's output, by the "case" each line names ("" for a single spec).
std::optional<std::map<std::string, std::vector<Sample>>> parse_reference(
    const std::string& output, std::string& error) {
  std::map<std::string, std::vector<Sample>> samples;
  std::istringstream lines(output);
  for (std::string line; std::getline(lines, line);) {
    tp::Json j = tp::Json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.contains("lr")) {
      error = "unexpected output of lr_reference.py:\n" + output;
      return std::nullopt;
    }
    Sample s;
    for (const auto& v : j["lr"])
      s.lr.push_back(std::strtod(v.get<std::string>().c_str(), nullptr));
    if (j.contains("momentum")) {
      for (const auto& v : j["momentum"]) {
        s.momentum.push_back(std::strtod(v.get<std::string>().c_str(), nullptr));
      }
    }
    samples[j.value("case", std::string())].push_back(std::move(s));
  }
  return samples;
}

// Where the CTest fixture `scheduler_references` leaves every case's reference: next to this
// test's executable. It writes the case's spec with its lines, so a file from other cases is
// never taken.
std::string references_path() {
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  return self.substr(0, self.rfind('/')) + "/lr_references.json";
}

// PyTorch's learning rates for `c`: from the fixture's file when it holds this very spec (CTest
// runs each case in a process of its own, and each Python process spends seconds importing
// torch), else from a Python run of its own. On failure returns nullopt and says why in `error`.
std::optional<std::vector<Sample>> pytorch_reference(const Case& c, std::string& error) {
  const tp::Json spec = spec_of(c);
  std::ifstream file(references_path());
  if (file) {
    tp::Json all = tp::Json::parse(file, nullptr, /*allow_exceptions=*/false);
    if (all.is_object() && all.contains(c.name) && all[c.name].value("spec", tp::Json()) == spec) {
      auto samples = parse_reference(all[c.name].value("output", std::string()), error);
      if (!samples) return std::nullopt;
      return (*samples)[c.name];
    }
  }
  std::optional<std::string> output = run_reference(spec, error);
  if (!output) return std::nullopt;
  auto samples = parse_reference(*output, error);
  if (!samples) return std::nullopt;
  return (*samples)[""];
}

// ---------------------------------------------------------------------------------------------
// The configurations: every scheduler, with its defaults and with every option changed.

template <typename Scheduler, typename Options>
std::function<std::unique_ptr<tp::LRScheduler>(optim::Optimizer&)> build(Options options) {
  return [options](optim::Optimizer& o) { return std::make_unique<Scheduler>(o, options); };
}

// Falls with plateaus, including a change just below the relative threshold (0.7 -> 0.69999).
std::vector<double> falling_metrics() {
  return {1.0, 0.9, 0.8, 0.8, 0.8, 0.8, 0.75, 0.75, 0.75, 0.75, 0.7, 0.69999, 0.7, 0.7,
          0.7, 0.6, 0.6, 0.6, 0.6, 0.6, 0.6,  0.6,  0.5,  0.5,  0.5, 0.5,     0.5, 0.5,
          0.5, 0.5, 0.4, 0.4, 0.4, 0.4, 0.4,  0.4,  0.4,  0.4,  0.4, 0.4};
}

// Rises by 0.1 every 6 epochs and by 0.01 (below an absolute threshold of 0.05) in between.
std::vector<double> rising_metrics() {
  std::vector<double> m;
  for (int i = 0; i < 40; ++i) m.push_back(0.1 * (i / 6) + 0.01 * (i % 6));
  return m;
}

std::vector<Case> cases() {
  using tp::Json;
  std::vector<Case> c;
  c.push_back({"StepLR_Defaults",
               "SGD",
               {0.1, 0.05},
               "StepLR",
               Json{{"step_size", 3}},
               build<tp::StepLR>(tp::StepLROptions(3))});
  c.push_back({"StepLR_Gamma",
               "Adam",
               {0.001},
               "StepLR",
               Json{{"step_size", 7}, {"gamma", 0.7}},
               build<tp::StepLR>(tp::StepLROptions(7).gamma(0.7))});
  c.push_back({"MultiStepLR_Defaults",
               "SGD",
               {0.1, 0.05},
               "MultiStepLR",
               Json{{"milestones", {3, 10, 25}}},
               build<tp::MultiStepLR>(tp::MultiStepLROptions({3, 10, 25}))});
  c.push_back({"MultiStepLR_RepeatedMilestone",
               "AdamW",
               {0.01, 0.002},
               "MultiStepLR",
               Json{{"milestones", {12, 5, 12, 30, 12}}, {"gamma", 0.3}},
               build<tp::MultiStepLR>(tp::MultiStepLROptions({12, 5, 12, 30, 12}).gamma(0.3))});
  c.push_back({"ExponentialLR",
               "Adam",
               {0.01, 0.003},
               "ExponentialLR",
               Json{{"gamma", 0.93}},
               build<tp::ExponentialLR>(tp::ExponentialLROptions(0.93))});
  c.push_back({"CosineAnnealingLR_Defaults",
               "AdamW",
               {0.001},
               "CosineAnnealingLR",
               Json{{"T_max", 7}},
               build<tp::CosineAnnealingLR>(tp::CosineAnnealingLROptions(7)),
               35});
  c.push_back({"CosineAnnealingLR_EtaMin",
               "SGD",
               {0.1, 0.05},
               "CosineAnnealingLR",
               Json{{"T_max", 10}, {"eta_min", 0.001}},
               build<tp::CosineAnnealingLR>(tp::CosineAnnealingLROptions(10).eta_min(0.001)),
               45});
  c.push_back({"LinearLR_Defaults",
               "SGD",
               {0.1, 0.05},
               "LinearLR",
               Json::object(),
               build<tp::LinearLR>(tp::LinearLROptions()),
               30});
  c.push_back({"LinearLR_Options",
               "RMSprop",
               {0.01},
               "LinearLR",
               Json{{"start_factor", 0.25}, {"end_factor", 0.75}, {"total_iters", 17}},
               build<tp::LinearLR>(
                   tp::LinearLROptions().start_factor(0.25).end_factor(0.75).total_iters(17)),
               30});
  // OneCycleLR may be stepped total_steps times.
  c.push_back({"OneCycleLR_Defaults",
               "SGD",
               {0.1, 0.05},
               "OneCycleLR",
               Json{{"max_lr", 0.5}, {"total_steps", 40}},
               build<tp::OneCycleLR>(tp::OneCycleLROptions(0.5, 40)),
               40});
  c.push_back({"OneCycleLR_ThreePhaseLinear",
               "Adam",
               {0.01, 0.02},
               "OneCycleLR",
               Json{{"max_lr", {0.01, 0.02}},
                    {"total_steps", 35},
                    {"pct_start", 0.25},
                    {"anneal_strategy", "linear"},
                    {"base_momentum", 0.8},
                    {"max_momentum", {0.9, 0.92}},
                    {"div_factor", 10.0},
                    {"final_div_factor", 100.0},
                    {"three_phase", true}},
               build<tp::OneCycleLR>(tp::OneCycleLROptions({0.01, 0.02}, 35)
                                         .pct_start(0.25)
                                         .anneal_strategy(tp::AnnealStrategy::kLinear)
                                         .base_momentum(0.8)
                                         .max_momentum({0.9, 0.92})
                                         .div_factor(10.0)
                                         .final_div_factor(100.0)
                                         .three_phase(true)),
               35});
  c.push_back({"OneCycleLR_RMSprop",
               "RMSprop",
               {0.01},
               "OneCycleLR",
               Json{{"max_lr", 0.05}, {"total_steps", 31}, {"pct_start", 0.4}},
               build<tp::OneCycleLR>(tp::OneCycleLROptions(0.05, 31).pct_start(0.4)),
               31});
  c.push_back({"OneCycleLR_NoMomentum",
               "Adagrad",
               {0.1, 0.2},
               "OneCycleLR",
               Json{{"max_lr", 0.3}, {"total_steps", 32}, {"cycle_momentum", false}},
               build<tp::OneCycleLR>(tp::OneCycleLROptions(0.3, 32).cycle_momentum(false)),
               32});
  c.push_back({"ReduceLROnPlateau_Defaults",
               "SGD",
               {0.1, 0.05},
               "ReduceLROnPlateau",
               Json::object(),
               build<tp::ReduceLROnPlateau>(tp::ReduceLROnPlateauOptions()),
               40,
               std::vector<double>(40, 1.0)});
  c.push_back({"ReduceLROnPlateau_MinRel",
               "Adam",
               {0.01, 0.001},
               "ReduceLROnPlateau",
               Json{{"patience", 2}, {"cooldown", 1}, {"min_lr", {1e-4, 2e-5}}},
               build<tp::ReduceLROnPlateau>(
                   tp::ReduceLROnPlateauOptions().patience(2).cooldown(1).min_lr({1e-4, 2e-5})),
               40,
               falling_metrics()});
  c.push_back({"ReduceLROnPlateau_MaxAbs",
               "SGD",
               {0.1, 0.0015},
               "ReduceLROnPlateau",
               Json{{"mode", "max"},
                    {"factor", 0.5},
                    {"patience", 3},
                    {"threshold", 0.05},
                    {"threshold_mode", "abs"},
                    {"cooldown", 2},
                    {"min_lr", 0.01},
                    {"eps", 1e-3}},
               build<tp::ReduceLROnPlateau>(tp::ReduceLROnPlateauOptions()
                                                .mode(tp::PlateauMode::kMax)
                                                .factor(0.5)
                                                .patience(3)
                                                .threshold(0.05)
                                                .threshold_mode(tp::ThresholdMode::kAbs)
                                                .cooldown(2)
                                                .min_lr(0.01)
                                                .eps(1e-3)),
               40,
               rising_metrics()});
  return c;
}

class SchedulerCase : public ::testing::TestWithParam<Case> {};

// (1) Every learning rate (and momentum) over the whole run equals PyTorch's, bit for bit.
TEST_P(SchedulerCase, MatchesPyTorch) {
  const Case& c = GetParam();
  std::string error;
  std::optional<std::vector<Sample>> reference = pytorch_reference(c, error);
  ASSERT_TRUE(reference.has_value()) << error;
  ASSERT_EQ(reference->size(), static_cast<std::size_t>(c.steps) + 1);
  ASSERT_GE(c.steps, 30);

  Job run(c);
  for (int t = 0; t <= c.steps; ++t) {
    if (t > 0) run.advance(c, t - 1);
    const Sample want = (*reference)[static_cast<std::size_t>(t)];
    const Sample got = run.sample();
    EXPECT_TRUE(same_bits(want.lr, got.lr)) << "lr after " << t << " steps";
    EXPECT_TRUE(same_bits(want.lr, run.scheduler->get_last_lr()))
        << "get_last_lr after " << t << " steps";
    EXPECT_TRUE(same_bits(want.momentum, got.momentum)) << "momentum after " << t << " steps";
    EXPECT_EQ(run.scheduler->last_epoch(), t);
  }
}

// (2) Saved after k steps through a container file and restored into a new optimizer and
// scheduler, the run continues exactly as the uninterrupted one, for every k.
TEST_P(SchedulerCase, ResumesExactly) {
  const Case& c = GetParam();
  Job straight(c);
  std::vector<Sample> want = {straight.sample()};
  for (int i = 0; i < c.steps; ++i) {
    straight.advance(c, i);
    want.push_back(straight.sample());
  }

  tp::testing::TempDir dir;
  const std::string path = dir / "scheduler.safetensors";
  bool saw_bad_epochs = false, saw_cooldown = false, saw_infinite_best = false;
  for (int k = 0; k < c.steps; ++k) {
    SCOPED_TRACE(fmt::format("saved after {} steps", k));
    Job first(c);
    for (int i = 0; i < k; ++i) first.advance(c, i);
    tp::save_file(path, first.scheduler->state_dict().to_container());
    const tp::StateDict saved = tp::StateDict::from_container(tp::load_file(path));

    Job second(c);
    // What the optimizer's own state restores.
    auto& from = first.optimizer->param_groups();
    auto& to = second.optimizer->param_groups();
    for (std::size_t g = 0; g < from.size(); ++g) {
      to[g].options().set_lr(from[g].options().get_lr());
      if (double* m = momentum_of(from[g].options())) *momentum_of(to[g].options()) = *m;
    }
    second.scheduler->load_state_dict(saved);

    EXPECT_EQ(second.scheduler->last_epoch(), first.scheduler->last_epoch());
    EXPECT_EQ(second.scheduler->step_count(), first.scheduler->step_count());
    EXPECT_TRUE(same_bits(first.scheduler->base_lrs(), second.scheduler->base_lrs()));
    EXPECT_TRUE(same_bits(first.scheduler->get_last_lr(), second.scheduler->get_last_lr()));
    if (auto* p1 = dynamic_cast<tp::ReduceLROnPlateau*>(first.scheduler.get())) {
      auto* p2 = dynamic_cast<tp::ReduceLROnPlateau*>(second.scheduler.get());
      EXPECT_TRUE(same_bits({p1->best()}, {p2->best()}));
      EXPECT_EQ(p1->num_bad_epochs(), p2->num_bad_epochs());
      EXPECT_EQ(p1->cooldown_counter(), p2->cooldown_counter());
      saw_bad_epochs |= p1->num_bad_epochs() > 0;
      saw_cooldown |= p1->cooldown_counter() > 0;
      saw_infinite_best |= std::isinf(p1->best());
    }
    for (int i = k; i < c.steps; ++i) {
      second.advance(c, i);
      const Sample got = second.sample();
      const Sample& expected = want[static_cast<std::size_t>(i) + 1];
      ASSERT_TRUE(same_bits(expected.lr, got.lr)) << "lr after " << i + 1 << " steps";
      ASSERT_TRUE(same_bits(expected.lr, second.scheduler->get_last_lr()));
      ASSERT_TRUE(same_bits(expected.momentum, got.momentum)) << "momentum after " << i + 1;
    }
  }
  if (auto* p = dynamic_cast<tp::ReduceLROnPlateau*>(straight.scheduler.get())) {
    // The resumes above covered the interesting states of the plateau counters.
    EXPECT_TRUE(saw_bad_epochs);
    EXPECT_TRUE(saw_infinite_best);
    EXPECT_EQ(saw_cooldown, p->options().cooldown() > 0);
  }
}

INSTANTIATE_TEST_SUITE_P(All, SchedulerCase, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.name;
                         });

// The CTest fixture `scheduler_references` (disabled in the suite itself): PyTorch's learning
// rates for every case from one Python process, written next to this executable for the
// MatchesPyTorch cases, which CTest runs one process each. One run instead of one per case
// saves about 3 s of CPU a case (importing torch).
TEST(References, DISABLED_WriteAll) {
  const std::string path = references_path();
  std::filesystem::remove(path);
  tp::Json specs = tp::Json::array();
  for (const Case& c : cases()) {
    specs.push_back(spec_of(c));
    specs.back()["case"] = c.name;
  }
  std::string error;
  std::optional<std::string> output = run_reference(specs, error);
  ASSERT_TRUE(output.has_value()) << error;
  std::map<std::string, std::string> lines_of;
  std::istringstream lines(*output);
  for (std::string line; std::getline(lines, line);) {
    tp::Json j = tp::Json::parse(line, nullptr, /*allow_exceptions=*/false);
    ASSERT_TRUE(!j.is_discarded() && j.contains("case")) << "unexpected line: " << line;
    lines_of[j["case"].get<std::string>()] += line + "\n";
  }
  tp::Json all = tp::Json::object();
  for (const Case& c : cases()) {
    ASSERT_TRUE(lines_of.count(c.name)) << "no reference for " << c.name << ":\n" << *output;
    auto samples = parse_reference(lines_of[c.name], error);
    ASSERT_TRUE(samples.has_value()) << error;
    EXPECT_EQ((*samples)[c.name].size(), static_cast<std::size_t>(c.steps) + 1) << c.name;
    all[c.name] = {{"spec", spec_of(c)}, {"output", lines_of[c.name]}};
  }
  const std::string temporary = path + ".tmp";
  std::ofstream(temporary) << all.dump();
  std::filesystem::rename(temporary, path);
}

// ---------------------------------------------------------------------------------------------
// (3) Errors.

// Runs `f`, which must throw a torchpoint::Error with `code`; returns its message.
template <typename F>
std::string error_of(F&& f, tp::ErrorCode code) {
  try {
    f();
  } catch (const tp::Error& e) {
    EXPECT_EQ(e.code(), code) << tp::error_code_name(e.code()) << ": " << e.what();
    return e.what();
  }
  ADD_FAILURE() << "no torchpoint::Error thrown";
  return "";
}

TEST(LRSchedulerTest, LoadRejectsAnotherSchedulerType) {
  torch::nn::Linear model(3, 2);
  auto sgd = make_optimizer("SGD", model, {0.1, 0.05});
  tp::StepLR step_lr(*sgd, tp::StepLROptions(2));
  step_lr.step();
  const tp::StateDict state = step_lr.state_dict();

  tp::ExponentialLR exponential(*sgd, tp::ExponentialLROptions(0.9));
  exponential.step();
  const std::vector<double> before = exponential.get_last_lr();
  std::string message =
      error_of([&] { exponential.load_state_dict(state); }, tp::ErrorCode::Incompatible);
  EXPECT_NE(message.find("StepLR"), std::string::npos) << message;
  EXPECT_NE(message.find("ExponentialLR"), std::string::npos) << message;
  EXPECT_EQ(exponential.last_epoch(), 1);
  EXPECT_TRUE(same_bits(before, exponential.get_last_lr()));
}

TEST(LRSchedulerTest, LoadRejectsAnotherNumberOfParamGroups) {
  torch::nn::Linear model(3, 2);
  auto two = make_optimizer("SGD", model, {0.1, 0.05});
  auto one = make_optimizer("SGD", model, {0.1});
  tp::CosineAnnealingLR with_two(*two, tp::CosineAnnealingLROptions(5));
  tp::CosineAnnealingLR with_one(*one, tp::CosineAnnealingLROptions(5));

  std::string message = error_of([&] { with_one.load_state_dict(with_two.state_dict()); },
                                 tp::ErrorCode::Incompatible);
  EXPECT_NE(message.find("for 2 param groups"), std::string::npos) << message;
  EXPECT_NE(message.find("this optimizer has 1"), std::string::npos) << message;

  message = error_of([&] { with_two.load_state_dict(with_one.state_dict()); },
                     tp::ErrorCode::Incompatible);
  EXPECT_NE(message.find("for 1 param groups"), std::string::npos) << message;
  EXPECT_NE(message.find("this optimizer has 2"), std::string::npos) << message;
}

TEST(LRSchedulerTest, FailedLoadChangesNothing) {
  torch::nn::Linear model(3, 2);
  auto sgd = make_optimizer("SGD", model, {0.1});
  tp::ReduceLROnPlateau plateau(*sgd, tp::ReduceLROnPlateauOptions().patience(1));
  for (double metric : {1.0, 0.5, 0.5, 0.5}) plateau.step(metric);
  tp::StateDict state = plateau.state_dict();

  tp::ReduceLROnPlateau other(*sgd, tp::ReduceLROnPlateauOptions().patience(7));
  other.step(3.0);
  state.set("mode", "median");  // read after the base fields, which must not be taken in
  std::string message =
      error_of([&] { other.load_state_dict(state); }, tp::ErrorCode::Incompatible);
  EXPECT_NE(message.find("mode"), std::string::npos) << message;
  EXPECT_NE(message.find("median"), std::string::npos) << message;
  EXPECT_EQ(other.options().patience(), 7);
  EXPECT_EQ(other.best(), 3.0);
  EXPECT_EQ(other.last_epoch(), 1);
  EXPECT_EQ(other.step_count(), 1);

  state.erase("num_bad_epochs");
  state.set("mode", "min");
  message = error_of([&] { other.load_state_dict(state); }, tp::ErrorCode::NotFound);
  EXPECT_NE(message.find("num_bad_epochs"), std::string::npos) << message;
  EXPECT_EQ(other.options().patience(), 7);
}

// As in PyTorch, the saved options replace the constructor's.
TEST(LRSchedulerTest, LoadRestoresTheSavedOptions) {
  torch::nn::Linear model(3, 2);
  auto sgd = make_optimizer("SGD", model, {0.1});
  tp::StepLR saved(*sgd, tp::StepLROptions(3).gamma(0.5));
  tp::StepLR restored(*sgd, tp::StepLROptions(5));
  restored.load_state_dict(saved.state_dict());
  EXPECT_EQ(restored.options().step_size(), 3);
  EXPECT_EQ(restored.options().gamma(), 0.5);
}

// As in PyTorch, the optimizer's lr is the optimizer state's business.
TEST(LRSchedulerTest, LoadDoesNotTouchTheOptimizer) {
  torch::nn::Linear model(3, 2);
  auto sgd = make_optimizer("SGD", model, {0.1});
  tp::ExponentialLR first(*sgd, tp::ExponentialLROptions(0.5));
  for (int i = 0; i < 3; ++i) first.step();
  const tp::StateDict state = first.state_dict();

  auto fresh = make_optimizer("SGD", model, {0.1});
  tp::ExponentialLR second(*fresh, tp::ExponentialLROptions(0.5));
  second.load_state_dict(state);
  EXPECT_EQ(fresh->param_groups()[0].options().get_lr(), 0.1);
  EXPECT_EQ(second.get_last_lr(), std::vector<double>{0.0125});
}

// Non-finite learning rates cannot be JSON numbers; they survive a file as float64 tensors.
TEST(LRSchedulerTest, NonFiniteValuesSurviveAFile) {
  torch::nn::Linear model(3, 2);
  const double inf = std::numeric_limits<double>::infinity();
  auto sgd = make_optimizer("SGD", model, {inf, 0.1});
  tp::ExponentialLR first(*sgd, tp::ExponentialLROptions(0.5));
  first.step();
  const tp::StateDict state = first.state_dict();
  EXPECT_TRUE(state.is_tensor("base_lrs"));
  EXPECT_FALSE(state.is_tensor("gamma"));

  tp::testing::TempDir dir;
  tp::save_file(dir / "s.safetensors", state.to_container());
  tp::ExponentialLR second(*sgd, tp::ExponentialLROptions(0.5));
  second.load_state_dict(tp::StateDict::from_container(tp::load_file(dir / "s.safetensors")));
  EXPECT_TRUE(same_bits({inf, 0.1}, second.base_lrs()));
  EXPECT_TRUE(same_bits({inf, 0.05}, second.get_last_lr()));

  tp::ReduceLROnPlateau plateau(*sgd, tp::ReduceLROnPlateauOptions().mode(tp::PlateauMode::kMax));
  EXPECT_EQ(plateau.best(), -inf);
  EXPECT_TRUE(plateau.state_dict().is_tensor("best"));
}

TEST(LRSchedulerTest, ReduceLROnPlateauNeedsTheMetric) {
  torch::nn::Linear model(3, 2);
  auto sgd = make_optimizer("SGD", model, {0.1});
  tp::ReduceLROnPlateau plateau(*sgd);
  tp::LRScheduler& scheduler = plateau;
  std::string message = error_of([&] { scheduler.step(); }, tp::ErrorCode::InvalidArgument);
  EXPECT_NE(message.find("step(metric)"), std::string::npos) << message;
  EXPECT_EQ(plateau.last_epoch(), 0);
  EXPECT_EQ(plateau.get_last_lr(), std::vector<double>{0.1});
}

TEST(LRSchedulerTest, OneCycleLRNeedsMomentumToCycleIt) {
  torch::nn::Linear model(3, 2);
  auto adagrad = make_optimizer("Adagrad", model, {0.1});
  std::string message = error_of([&] { tp::OneCycleLR(*adagrad, tp::OneCycleLROptions(0.1, 10)); },
                                 tp::ErrorCode::InvalidArgument);
  EXPECT_NE(message.find("cycle_momentum(false)"), std::string::npos) << message;
  EXPECT_EQ(adagrad->param_groups()[0].options().get_lr(), 0.1);  // untouched
  tp::OneCycleLR ok(*adagrad, tp::OneCycleLROptions(0.1, 10).cycle_momentum(false));
  EXPECT_DOUBLE_EQ(adagrad->param_groups()[0].options().get_lr(), 0.1 / 25);
}

// PyTorch raises on the (total_steps + 1)-th step; here nothing changes when it throws.
TEST(LRSchedulerTest, OneCycleLRStopsAfterTotalSteps) {
  torch::nn::Linear model(3, 2);
  auto sgd = make_optimizer("SGD", model, {0.1});
  tp::OneCycleLR scheduler(*sgd, tp::OneCycleLROptions(0.1, 5));
  for (int i = 0; i < 5; ++i) scheduler.step();
  const std::vector<double> last = scheduler.get_last_lr();
  std::string message = error_of([&] { scheduler.step(); }, tp::ErrorCode::InvalidArgument);
  EXPECT_NE(message.find("step() called 6 times, more than total_steps (5)"), std::string::npos)
      << message;
  EXPECT_EQ(scheduler.last_epoch(), 5);
  EXPECT_TRUE(same_bits(last, scheduler.get_last_lr()));
  EXPECT_TRUE(same_bits(last, {sgd->param_groups()[0].options().get_lr()}));
}

TEST(LRSchedulerTest, BadOptionsAreInvalidArguments) {
  torch::nn::Linear model(3, 2);
  auto sgd = make_optimizer("SGD", model, {0.1, 0.05});
  auto& o = *sgd;
  using tp::ErrorCode;
  EXPECT_NE(error_of([&] { tp::StepLR(o, 0); }, ErrorCode::InvalidArgument).find("step_size is 0"),
            std::string::npos);
  EXPECT_NE(
      error_of([&] { tp::CosineAnnealingLR(o, 0); }, ErrorCode::InvalidArgument).find("T_max is 0"),
      std::string::npos);
  EXPECT_NE(error_of([&] { tp::LinearLR(o, tp::LinearLROptions().start_factor(0)); },
                     ErrorCode::InvalidArgument)
                .find("start_factor"),
            std::string::npos);
  EXPECT_NE(error_of([&] { tp::LinearLR(o, tp::LinearLROptions().end_factor(1.5)); },
                     ErrorCode::InvalidArgument)
                .find("end_factor"),
            std::string::npos);
  EXPECT_NE(error_of([&] { tp::ReduceLROnPlateau(o, tp::ReduceLROnPlateauOptions().factor(1.0)); },
                     ErrorCode::InvalidArgument)
                .find("factor is 1"),
            std::string::npos);
  EXPECT_NE(error_of(
                [&] {
                  tp::ReduceLROnPlateau(o, tp::ReduceLROnPlateauOptions().min_lr({0, 0, 0}));
                },
                ErrorCode::InvalidArgument)
                .find("min_lr has 3 values, but the optimizer has 2 param groups"),
            std::string::npos);
  EXPECT_NE(error_of(
                [&] {
                  tp::OneCycleLR(o, tp::OneCycleLROptions({0.1, 0.2, 0.3}, 10));
                },
                ErrorCode::InvalidArgument)
                .find("max_lr has 3 values"),
            std::string::npos);
  EXPECT_NE(error_of([&] { tp::OneCycleLR(o, tp::OneCycleLROptions(0.1, 0)); },
                     ErrorCode::InvalidArgument)
                .find("total_steps is 0"),
            std::string::npos);
  EXPECT_NE(error_of([&] { tp::OneCycleLR(o, tp::OneCycleLROptions(0.1, 10).pct_start(1.5)); },
                     ErrorCode::InvalidArgument)
                .find("pct_start"),
            std::string::npos);
  // pct_start * total_steps == 1 makes the first phase empty: PyTorch divides by zero.
  EXPECT_NE(error_of([&] { tp::OneCycleLR(o, tp::OneCycleLROptions(0.1, 10).pct_start(0.1)); },
                     ErrorCode::InvalidArgument)
                .find("phase 1 of the cycle has no steps"),
            std::string::npos);
  EXPECT_EQ(o.param_groups()[0].options().get_lr(), 0.1);  // no failed constructor changed it
}

}  // namespace
