// Child of dist_test, started by torchrun (`torchrun --no-python dist_child ...`): the seed's
// Accelerate loop (MLP, AdamW, StepLR, GradScaler, shuffled data, a registered counter) on every
// process, saving with automatic naming and total_limit 3 every 4 steps, resuming with
// load_state() when the project has a checkpoint.
//
// Usage: dist_child PROJECT LOG PLAN [BATCH]
//   LOG    each process appends to LOG.<rank>:
//            "checked <n>"             (rank 0, at start: committed checkpoints, all complete)
//            "bad <path> <why>"        (rank 0, at start: a committed checkpoint lacking a file)
//            "resumed <path> <world>"  "step <n> <parameter digest>"  "samples <epoch> <i,j,...>"
//            "save_failed <message>"   "save_ops <K> <file-system calls of save K>"
//            "error <message>"         "final <digest of the whole state>"
//          and rank 0 writes the final model to LOG.model.safetensors.
//   PLAN   what goes wrong, on the first attempt only (TORCHELASTIC_RESTART_COUNT=0):
//            none | kill:R:step:N | kill:R:save:K:op:M | kill:R:load:M | fail:R:save:K |
//            hang:R:step:N | hang:R:save:K | stop:step:N (every rank exits 0 right after step
//            N's save)
//            kill:R:load:M: rank R kills itself after step 9 (two saves), then, started again,
//            at its M-th file-system call inside load_state.
//            freeze:R:load:M: rank R stops itself (SIGSTOP) at its M-th file-system call inside
//            load_state (the project must hold a checkpoint).
//            A kill fires once per LOG prefix (a file LOG.fired.K records it), whichever torchrun
//            agent and restart count the rank has.
//          R is the rank it happens on; K counts this process's saves from 1; op:M is the M-th
//          file-system call of that save on that rank.
//   BATCH  samples per process per step (16).
// With TORCHPOINT_TEST_ACCUMULATE=1 in the environment, every step accumulates the gradients of
// the two halves of its batch: the first backward() under no_sync(), the second synchronized,
// each of half the loss; rank 0 then logs "collectives <n>" (collectives it entered) at the end.
// With TORCHPOINT_TEST_ZERO=S (0, 1 or 2) the optimizer has two param groups (the first layer;
// the rest with its own learning rate, weight decay and amsgrad) and the Accelerator runs ZeRO
// stage S (0: none); TORCHPOINT_TEST_CLIP=norm|value clips the gradients before every step
// (clip_grad_norm_ to 0.5, clip_grad_value_ to 0.05). Every process then logs
// "optimizer_bytes <n>" (the optimizer state it holds) at the end.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>
#include <string>

#include "format/checksum.h"
#include "testing/fault_env.h"
#include "tests/child_log.h"
#include "tests/state_digest.h"
#include "torchpoint/accelerator.h"
#include "torchpoint/data_loader.h"
#include "torchpoint/module_state.h"
#include "torchpoint/optimizer_state.h"
#include "torchpoint/tensor_file.h"

namespace tp = torchpoint;

