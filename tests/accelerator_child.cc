// Child of accelerator_crash_test: runs AcceleratorJob in PROJECT, resuming when a checkpoint
// exists, and kills itself with SIGKILL at the point KILL names. SAVER says who saves:
//   accelerator     save_state() and load_state() with automatic naming and total_limit 3
//   async           as accelerator, with save_state_async() (and wait_for_checkpoint() at the end)
//   manager-async   as manager, with save_async() (and wait_for_checkpoint() at the end)
//   manager         a CheckpointManager over PROJECT/checkpoints of the same components,
//                   keeping the last 2 and the best by loss, and try_latest() + restore()
// KILL is one of:
//   none            run to the end
//   step:N          right after step N
//   after_save:K    right after the K-th save of this process returns
//   save:K:op:M     during the K-th save, before its M-th file-system call (synchronous saves)
//   op:N            before the N-th file-system call of the process, on whichever thread
// Appends "step <n> <loss bits hex>" per step to LOG, and "final <digest>" at the end.
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <string>

#include "format/checksum.h"
#include "testing/fault_env.h"
#include "tests/accelerator_job.h"
#include "tests/child_log.h"
#include "tests/state_digest.h"
#include "torchpoint/checkpoint_manager.h"
#include "torchpoint/rng_state.h"

namespace tp = torchpoint;

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: accelerator_child PROJECT LOG KILL SAVER\n");
    return 2;
  }
  const std::string project = argv[1], log = argv[2], kill = argv[3], saver = argv[4];
  const bool manager_async = saver == "manager-async";
  const bool manager = saver == "manager" || manager_async, async = saver == "async";
  long kill_step = -1, kill_after_save = -1, kill_save = -1, kill_op = -1, kill_nth_op = -1;
  std::sscanf(kill.c_str(), "op:%ld", &kill_nth_op);
  std::sscanf(kill.c_str(), "step:%ld", &kill_step);
  std::sscanf(kill.c_str(), "after_save:%ld", &kill_after_save);
  std::sscanf(kill.c_str(), "save:%ld:op:%ld", &kill_save, &kill_op);

  tp::testing::FaultEnv env;
  // Atomic: an asynchronous save makes its calls on its own thread.
  std::atomic<long> saves = 0, ops_in_save = 0, ops = 0;
  env.set_before_op([&](tp::testing::Op, const std::string&) {
    if (++ops == kill_nth_op) ::raise(SIGKILL);
    if (saves + 1 == kill_save && ++ops_in_save == kill_op) ::raise(SIGKILL);
  });
  tp::ProjectConfiguration config = tp::ProjectConfiguration().project_dir(project);
  if (!manager) config.automatic_checkpoint_naming(true).total_limit(3);
  tp::testing::AcceleratorJob job(config, env);

  // The manager's set: the components the Accelerator saves, registered by hand.
  tp::StatefulSet state;
  tp::RngState rng;
  state.add("model", tp::ModuleState(job.model.ptr()));
  state.add("optimizer", tp::OptimizerState(std::shared_ptr<torch::optim::Optimizer>(
                             std::shared_ptr<void>(), &job.optimizer)));
  state.add("scheduler", tp::AnyStateful::ref(static_cast<tp::LRScheduler&>(job.scheduler)));
  state.add("scaler", tp::AnyStateful::ref(job.scaler));
  state.add("sampler", tp::AnyStateful::ref(job.loader->sampler()));
  state.add("counters", tp::AnyStateful::ref(job.counters));
  state.add("rng", tp::AnyStateful::ref(rng), /*restore_last=*/true);
  tp::CheckpointManager checkpoints(project + "/checkpoints",
                                    tp::CheckpointManagerOptions().retention(
                                        tp::RetentionPolicy().keep_last(2).best_metric("loss")),
                                    &env);

  if (manager) {
    if (auto latest = checkpoints.try_latest()) {
      checkpoints.restore(state, *latest);
      tp::testing::append_line(log, "resumed " + *latest);
    }
    job.save = [&](std::int64_t step, float loss) {
      if (manager_async) {
        checkpoints.save_async(state, step, {{"loss", loss}});
      } else {
        checkpoints.save(state, step, {{"loss", loss}});
      }
    };
  } else if (async) {
    job.save = [&](std::int64_t, float) { job.acc.save_state_async(); };
  }
  if (!manager && !job.acc.list_checkpoints().empty()) {
    tp::LoadStateReport r = job.acc.load_state();
    // Accelerate's flow: skip the batches already consumed in this epoch. load_state() has
    // already put the data position back; skip_first_batches is absolute, so they agree.
    job.acc.skip_first_batches(job.loader, static_cast<std::size_t>(job.counters.batch_in_epoch));
    tp::testing::append_line(log, "resumed " + r.path);
  }
  job.train(
      /*save_every=*/5,
      [&](std::int64_t step, float loss) {
        tp::testing::append_line(log, tp::testing::step_line(step, loss));
        if (step == kill_step) ::raise(SIGKILL);
      },
      [&](std::int64_t) {
        ++saves;
        ops_in_save = 0;
        if (saves == kill_after_save) ::raise(SIGKILL);
      });
  job.acc.wait_for_checkpoint();
  checkpoints.wait_for_checkpoint();
  tp::testing::append_line(
      log, "final " + tp::checksum_hex(tp::testing::state_digest(job.final_state())));
  return 0;
}
