// The C++ side of tests/python/accelerate_interop_check.py: the seed's Accelerate example (a
// small model, AdamW or SGD, a StepLR, a registered object, automatic naming) in C++, trained on
// batches written by the Python script, against checkpoints of the real Python Accelerate.
//
//   accelerate_interop_child continue DIR BATCHES FROM STEPS OUT
//       load_state(DIR) (a Python Accelerate checkpoint), then train STEPS steps on batches
//       FROM, FROM+1, ...; OUT gets the state right after the load (start.*), the parameters,
//       learning rates and random numbers after the steps (end.*), and the load report.
//   accelerate_interop_child train PROJECT BATCHES STEPS MORE OUT EXPORT
//       a fresh run: STEPS steps, save_state() under PROJECT, export_accelerate_checkpoint of
//       that checkpoint to EXPORT, then MORE steps; OUT as above (start.* at the save).
//   accelerate_interop_child relay SCHEDULER DIR BATCHES FROM STEPS PROJECT EXPORT OUT
//       the middle of tests/python/accelerate_scheduler_check.py's relay: SGD with two param
//       groups and the scheduler SCHEDULER built with other options than the Python run's (the
//       loaded state must carry them all), load_state(DIR), STEPS steps on batches FROM, ...,
//       save_state(PROJECT) and export it to EXPORT (not for LibTorch's StepLR, whose
//       options are private). OUT: the parameters after the load (start.*) and after the
//       steps (end.*), each step's learning rates and momenta (lrs, momenta [STEPS, 2]) and
//       losses; OUT.json: the export's error, if any.
#include <fmt/format.h>
#include <torch/torch.h>

#include <torch/optim/schedulers/step_lr.h>

#include <cstdio>
#include <cstdlib>
#include <memory>
#include <fstream>
#include <string>

#include "torchpoint/accelerate_interop.h"
#include "torchpoint/accelerator.h"
#include "torchpoint/error.h"
#include "torchpoint/interop.h"
#include "torchpoint/optimizer_state.h"
#include "torchpoint/tensor_file.h"

namespace tp = torchpoint;

