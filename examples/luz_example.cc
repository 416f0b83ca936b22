// The model-snapshot guide of R's luz (seed 004), in C++, scenario by scenario:
//   1. auto_resume: an `interrupt` callback fails at epoch 5; rerunning the same fit finishes
//      the training where it stopped, with the records of all 10 epochs (plotted).
//   2. model_checkpoint("checkpoints/") monitoring train_loss: one file per epoch.
//   3. load_checkpoint of the first file into the fitted learner.
//   4. resume_from_checkpoint("checkpoints/"): a new fit starts from the newest one.
//   5. A custom callback whose state_dict()/load_state_dict() keep its state across a resume.
// Each step checks what the guide promises and prints [ok] or [FAILED].
//
// Usage: luz_example WORK_DIR
#include <fmt/format.h>
#include <torch/torch.h>

#include <cstdio>
#include <cstring>
#include <filesystem>

#include "torchpoint/callbacks.h"
#include "torchpoint/learner.h"
#include "torchpoint/module_state.h"
#include "torchpoint/tensor_file.h"

namespace tp = torchpoint;

namespace {

// nn_linear(10, 1) %>% setup(optimizer = optim_sgd, loss = nnf_mse_loss) %>%
// set_opt_hparams(lr = 0.01)
std::unique_ptr<tp::Learner> make_model() {
  auto model = torch::nn::Linear(10, 1);
  return std::make_unique<tp::Learner>(
      model, tp::make_optimizer<torch::optim::SGD>(torch::optim::SGDOptions(0.01)),
      torch::mse_loss);
}

// The guide's `interrupt` callback: an error at the 5th epoch, once.
struct Interrupt : tp::Callback {
  Interrupt() : Callback("interrupt") {}
  bool failed = false;
  void on_epoch_end(tp::Context& ctx) override {
    if (ctx.epoch == 5 && !failed) {
      failed = true;
      throw std::runtime_error("Error on epoch 5");
    }
  }
};

// The guide's weight_grad callback: keeps, per epoch, a copy of the tracked weights before
// each optimizer step; state_dict()/load_state_dict() make that history survive a resume.
struct WeightGrad : tp::Callback {
  explicit WeightGrad(std::vector<std::string> track)
      : Callback("weight_grad"), track_weights(std::move(track)) {}
  std::vector<std::string> track_weights;
  std::map<std::int64_t, std::map<std::string, torch::Tensor>> gradients;
  void on_train_batch_before_step(tp::Context& ctx) override {
    auto params = ctx.model->named_parameters();
    for (const std::string& w : track_weights) {
      gradients[ctx.epoch][w] = params[w].grad().detach().clone();
    }
  }
  tp::StateDict state_dict() const override {
    tp::StateDict s;
    for (const auto& [epoch, tensors] : gradients) {
      for (const auto& [name, t] : tensors) s.set(fmt::format("{}.{}", epoch, name), t);
    }
    return s;
  }
  void load_state_dict(const tp::StateDict& s) override {
    gradients.clear();
    for (const auto& [key, value] : s.entries()) {
      auto dot = key.find('.');
      gradients[std::stoll(key.substr(0, dot))][key.substr(dot + 1)] =
          std::get<torch::Tensor>(value);
    }
  }
};

bool same_bits(const std::vector<double>& a, const std::vector<double>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(double)) == 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: luz_example WORK_DIR\n");
    return 2;
  }
  const std::filesystem::path work = std::filesystem::path(argv[1]) / "luz";
  std::filesystem::remove_all(work);
  std::filesystem::create_directories(work);
  int failures = 0;
  auto check = [&](bool ok, const std::string& what) {
    std::printf("  [%s] %s\n", ok ? "ok" : "FAILED", what.c_str());
    if (!ok) ++failures;
  };

  // set.seed(1); torch_manual_seed(1703); x <- torch_randn(1000, 10); y <- torch_randn(1000, 1)
  torch::manual_seed(1703);
  torch::Tensor x = torch::randn({1000, 10}), y = torch::randn({1000, 1});

  std::printf("1. auto_resume: an interrupt at epoch 5, then the same fit again\n");
  // What an uninterrupted fit gives, to compare with.
  torch::manual_seed(1);
  auto uninterrupted = make_model();
  tp::FitResult expected = uninterrupted->fit({x, y}, tp::FitOptions().verbose(false));

  const std::string state = (work / "state.pt").string();
  const std::string logs = (work / "logs").string();  // for tensorboard --logdir
  auto inter = std::make_shared<Interrupt>();
  torch::manual_seed(1);
  auto model = make_model();
  try {
    model->fit({x, y},
               tp::FitOptions().verbose(false).callbacks(
                   {inter, tp::callbacks::auto_resume(state), tp::callbacks::tfevents(logs)}));
    check(false, "the first fit stops at epoch 5");
  } catch (const tp::CallbackError& e) {
    std::printf("  Error: %s\n", e.what());
    check(e.epoch() == 5, "the first fit stops with the interrupt's error at epoch 5");
  }
  check(std::filesystem::exists(state), "state.pt holds the run after epoch 4");
  // "Relancer la fonction fit() avec le même modèle, les callbacks, etc."
  model = make_model();
  tp::FitResult results =
      model->fit({x, y}, tp::FitOptions().callbacks({inter, tp::callbacks::auto_resume(state),
                                                     tp::callbacks::tfevents(logs)}));
  check(results.resumed_after_epoch == 4 && results.epochs_completed == 10,
        "the rerun resumed after epoch 4 and finished epoch 10");
  check(
      same_bits(results.records.values("train", "loss"), expected.records.values("train", "loss")),
      "its 10 recorded losses are bit-identical to an uninterrupted fit");
  check(torch::equal(model->model().named_parameters()["weight"],
                     uninterrupted->model().named_parameters()["weight"]),
        "and so are its final weights");
  check(!std::filesystem::exists(state), "state.pt is deleted once the fit completes");
  std::printf("%s", results.table().c_str());
  results.plot((work / "auto_resume.png").string());
  results.plot((work / "auto_resume.svg").string());
  std::printf("  plot(results): %s and .svg\n", (work / "auto_resume.png").c_str());
  int event_files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(logs)) {
    event_files += entry.path().filename().string().rfind("events.out.tfevents.", 0) == 0;
  }
  check(event_files == 2, "TensorBoard event files in " + logs + ", one per fit");

  std::printf("\n2. model_checkpoint(path = \"checkpoints/\", monitor = \"train_loss\")\n");
  torch::manual_seed(1703);
  x = torch::randn({1000, 10});
  y = torch::randn({1000, 1});
  const std::string checkpoints = (work / "checkpoints/").string();
  model = make_model();
  results =
      model->fit({x, y}, tp::FitOptions().verbose(false).callbacks(
                             {tp::callbacks::model_checkpoint(checkpoints).monitor("train_loss")}));
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(checkpoints)) {
    files.push_back(entry.path().string());
  }
  std::sort(files.begin(), files.end());
  for (const std::string& f : files) std::printf("  %s\n", f.c_str());
  check(files.size() == 10, "one checkpoint per epoch, named by its train_loss");

  std::printf("\n3. load_checkpoint(results, first checkpoint)\n");
  tp::load_checkpoint(*model, files.front());
  tp::StateDict first = tp::StateDict::from_container(tp::load_file(files.front())).child("model");
  check(torch::equal(model->model().named_parameters()["weight"], first.tensor("weight")),
        "the fitted model now holds epoch 1's weights");
  torch::Tensor pred = model->predict(x.slice(0, 0, 3));
  std::printf(
      "  predictions with them: %s\n",
      fmt::format(
          "{:.4f}",
          fmt::join(std::vector<float>(pred.data_ptr<float>(), pred.data_ptr<float>() + 3), ", "))
          .c_str());

  std::printf("\n4. resume_from_checkpoint(path = \"checkpoints/\")\n");
  tp::StateDict newest = tp::StateDict::from_container(tp::load_file(files.back())).child("model");
  struct Peek : tp::Callback {
    Peek() : Callback("peek") {}
    int order() const override { return 950; }  // right after resume_from_checkpoint
    torch::Tensor weight;
    void on_fit_begin(tp::Context& ctx) override {
      weight = ctx.model->named_parameters()["weight"].clone();
    }
  };
  auto peek = std::make_shared<Peek>();
  model = make_model();
  results = model->fit({x, y}, tp::FitOptions().verbose(false).epochs(3).callbacks(
                                   {tp::callbacks::resume_from_checkpoint(checkpoints), peek}));
  check(torch::equal(peek->weight, newest.tensor("weight")),
        "the new fit started from the weights of epoch-10 (the newest by epoch number)");
  results.plot((work / "resume_from_checkpoint.svg").string());

  std::printf("\n5. a custom callback's state survives auto_resume\n");
  auto tracker = std::make_shared<WeightGrad>(std::vector<std::string>{"weight"});
  auto inter2 = std::make_shared<Interrupt>();
  const std::string state2 = (work / "state2.pt").string();
  model = make_model();
  try {
    model->fit({x, y}, tp::FitOptions().verbose(false).callbacks(
                           {tracker, inter2, tp::callbacks::auto_resume(state2)}));
  } catch (const tp::CallbackError&) {
  }
  // A new process would start with an empty tracker; load_state_dict() refills it.
  tracker = std::make_shared<WeightGrad>(std::vector<std::string>{"weight"});
  model = make_model();
  model->fit({x, y}, tp::FitOptions().verbose(false).callbacks(
                         {tracker, inter2, tp::callbacks::auto_resume(state2)}));
  check(tracker->gradients.size() == 10, "the tracked gradients of all 10 epochs are there");

  std::printf("\n%s\n",
              failures == 0 ? "luz example: all checks passed" : "luz example: some checks FAILED");
  return failures == 0 ? 0 : 1;
}
