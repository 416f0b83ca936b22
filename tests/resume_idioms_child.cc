// Child of resume_idioms_test: one of the four resume idioms of Accelerate's users, written as
// they write it, on 1 process or under torchrun. Three epochs of 3 batches (11 samples, global
// batches of 4: the last one partial), a small MLP with Dropout, SGD with momentum and a StepLR.
// Each attempt resumes with try_load_state() and, with a KILLED file, is SIGKILLed (on rank 0)
// right after the first save whose label that file does not hold yet, adding the label first:
// runs restarted until they end are killed after every save in turn.
//
// Usage: resume_idioms_child PROJECT LOG IDIOM ACCUMULATION [KILLED]
//   IDIOM         registered | step | epoch | stateful (the a, b, c, d; see
//                 resume_idioms_test.cc)
//   ACCUMULATION  gradient accumulation steps (1 or 2: saves only where gradients sync)
//   KILLED        the labels of the saves already killed after, one a line (absent: no kill)
// Each process appends to LOG.<rank>: "resumed <label>", "save <label>",
// "step <n> <loss bits>" per batch and "final <digest>" at the end.
#include <signal.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <set>
#include <string>

#include "format/checksum.h"
#include "tests/child_log.h"
#include "tests/state_digest.h"
#include "torchpoint/accelerator.h"
#include "torchpoint/data_loader.h"
#include "torchpoint/lr_scheduler.h"
#include "torchpoint/module_state.h"
#include "torchpoint/optimizer_state.h"

namespace tp = torchpoint;

namespace {

constexpr int kEpochs = 3;
constexpr std::size_t kSamples = 11;
constexpr std::size_t kGlobalBatch = 4;

struct Data : torch::data::datasets::Dataset<Data> {
  Data() {
    torch::manual_seed(17);
    x = torch::randn({kSamples, 4});
    y = x.sum(1, true).cos();
  }
  torch::data::Example<> get(std::size_t i) override { return {x[i], y[i]}; }
  c10::optional<std::size_t> size() const override { return kSamples; }
  torch::Tensor x, y;
};

// What the user's own code keeps in the checkpoint, registered with register_for_checkpointing:
// the guide's position (epoch, batches done in it) for idiom a; the step count that idiom b
// parses from a "step_N" folder name and the epoch that idiom c parses from "epoch_N"; the
// epoch counter of idiom d. Plus the label of the save, for the kill plan only.
struct UserState {
  std::int64_t epoch = 0;
  std::int64_t batches_done = 0;
  std::int64_t overall_step = 0;
  std::string label;