namespace {

// 192 samples: whole global batches for 1, 2, 3, 4 and 6 processes of 16 (and 4 of 32, ...). The
// target's second column is the sample's index, so a process can log what it trained on.
struct IndexedData : torch::data::datasets::Dataset<IndexedData> {
  IndexedData() {
    torch::manual_seed(123);
    x = torch::randn({192, 10});
    y = torch::stack({x.sum(1).sin(), torch::arange(192, torch::kFloat)}, 1);
  }
  torch::data::Example<> get(std::size_t i) override { return {x[i], y[i]}; }
  c10::optional<std::size_t> size() const override { return 192; }
  torch::Tensor x, y;
};

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 4) {
    std::fprintf(stderr, "usage: dist_child PROJECT LOG PLAN [BATCH]\n");
    return 2;
  }
  const std::string project = argv[1], plan = argv[3];
  const int rank = env_int("RANK", 0), world = env_int("WORLD_SIZE", 1);
  // Kills already done (the marker files of earlier starts): a plan fires once, however the
  // torchrun agents count their restarts.
  const std::string marker = std::string(argv[2]) + ".fired.";
  int fired = 0;
  while (std::filesystem::exists(marker + std::to_string(fired + 1))) ++fired;
  auto kill_self = [&] {
    tp::testing::append_line(marker + std::to_string(fired + 1), "fired");
    ::raise(SIGKILL);
  };
  const bool first_attempt = fired == 0;
  const std::string log = std::string(argv[2]) + "." + std::to_string(rank);
  const long batch = argc > 4 ? std::atol(argv[4]) : 16;
  const bool accumulate = env_int("TORCHPOINT_TEST_ACCUMULATE", 0) == 1;

  char what[16] = "";
  int plan_rank = -1;
  long kill_step = -1, kill_save = -1, kill_op = -1, kill_load_op = -1, freeze_load_op = -1,
       fail_save = -1,
       hang_step = -1, hang_save = -1, stop_step = -1;
  if (std::sscanf(plan.c_str(), "%15[a-z]:%d:", what, &plan_rank) == 2 && plan_rank == rank &&
      (first_attempt || (fired == 1 && plan.find(":load:") != std::string::npos))) {
    const char* rest = std::strchr(plan.c_str() + std::strlen(what) + 1, ':') + 1;
    std::string w = what;
    if (w == "kill") {
      std::sscanf(rest, "step:%ld", &kill_step);
      std::sscanf(rest, "save:%ld:op:%ld", &kill_save, &kill_op);
      if (std::sscanf(rest, "load:%ld", &kill_load_op) == 1 && first_attempt) {
        kill_load_op = -1;
        kill_step = 9;
      }
    } else if (w == "freeze") {
      std::sscanf(rest, "load:%ld", &freeze_load_op);
    } else if (w == "fail") {
      std::sscanf(rest, "save:%ld", &fail_save);
    } else if (w == "hang") {
      std::sscanf(rest, "step:%ld", &hang_step);
      std::sscanf(rest, "save:%ld", &hang_save);
    }
  }
  if (first_attempt) std::sscanf(plan.c_str(), "stop:step:%ld", &stop_step);

  tp::testing::append_line(
      log, fmt::format("pid {} {}", ::getpid(), env_int("TORCHELASTIC_RESTART_COUNT", 0)));
  tp::testing::FaultEnv env;
  // TORCHPOINT_TEST_ASYNC=1: every save is save_state_async(), waited for at the next save (or
  // at the end). Its file-system calls come from the background threads, counted as the save's.
  const bool async_saves = env_int("TORCHPOINT_TEST_ASYNC", 0) == 1;
  long saves = 0, ops_in_load = 0;
  std::atomic<long> ops_in_save{0};
  std::atomic<bool> in_save{false};
  bool in_load = false;
  const bool each_node = env_int("TORCHPOINT_TEST_EACH_NODE", 0) == 1;
  env.set_before_op([&](tp::testing::Op, const std::string& path) {
    // Every file the Accelerator touches is this process's project's (with save_on_each_node,
    // its own node's disk), or one of the folders above it (made and synced on the way).
    if (path.rfind(project, 0) != 0 && project.rfind(path, 0) != 0) {
      tp::testing::append_line(log, "foreign " + path);
    }
    if (in_load && ++ops_in_load == kill_load_op) kill_self();
    if (in_load && ops_in_load == freeze_load_op) ::raise(SIGSTOP);
    if (!in_save) return;
    const long op = ++ops_in_save;
    if (saves == kill_save && op == kill_op) kill_self();
  });

  try {
    tp::Accelerator acc(tp::ProjectConfiguration()
                            .project_dir(project)
                            .automatic_checkpoint_naming(true)
                            .total_limit(3)
                            .save_on_each_node(each_node),
                        env);
    if (acc.is_main_process()) {
      // What the kill of the previous attempt left: every committed checkpoint complete.
      auto committed = acc.list_checkpoints();
      for (const auto& [number, path] : committed) {
        tp::VerifyReport report = tp::verify(path);
        if (!report.ok()) tp::testing::append_line(log, "bad " + path + " " + report.problems[0]);
      }
      tp::testing::append_line(log, "checked " + std::to_string(committed.size()));
    }
    auto loader = tp::make_resumable_data_loader(
        IndexedData().map(torch::data::transforms::Stack<>()),
        torch::data::DataLoaderOptions().batch_size(static_cast<std::size_t>(batch)),
        /*shuffle=*/true, /*seed=*/5);
    torch::manual_seed(1 + rank);  // different on every rank: prepare() must make them equal
    auto model = torch::nn::Sequential(torch::nn::Linear(10, 32), torch::nn::ReLU(),
                                       torch::nn::Linear(32, 1));
    const char* zero_env = std::getenv("TORCHPOINT_TEST_ZERO");
    const std::string clip = std::getenv("TORCHPOINT_TEST_CLIP") ? std::getenv("TORCHPOINT_TEST_CLIP") : "";
    std::vector<torch::optim::OptimizerParamGroup> groups;
    if (zero_env != nullptr) {
      acc.set_zero_stage(std::atoi(zero_env));
      std::vector<at::Tensor> first = model[0]->parameters(), rest = model[2]->parameters();
      groups.emplace_back(first);
      groups.emplace_back(rest, std::make_unique<torch::optim::AdamWOptions>(
                                    torch::optim::AdamWOptions(5e-3).weight_decay(0.05).amsgrad(
                                        true)));
    } else {
      groups.emplace_back(model->parameters());
    }
    torch::optim::AdamW optimizer(std::move(groups), torch::optim::AdamWOptions(1e-2));
    tp::StepLR scheduler(optimizer, tp::StepLROptions(1).gamma(0.9));
    tp::GradScaler scaler(tp::GradScalerOptions().init_scale(1024).growth_interval(4));
    tp::TrainingCounters counters;
    acc.prepare(model, optimizer, loader, scheduler, scaler);
    acc.register_for_checkpointing(counters);
    // Hooks as Accelerate calls them, on every process: each writes a file of its own into the
    // checkpoint (committed with it), and each load is logged.
    if (async_saves) {
      // A background save's hooks take the directory only, and run while the loop trains on.
      acc.register_save_state_pre_hook([rank](const std::string& dir) {
        std::ofstream(fmt::format("{}/hook_rank{}.txt", dir, rank)) << rank << "\n";
      });
    } else {
      acc.register_save_state_pre_hook([&](tp::Accelerator::ModelList& models,
                                           std::vector<tp::StateDict>& weights,
                                           const std::string& dir) {
        if (models.size() != 1 || weights.size() != 1) {
          throw std::runtime_error("the save hook did not get the model and its state");
        }
        std::ofstream(fmt::format("{}/hook_rank{}.txt", dir, rank)) << counters.step << "\n";
      });
    }
    // TORCHPOINT_TEST_NO_LOAD_HOOK=1: none, so that the automatic choice reads the newest
    // checkpoint without verifying it first (a load hook acts on the chosen folder itself).
    if (env_int("TORCHPOINT_TEST_NO_LOAD_HOOK", 0) != 1) {
      acc.register_load_state_pre_hook(
          [&](tp::Accelerator::ModelList& models, const std::string&) {
            tp::testing::append_line(log, fmt::format("load_hook {}", models.size()));
          });
    }

    // TORCHPOINT_TEST_RESHARD=A,B,...: each checkpoint loaded onto this layout and saved again
    // at once, as <project>/resaved_<k>: the test compares what was saved with what was loaded.
    if (const char* sources = std::getenv("TORCHPOINT_TEST_RESHARD")) {
      std::stringstream list(sources);
      std::string source;
      for (int k = 0; std::getline(list, source, ','); ++k) {
        tp::LoadStateReport loaded = acc.load_state(source);
        tp::testing::append_line(log, fmt::format("reshard_read {} {}", k, loaded.bytes_read));
        acc.save_state(fmt::format("{}/resaved_{}", project, k));
      }
      return 0;
    }

    in_load = true;
    std::optional<tp::LoadStateReport> r = acc.try_load_state();
    in_load = false;
    if (r) {
      tp::testing::append_line(log, fmt::format("resumed {} {}", r->path, r->saved_world_size));
      tp::testing::append_line(log, fmt::format("bytes_read {}", r->bytes_read));
      for (const std::string& s : r->skipped) tp::testing::append_line(log, "skipped " + s);
    }
    auto params_digest = [&] {
      tp::Xxh3Stream h;
      for (const at::Tensor& p : model->parameters()) {
        at::Tensor c = p.detach().contiguous();
        h.update(c.data_ptr(), c.numel() * c.element_size());
      }
      return tp::checksum_hex(h.digest());
    };
    const long epochs = env_int("TORCHPOINT_TEST_EPOCHS", 3);
    tp::SaveHandle pending;  // the background save in flight
    // Ends the save in flight: `finish` waits for it (and logs what it cost); a failure a fail
    // plan caused is logged (each process gets the same outcome), then its calls are counted.
    auto end_save = [&](const std::function<void()>& finish) {
      try {
        finish();
      } catch (const tp::Error& e) {
        if (plan.rfind("fail:", 0) != 0) throw;
        tp::testing::append_line(log, std::string("save_failed ") + e.what());
      }
      env.clear_faults();
      in_save = false;
      tp::testing::append_line(log, fmt::format("save_ops {} {}", saves, ops_in_save.load()));
    };
    auto finish_async = [&] {
      if (in_save) end_save([&] { pending.wait(); });
    };
    while (counters.epoch < epochs) {
      for (auto& b : *loader) {
        if (counters.step + 1 == hang_step) ::sleep(600);
        optimizer.zero_grad();
        at::Tensor target = b.target.select(1, 0).unsqueeze(1);
        at::Tensor indices = b.target.select(1, 1).to(torch::kLong);
        // Every 7th step overflows: the scaler skips it on every rank alike.
        const float blow_up = counters.step % 7 == 3 ? 1e38f * 1e10f : 1.0f;
        if (accumulate) {
          const std::int64_t half = b.data.size(0) / 2;
          {
            auto local_only = acc.no_sync();
            acc.backward(torch::mse_loss(model->forward(b.data.narrow(0, 0, half)),
                                         target.narrow(0, 0, half)) *
                         (0.5f * blow_up));
          }
          acc.backward(torch::mse_loss(model->forward(b.data.narrow(0, half, half)),
                                       target.narrow(0, half, half)) *
                       (0.5f * blow_up));
        } else {
          acc.backward(torch::mse_loss(model->forward(b.data), target) * blow_up);
        }
        if (clip == "norm") acc.clip_grad_norm_(model->parameters(), 0.5);
        if (clip == "value") acc.clip_grad_value_(model->parameters(), 0.05);
        acc.optimizer_step(optimizer);
        ++counters.step;
        ++counters.batch_in_epoch;
        std::string samples;
        for (std::int64_t i = 0; i < indices.numel(); ++i) {
          samples += (i ? "," : "") + std::to_string(indices[i].item<std::int64_t>());
        }
        tp::testing::append_line(log, fmt::format("samples {} {}", counters.epoch, samples));
        tp::testing::append_line(log, fmt::format("step {} {}", counters.step, params_digest()));
        if (counters.step == kill_step) kill_self();
        if (counters.step % 4 == 0 && async_saves) {
          finish_async();
          ++saves;
          ops_in_save = 0;
          if (saves == hang_save) ::sleep(600);
          if (saves == fail_save) env.fail_nth({tp::testing::Op::Write}, 1, ENOSPC);
          in_save = true;
          pending = acc.save_state_async();
          if (counters.step == stop_step) {
            finish_async();
            return 0;
          }
        } else if (counters.step % 4 == 0) {
          ++saves;
          ops_in_save = 0;
          in_save = true;
          if (saves == hang_save) ::sleep(600);
          if (saves == fail_save) env.fail_nth({tp::testing::Op::Write}, 1, ENOSPC);
          const std::uint64_t requests_before =
              acc.process_group() ? acc.process_group()->store_requests() : 0;
          const double seconds_before =
              acc.process_group() ? acc.process_group()->store_seconds() : 0;
          const auto save_start = std::chrono::steady_clock::now();
          end_save([&] {
            acc.save_state();
            if (acc.process_group()) {
              // What this save cost this process in coordination: store requests, seconds in
              // them, and the whole save's seconds.
              tp::testing::append_line(
                  log, fmt::format(
                           "save_cost {} {} {:.6f} {:.6f}", saves,
                           acc.process_group()->store_requests() - requests_before,
                           acc.process_group()->store_seconds() - seconds_before,
                           std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                                         save_start)
                               .count()));
              tp::testing::append_line(
                  log, fmt::format("save_bytes {} {}", saves, acc.last_save_bytes_written()));
            }
          });
          if (counters.step == stop_step) return 0;
        }
      }
      scheduler.step();
      ++counters.epoch;
      counters.batch_in_epoch = 0;
    }
    finish_async();
    if (zero_env != nullptr) {
      tp::testing::append_line(log, fmt::format("optimizer_bytes {}", acc.optimizer_state_bytes()));
    }
    tp::StateDict final_state;
    final_state.set_child("model", tp::module_state_dict(*model));
    // Under ZeRO the optimizer's state is in its parts (the checkpoints hold it whole).
    if (acc.zero_stage() == 0) final_state.set_child("optimizer", tp::optimizer_state_dict(optimizer));
    final_state.set_child("scheduler", scheduler.state_dict());
    final_state.set_child("scaler", scaler.state_dict());
    final_state.set_child("rng", acc.rng().state_dict());
    tp::testing::append_line(log,
                             "final " + tp::checksum_hex(tp::testing::state_digest(final_state)));
    if (acc.process_group()) {
      tp::testing::append_line(log,
                               fmt::format("collectives {}", acc.process_group()->collectives()));
    }
    if (acc.is_main_process()) {
      tp::save_file(std::string(argv[2]) + ".model.safetensors",
                    tp::module_state_dict(*model).to_container());
    }
    (void)world;
  } catch (const std::exception& e) {
    tp::testing::append_line(log, std::string("error ") + e.what());
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    return 1;
  }
  return 0;
}
