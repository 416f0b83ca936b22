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
#include <fmt/format.h>
#include <torch/torch.h>

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
    std::fprintf(stderr,
                 "usage: accelerate_interop_child continue DIR BATCHES FROM STEPS OUT\n"
                 "       accelerate_interop_child train PROJECT BATCHES STEPS MORE OUT EXPORT\n");
    return 2;
  } catch (const tp::Error& e) {
    std::fprintf(stderr, "accelerate_interop_child: %s\n", e.what());
    return 1;
  }
}
