// Child of learner_crash_test: fits the shared Learner job in DIR with auto_resume (saving at
// epoch ends and every 10 steps), and kills itself with SIGKILL at the point KILL names:
//   none              run to the end
//   batch:E:B         after batch B of epoch E (after any save of that step)
//   before_save:E     at the end of epoch E, before auto_resume saves it
//   after_save:E      at the end of epoch E, after auto_resume saved it
//   op:N              before the N-th file-system call of this process (inside some save)
// SAVES is "sync", or "async" for auto_resume and model_checkpoint saving in the background.
// JOB (optional) is "dropout" (the default: the Dropout model with Adam, 6 epochs) or "gan": the
// two-optimizer GAN (generator with Adam and an LR scheduler attached to it, discriminator with
// SGD), 2 epochs, its step lines holding the sum of both optimizers' losses.
// Under torchrun (dist_test) every process runs the fit: LOG gets the suffix ".<rank>", a KILL
// prefixed "rank:R:" applies to rank R only, and only on torchrun's first attempt; rank 0 writes
// DIR/final.ckpt.
// Appends "step <n> <loss bits hex>" per step and "resumed" to LOG; at the end writes
// DIR/final.ckpt (model, optimizer, counters, records) and appends "ops <file-system calls>"
// and "done".
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "testing/fault_env.h"
#include "tests/child_log.h"
#include "tests/learner_job.h"

namespace tp = torchpoint;

namespace {

// Runs `action` at one hook, at a chosen place in the callback order.
struct At : tp::Callback {
  At(std::string name, int order_value) : Callback(std::move(name)), order_(order_value) {}
  int order() const override { return order_; }
  std::function<void(tp::Context&)> fit_begin, after_loss, batch_end, epoch_end;
  void on_fit_begin(tp::Context& ctx) override {
    if (fit_begin) fit_begin(ctx);
  }
  void on_train_batch_after_loss(tp::Context& ctx) override {
    if (after_loss) after_loss(ctx);
  }
  void on_train_batch_end(tp::Context& ctx) override {
    if (batch_end) batch_end(ctx);
  }
  void on_epoch_end(tp::Context& ctx) override {
    if (epoch_end) epoch_end(ctx);
  }

 private:
  int order_;
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5 && argc != 6) {
    std::fprintf(stderr, "usage: learner_child DIR LOG KILL SAVES [dropout|gan]\n");
    return 2;
  }
  const bool gan = argc == 6 && std::string(argv[5]) == "gan";
  if (argc == 6 && !gan && std::string(argv[5]) != "dropout") {
    std::fprintf(stderr, "learner_child: unknown job '%s' (dropout or gan)\n", argv[5]);
    return 2;
  }
  const char* rank_text = std::getenv("RANK");
  const int rank = rank_text ? std::atoi(rank_text) : 0;
  const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
  const std::string dir = argv[1];
  const std::string log = std::string(argv[2]) + (rank_text ? std::string(".") + rank_text : "");
  std::string kill = argv[3];
  if (kill.rfind("rank:", 0) == 0) {
    int target = std::atoi(kill.c_str() + 5);
    kill = kill.substr(kill.find(':', 5) + 1);
    if (target != rank || (attempt != nullptr && std::string(attempt) != "0")) kill = "none";
  }
  const bool async = std::string(argv[4]) == "async";
  long kill_epoch = -1, kill_batch = -1, kill_before = -1, kill_after = -1, kill_op = -1;
  std::sscanf(kill.c_str(), "batch:%ld:%ld", &kill_epoch, &kill_batch);
  std::sscanf(kill.c_str(), "before_save:%ld", &kill_before);
  std::sscanf(kill.c_str(), "after_save:%ld", &kill_after);
  std::sscanf(kill.c_str(), "op:%ld", &kill_op);

  tp::testing::FaultEnv env;
  std::atomic<long> ops = 0;  // background saves make their calls on their own thread
  env.set_before_op([&](tp::testing::Op, const std::string&) {
    if (++ops == kill_op) ::raise(SIGKILL);
  });

  // Early in the order: sees every step's loss and whether the fit was resumed.
  auto early = std::make_shared<At>("log", 0);
  early->after_loss = [&](tp::Context& ctx) {
    if (!gan) {
      tp::testing::append_line(log, tp::testing::step_line(ctx.step + 1, ctx.loss.item<float>()));
    } else if (ctx.opt_name == "discriminator") {  // the batch's last pass
      float sum = (ctx.losses.at("generator") + ctx.losses.at("discriminator")).item<float>();
      tp::testing::append_line(log, tp::testing::step_line(ctx.step + 1, sum));
    }
  };
  early->epoch_end = [&](tp::Context& ctx) {
    if (ctx.epoch == kill_before) ::raise(SIGKILL);
  };
  // After auto_resume in the order: its restore and its saves have happened.
  auto late = std::make_shared<At>("kill", 2000);
  late->fit_begin = [&](tp::Context& ctx) {
    if (ctx.learner->counters().step > 0) tp::testing::append_line(log, "resumed");
  };
  late->batch_end = [&](tp::Context& ctx) {
    if (ctx.epoch == kill_epoch && ctx.batch == kill_batch) ::raise(SIGKILL);
  };
  late->epoch_end = [&](tp::Context& ctx) {
    if (ctx.epoch == kill_after) ::raise(SIGKILL);
  };

  // One intra-op thread for the GAN: its tiny ops gain nothing from more, whose spinning
  // workers cost a loaded machine about 1 s of CPU per run (the rerun uses the same setting).
  if (gan) torch::set_num_threads(1);
  auto data = tp::testing::seed_data();
  auto valid = tp::testing::seed_data(200);
  auto learner = gan ? tp::testing::gan_learner() : tp::testing::dropout_learner();
  auto scheduler = tp::callbacks::lr_scheduler([](torch::optim::Optimizer& opt) {
    return std::make_unique<tp::StepLR>(opt, tp::StepLROptions(2).gamma(0.5));
  });
  if (gan) scheduler.opt_name("generator");
  torch::manual_seed(5);
  learner->fit(
      {data.x, data.y},
      tp::FitOptions()
          .epochs(gan ? 2 : 6)
          .verbose(false)
          .env(&env)
          .valid_data({valid.x, valid.y})
          .metrics({tp::metrics::mae()})
          .callbacks(
              {early, scheduler,
               tp::callbacks::model_checkpoint(dir + "/ckpts/")
                   .monitor(gan ? "valid_loss_discriminator" : "valid_loss")
                   .save_best_only(true)
                   .async(async),
               tp::callbacks::early_stopping().patience(100),
               std::make_shared<tp::testing::LossTally>(),
               tp::callbacks::auto_resume(dir + "/state.ckpt").save_every_steps(10).async(async),
               late}));
  if (rank == 0) learner->save_checkpoint(dir + "/final.ckpt");
  tp::testing::append_line(log, "ops " + std::to_string(ops.load()));
  tp::testing::append_line(log, "done");
  return 0;
}