  tp::StateDict state_dict() const {
    tp::StateDict sd;
    sd.set("epoch", epoch);
    sd.set("batches_done", batches_done);
    sd.set("overall_step", overall_step);
    sd.set("label", label);
    return sd;
  }
  void load_state_dict(const tp::StateDict& sd) {
    epoch = sd.get<std::int64_t>("epoch");
    batches_done = sd.get<std::int64_t>("batches_done");
    overall_step = sd.get<std::int64_t>("overall_step");
    label = sd.get<std::string>("label");
  }
};

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5 && argc != 6) {
    std::fprintf(stderr, "usage: resume_idioms_child PROJECT LOG IDIOM ACCUMULATION [KILLED]\n");
    return 2;
  }
  const std::string project = argv[1], idiom = argv[3];
  const int accumulation = std::atoi(argv[4]);
  const std::string killed_file = argc == 6 ? argv[5] : "";
  std::set<std::string> killed;
  {
    std::ifstream in(killed_file);
    for (std::string line; std::getline(in, line);) killed.insert(line);
  }
  const int rank = env_int("RANK", 0), world = env_int("WORLD_SIZE", 1);
  const std::string log = std::string(argv[2]) + "." + std::to_string(rank);
  if (idiom != "registered" && idiom != "step" && idiom != "epoch" && idiom != "stateful") {
    std::fprintf(stderr, "unknown idiom %s\n", idiom.c_str());
    return 2;
  }
  try {
    tp::Accelerator acc(
        tp::ProjectConfiguration().project_dir(project).automatic_checkpoint_naming(true).total_limit(
            2));
    auto loader = tp::make_resumable_data_loader(
        Data().map(torch::data::transforms::Stack<>()),
        torch::data::DataLoaderOptions().batch_size(kGlobalBatch / static_cast<std::size_t>(world)),
        /*shuffle=*/true, /*seed=*/3);
    torch::manual_seed(5);
    auto model = torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::Dropout(0.25),
                                       torch::nn::ReLU(), torch::nn::Linear(8, 1));
    torch::optim::SGD optimizer(model->parameters(),
                                torch::optim::SGDOptions(0.05).momentum(0.9));
    tp::StepLR scheduler(optimizer, tp::StepLROptions(1).gamma(0.8));
    UserState user;
    acc.prepare(model, optimizer, loader, scheduler);
    acc.register_for_checkpointing(user);
    acc.set_gradient_accumulation_steps(accumulation);

    const bool resumed = acc.try_load_state().has_value();
    if (resumed) tp::testing::append_line(log, "resumed " + user.label);
    auto save = [&](const std::string& label) {
      user.label = label;
      acc.save_state();
      tp::testing::append_line(log, "save " + label);
      // Rank 0 returns from save_state() once the checkpoint is committed everywhere.
      if (!killed_file.empty() && rank == 0 && !killed.count(label)) {
        tp::testing::append_line(killed_file, label);
        ::raise(SIGKILL);
      }
    };

    const auto per_epoch = static_cast<std::int64_t>(loader->batches_per_epoch());
    // Where the user's loop starts, computed as each idiom's users compute it.
    std::int64_t starting_epoch = 0, resume_step = -1;
    if (resumed) {
      if (idiom == "registered") {
        starting_epoch = user.epoch;
        resume_step = user.batches_done;
      } else if (idiom == "step") {  // Accelerate's examples/by_feature/checkpointing.py
        starting_epoch = user.overall_step / per_epoch;
        resume_step = user.overall_step - starting_epoch * per_epoch;
      } else {  // "epoch": the folder epoch_N was saved after epoch N; "stateful": no skip
        starting_epoch = user.epoch;
      }
    }
    std::int64_t step = user.overall_step;  // batches trained on, over every attempt
    for (std::int64_t epoch = starting_epoch; epoch < kEpochs; ++epoch) {
      auto active = loader;
      if (resume_step >= 0 && epoch == starting_epoch) {
        active = acc.skip_first_batches(loader, static_cast<std::size_t>(resume_step));
      }
      for (auto& batch : *active) {
        auto accumulating = acc.accumulate();
        auto loss = torch::mse_loss(model->forward(batch.data), batch.target);
        acc.backward(loss);
        const bool stepped = acc.optimizer_step(optimizer);
        // Idiom b's loop, as in Accelerate's example, steps its scheduler with the optimizer:
        // a position derived from the step count cannot tell whether end-of-epoch work was done.
        if (idiom == "step" && stepped) scheduler.step();
        if (acc.sync_gradients()) optimizer.zero_grad();
        ++step;
        ++user.batches_done;
        user.overall_step = step;
        tp::testing::append_line(log, tp::testing::step_line(step, loss.item<float>()));
        // Every batch where a save is allowed: the first, the middle and the last of the epoch.
        if (idiom != "epoch" && acc.sync_gradients()) {
          save(fmt::format("e{}-s{}", epoch, step));
        }
      }
      // After the epoch's loop, before its end-of-epoch work: only the guide's idiom can tell
      // this point from the one after that work (see the README).
      if (idiom == "registered") save(fmt::format("e{}-loop-end", epoch));
      if (idiom != "step") scheduler.step();
      user.epoch = epoch + 1;
      user.batches_done = 0;
      save(fmt::format("e{}-end", epoch));
    }
    tp::StateDict final_state;
    final_state.set_child("model", tp::module_state_dict(*model));
    final_state.set_child("optimizer", tp::optimizer_state_dict(optimizer));
    final_state.set_child("scheduler", scheduler.state_dict());
    final_state.set_child("rng", acc.rng().state_dict());
    tp::testing::append_line(log,
                             "final " + tp::checksum_hex(tp::testing::state_digest(final_state)));
  } catch (const std::exception& e) {
    tp::testing::append_line(log, std::string("error ") + e.what());
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    return 1;
  }
  return 0;
}