namespace {

// The registered object of the Python run: the same keys and kinds of values.
struct Counter {
  std::int64_t n = 0;
  std::string name = "start";
  at::Tensor t = torch::zeros({3}, torch::kLong);
  std::vector<double> l{0.0};
  tp::StateDict state_dict() const {
    tp::StateDict s;
    s.set("n", n);
    s.set("name", name);
    s.set("t", t);
    s.set("l", tp::Json(l));
    return s;
  }
  void load_state_dict(const tp::StateDict& s) {
    n = s.get<std::int64_t>("n");
    name = s.get<std::string>("name");
    t = s.tensor("t").clone();
    l = s.get<std::vector<double>>("l");
  }
};

// The optimizer of the Python run: INTEROP_OPTIMIZER=sgd for SGD with momentum, else AdamW.
std::shared_ptr<torch::optim::Optimizer> make_optimizer(const torch::nn::Sequential& model) {
  const char* which = std::getenv("INTEROP_OPTIMIZER");
  if (which != nullptr && std::string(which) == "sgd") {
    return std::make_shared<torch::optim::SGD>(model->parameters(),
                                               torch::optim::SGDOptions(0.05).momentum(0.9));
  }
  return std::make_shared<torch::optim::AdamW>(model->parameters(),
                                               torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
}

struct Run {
  torch::nn::Sequential model{torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2)};
  std::shared_ptr<torch::optim::Optimizer> optimizer_ptr = make_optimizer(model);
  torch::optim::Optimizer& optimizer = *optimizer_ptr;
  tp::StepLR scheduler{optimizer, tp::StepLROptions(2).gamma(0.5)};
  Counter counter;
};

// Parameters and the optimizer's moments now, under `prefix`.
void record(Run& run, const std::string& prefix, tp::StateDict& out) {
  for (const auto& p : run.model->named_parameters()) {
    out.set(prefix + p.key(), p.value().detach().clone());
  }
  tp::StateDict opt = tp::optimizer_state_dict(run.optimizer);
  for (const auto& [key, value] : opt.entries()) {
    if (const at::Tensor* t = std::get_if<at::Tensor>(&value)) {
      out.set(prefix + "optimizer." + key, t->clone());
    } else if (key.ends_with(".step")) {
      out.set(prefix + "optimizer." + key,
              torch::tensor({std::get<tp::Json>(value).get<std::int64_t>()}, torch::kLong));
    }
  }
  out.set(prefix + "lr", torch::tensor({run.optimizer.param_groups()[0].options().get_lr()},
                                       torch::kDouble));
  out.set(prefix + "counter.t", run.counter.t.clone());
  out.set(prefix + "counter.n", torch::tensor({run.counter.n}, torch::kLong));
}

void train(tp::Accelerator& acc, Run& run, const tp::StateDict& batches, int from, int steps,
           std::vector<double>& lrs) {
  for (int k = 0; k < steps; ++k) {
    const at::Tensor& x = batches.tensor(fmt::format("x{}", from + k));
    const at::Tensor& y = batches.tensor(fmt::format("y{}", from + k));
    at::Tensor loss = torch::mse_loss(run.model->forward(x), y);
    acc.backward(loss);
    run.optimizer.step();
    run.scheduler.step();
    run.optimizer.zero_grad();
    run.counter.n += 1;
    lrs.push_back(run.scheduler.get_last_lr()[0]);
  }
}

void finish(Run& run, tp::StateDict& out, const std::vector<double>& lrs) {
  record(run, "end.", out);
  out.set("end.lrs", torch::tensor(lrs, torch::kDouble));
  // The next numbers of torch's CPU generator.
  out.set("end.rand", torch::rand({16}, torch::kDouble));
}

int run_continue(const std::string& dir, const std::string& batches_path, int from, int steps,
                 const std::string& out_path) {
  tp::Accelerator acc;
  Run run;
  acc.prepare(run.model, run.optimizer, run.scheduler);
  acc.register_for_checkpointing(run.counter);
  tp::LoadStateReport report = acc.load_state(dir);
  tp::StateDict out;
  record(run, "start.", out);
  out.set("start.step", torch::tensor({report.step}, torch::kLong));
  tp::StateDict batches = tp::StateDict::from_container(tp::load_safetensors(batches_path).contents);
  std::vector<double> lrs;
  train(acc, run, batches, from, steps, lrs);
  finish(run, out, lrs);
  tp::save_file(out_path, out.to_container());
  tp::Json json = {{"components", report.components},
                   {"not_applicable", report.not_applicable},
                   {"notes", report.notes},
                   {"step", report.step},
                   {"counter_name", run.counter.name},
                   {"counter_l", run.counter.l}};
  std::ofstream(out_path + ".json") << json.dump(2);
  return 0;
}

int run_train(const std::string& project, const std::string& batches_path, int steps, int more,
              const std::string& out_path, const std::string& export_dir) {
  torch::manual_seed(0);
  tp::Accelerator acc(
      tp::ProjectConfiguration().project_dir(project).automatic_checkpoint_naming(true));
  Run run;
  acc.prepare(run.model, run.optimizer, run.scheduler);
  acc.register_for_checkpointing(run.counter);
  run.counter.name = "from C++";
  run.counter.t = torch::tensor({7, 8, 9}, torch::kLong);
  run.counter.l = {1.0, 2.5};
  tp::StateDict batches = tp::StateDict::from_container(tp::load_safetensors(batches_path).contents);
  std::vector<double> lrs;
  train(acc, run, batches, 0, steps, lrs);
  const std::string saved = acc.save_state();
  const std::int64_t saved_step = acc.step();
  tp::AccelerateExport exported = tp::export_accelerate_checkpoint(saved, export_dir);
  tp::StateDict out;
  record(run, "start.", out);
  out.set("start.step", torch::tensor({saved_step}, torch::kLong));
  lrs.clear();
  train(acc, run, batches, steps, more, lrs);
  finish(run, out, lrs);
  tp::save_file(out_path, out.to_container());
  tp::Json json = {{"files", exported.files}, {"notes", exported.notes}, {"step", saved_step}};
  std::ofstream(out_path + ".json") << json.dump(2);
  return 0;
}

// --- relay -----------------------------------------------------------------------------------

// The Python run's optimizer: SGD with momentum, weights and biases in two groups.
std::shared_ptr<torch::optim::SGD> two_group_sgd(const torch::nn::Sequential& model) {
  std::vector<at::Tensor> weights, biases;
  for (const auto& p : model->named_parameters()) {
    (p.key().ends_with("weight") ? weights : biases).push_back(p.value());
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(weights);
  groups.emplace_back(biases, std::make_unique<torch::optim::SGDOptions>(
                                  torch::optim::SGDOptions(0.02).momentum(0.9)));
  return std::make_shared<torch::optim::SGD>(groups, torch::optim::SGDOptions(0.05).momentum(0.9));
}

// Each scheduler of the relay, with options that differ from the Python run's in every field
// the state carries (LibTorch's StepLR excepted: its options are not in its state).
std::unique_ptr<tp::LRScheduler> decoy_scheduler(const std::string& name,
                                                 torch::optim::Optimizer& opt) {
  if (name == "StepLR") return std::make_unique<tp::StepLR>(opt, tp::StepLROptions(7).gamma(0.9));
  if (name == "MultiStepLR") {
    return std::make_unique<tp::MultiStepLR>(opt, tp::MultiStepLROptions({1}).gamma(0.9));
  }
  if (name == "ExponentialLR") {
    return std::make_unique<tp::ExponentialLR>(opt, tp::ExponentialLROptions(0.5));
  }
  if (name == "CosineAnnealingLR") {
    return std::make_unique<tp::CosineAnnealingLR>(opt, tp::CosineAnnealingLROptions(9));
  }
  if (name == "LinearLR") return std::make_unique<tp::LinearLR>(opt);
  if (name.starts_with("OneCycleLR")) {
    return std::make_unique<tp::OneCycleLR>(opt, tp::OneCycleLROptions(1.0, 100));
  }
  if (name.starts_with("ReduceLROnPlateau")) return std::make_unique<tp::ReduceLROnPlateau>(opt);
  throw tp::Error(tp::ErrorCode::InvalidArgument, "relay: unknown scheduler " + name);
}

int run_relay(const std::string& name, const std::string& dir, const std::string& batches_path,
              int from, int steps, const std::string& project, const std::string& export_dir,
              const std::string& out_path) {
  torch::nn::Sequential model{torch::nn::Linear(4, 8), torch::nn::ReLU(), torch::nn::Linear(8, 2)};
  auto sgd = two_group_sgd(model);
  tp::Accelerator acc;
  std::unique_ptr<tp::LRScheduler> ours;
  std::unique_ptr<torch::optim::StepLR> libtorch;
  if (name == "libtorch_StepLR") {
    libtorch = std::make_unique<torch::optim::StepLR>(*sgd, 3, 0.5);
    acc.prepare(model, sgd, *libtorch);
  } else {
    ours = decoy_scheduler(name, *sgd);
    acc.prepare(model, sgd, *ours);
  }
  acc.load_state(dir);
  tp::StateDict out;
  for (const auto& p : model->named_parameters()) {
    out.set("start." + p.key(), p.value().detach().clone());
  }
  tp::StateDict batches =
      tp::StateDict::from_container(tp::load_safetensors(batches_path).contents);
  at::Tensor lrs = torch::zeros({steps, 2}, torch::kDouble);
  at::Tensor momenta = torch::zeros({steps, 2}, torch::kDouble);
  at::Tensor losses = torch::zeros({steps}, torch::kDouble);
  for (int k = 0; k < steps; ++k) {
    at::Tensor loss = torch::mse_loss(model->forward(batches.tensor(fmt::format("x{}", from + k))),
                                      batches.tensor(fmt::format("y{}", from + k)));
    acc.backward(loss);
    sgd->step();
    const double value = loss.item<double>();
    if (libtorch) {
      libtorch->step();
    } else if (auto* plateau = dynamic_cast<tp::ReduceLROnPlateau*>(ours.get())) {
      plateau->step(value);
    } else {
      ours->step();
    }
    sgd->zero_grad();
    losses[k] = value;
    for (int g = 0; g < 2; ++g) {
      auto& options = static_cast<torch::optim::SGDOptions&>(sgd->param_groups()[g].options());
      lrs[k][g] = options.lr();
      momenta[k][g] = options.momentum();
    }
  }
  for (const auto& p : model->named_parameters()) {
    out.set("end." + p.key(), p.value().detach().clone());
  }
  out.set("lrs", lrs);
  out.set("momenta", momenta);
  out.set("losses", losses);
  tp::Json json = tp::Json::object();
  const std::string saved = acc.save_state(project);
  try {
    tp::export_accelerate_checkpoint(saved, export_dir);
  } catch (const tp::Error& e) {
    json["export_error"] = e.what();
  }
  tp::save_file(out_path, out.to_container());
  std::ofstream(out_path + ".json") << json.dump(2);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "continue" && argc == 7) {
      return run_continue(argv[2], argv[3], std::stoi(argv[4]), std::stoi(argv[5]), argv[6]);
    }
    if (mode == "train" && argc == 8) {
      return run_train(argv[2], argv[3], std::stoi(argv[4]), std::stoi(argv[5]), argv[6], argv[7]);
    }
    if (mode == "relay" && argc == 10) {
      return run_relay(argv[2], argv[3], argv[4], std::stoi(argv[5]), std::stoi(argv[6]), argv[7],
                       argv[8], argv[9]);
    }
    std::fprintf(stderr,
                 "usage: accelerate_interop_child continue DIR BATCHES FROM STEPS OUT\n"
                 "       accelerate_interop_child train PROJECT BATCHES STEPS MORE OUT EXPORT\n"
                 "       accelerate_interop_child relay SCHEDULER DIR BATCHES FROM STEPS PROJECT "
                 "EXPORT OUT\n");
    return 2;
  } catch (const tp::Error& e) {
    std::fprintf(stderr, "accelerate_interop_child: %s\n", e.what());
    return 1;
  }
}
