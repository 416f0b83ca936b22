// luz's checkpoint callbacks for Learner::fit, with luz's names and defaults: auto_resume,
// model_checkpoint, resume_from_checkpoint, plus early_stopping and lr_scheduler, whose state
// survives a resume.
//
// Each factory returns an options object; it converts to a CallbackPtr where fit() takes one,
// and .build() makes the callback explicitly.
//
// Example:
//   learner.fit(data, torchpoint::FitOptions().callbacks({
//       torchpoint::callbacks::auto_resume(),                       // ./state.ckpt
//       torchpoint::callbacks::model_checkpoint("checkpoints/").monitor("train_loss")}));
#pragma once

#include <torch/arg.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>

#include "torchpoint/error.h"
#include "torchpoint/learner.h"
#include "torchpoint/lr_scheduler.h"

namespace torchpoint {

// "min": smaller is better; "max": larger is better.
enum class Mode { kMin, kMax };

namespace callbacks {

// Saves the whole run to `path` at the end of every epoch (after every other callback's
// on_epoch_end) and, with save_every_steps(n), after every n-th optimizer step. When a fit
// starts and `path` exists, the run is restored from it (model, optimizer, data position,
// records, counters, every callback's state, RNG) and continues exactly where it stopped:
// finished epochs are not replayed. The file is deleted when the fit completes. A corrupt
// file is an error, never silently ignored.
struct AutoResumeOptions {
  explicit AutoResumeOptions(std::string path = "./state.ckpt") : path_(std::move(path)) {}
  TORCH_ARG(std::string, path);
  TORCH_ARG(std::int64_t, save_every_steps) = 0;  // 0: only at epoch ends
  // Save in the background (Learner::save_checkpoint with an AsyncCheckpointer): the fit stops
  // only while the state is copied. The next save, and the end of the fit, wait for the
  // previous one and throw its error.
  TORCH_ARG(bool, async) = false;

 public:
  CallbackPtr build() const;
  operator CallbackPtr() const { return build(); }  // NOLINT: implicit by design
};
inline AutoResumeOptions auto_resume(std::string path = "./state.ckpt") {
  return AutoResumeOptions(std::move(path));
}

// Writes a learner checkpoint at the end of each epoch. `path` is a directory (ending in '/'
// or existing), where files are named epoch-{epoch:02d}-{monitor}-{value:.3f}.ckpt, or a
// file name template in fmt syntax using {epoch}, {monitor} (the monitored value, as in luz)
// and metric names ("epoch-{epoch:02d}/model-{monitor:.2f}.ckpt", "run-{valid_loss:.2f}.ckpt").
// With save_best_only, only epochs whose monitored value improves on the best so far by more than
// min_delta (in `mode`'s direction) are written. The best value is part of the callback's state. A
// monitored metric that the fit does not record is an InvalidArgument error at the start of the
// fit, naming the metrics that exist. With save_top_k(k) (Lightning's save_top_k), after each
// save only the k files with the best monitored values, and the newest one (a resume needs
// it), are kept of those this callback wrote; the others are deleted. The files written and
// their values are part of the callback's state.
struct ModelCheckpointOptions {
  explicit ModelCheckpointOptions(std::string path) : path_(std::move(path)) {}
  TORCH_ARG(std::string, path);
  TORCH_ARG(std::string, monitor) = "valid_loss";
  TORCH_ARG(bool, save_best_only) = false;
  TORCH_ARG(Mode, mode) = Mode::kMin;
  TORCH_ARG(double, min_delta) = 0.0;
  TORCH_ARG(std::optional<std::size_t>, save_top_k);
  // Save in the background, as auto_resume's async: save_top_k's deletions then wait for the
  // new file's commit (they run at the next save or at the end of the fit).
  TORCH_ARG(bool, async) = false;
  // Names the callback's state in checkpoints; two in one fit need different names.
  TORCH_ARG(std::string, name) = "model_checkpoint";

 public:
  CallbackPtr build() const;
  operator CallbackPtr() const { return build(); }  // NOLINT: implicit by design
};
inline ModelCheckpointOptions model_checkpoint(std::string path) {
  return ModelCheckpointOptions(std::move(path));
}

// At the start of the fit, loads a learner checkpoint: `path` is a file, or a directory whose
// newest valid checkpoint (largest epoch number in the file name, never lexical order) is
// used; invalid ones are skipped with a warning naming them. By default only the model
// weights; restore_records also restores the records and the epoch and step counters, and the
// fit then trains FitOptions::epochs more epochs after the checkpoint's, as luz does. A path
// that does not exist is a warning, and the fit starts from scratch (as in luz).
// restore_callbacks_state gives each callback of this fit the state saved under its name; a
// saved state that no callback of this fit takes is reported, not an error (auto_resume, which
// resumes the same fit, refuses it). Warnings go where the fit's progress goes
// (FitOptions::output) unless verbose(false).
struct ResumeFromCheckpointOptions {
  explicit ResumeFromCheckpointOptions(std::string path) : path_(std::move(path)) {}
  TORCH_ARG(std::string, path);
  TORCH_ARG(bool, restore_model_state) = true;
  TORCH_ARG(bool, restore_records) = false;
  TORCH_ARG(bool, restore_optimizer_state) = false;
  TORCH_ARG(bool, restore_callbacks_state) = false;

 public:
  CallbackPtr build() const;
  operator CallbackPtr() const { return build(); }  // NOLINT: implicit by design
};
inline ResumeFromCheckpointOptions resume_from_checkpoint(std::string path) {
  return ResumeFromCheckpointOptions(std::move(path));
}

// Stops the fit when the monitored metric has not improved by more than min_delta for
// `patience` epochs in a row (at the first such epoch when patience is 0). Its best value and
// count are part of its state.
struct EarlyStoppingOptions {
  TORCH_ARG(std::string, monitor) = "valid_loss";
  TORCH_ARG(std::int64_t, patience) = 0;
  TORCH_ARG(Mode, mode) = Mode::kMin;
  TORCH_ARG(double, min_delta) = 0.0;
  // Names the callback's state in checkpoints; two in one fit need different names.
  TORCH_ARG(std::string, name) = "early_stopping";

 public:
  CallbackPtr build() const;
  operator CallbackPtr() const { return build(); }  // NOLINT: implicit by design
};
inline EarlyStoppingOptions early_stopping() { return EarlyStoppingOptions(); }

// luz's luz_callback_csv_logger: one CSV row per epoch and set, "epoch,set,loss,<metrics>",
// each value written so that it reads back to the same double. The rows written so far are the
// callback's state: after auto_resume the file is cut back to the checkpoint's rows before the
// fit goes on, so a run interrupted after writing a row it then repeats has no duplicate; the
// file of an interrupted and resumed fit is the file of an uninterrupted one.
//
// Example:
//   learner.fit(data, torchpoint::FitOptions().callbacks({torchpoint::callbacks::csv_logger(
//                         "logs/metrics.csv")}));
struct CsvLoggerOptions {
  explicit CsvLoggerOptions(std::string path) : path_(std::move(path)) {}
  TORCH_ARG(std::string, path);
  // Names the callback's state in checkpoints.
  TORCH_ARG(std::string, name) = "csv_logger";

 public:
  CallbackPtr build() const;
  operator CallbackPtr() const { return build(); }  // NOLINT: implicit by design
};
inline CsvLoggerOptions csv_logger(std::string path) { return CsvLoggerOptions(std::move(path)); }

// luz's luz_callback_tfevents: at every epoch end, the epoch's metrics as TensorBoard scalars
// tagged "<set>/<metric>" ("train/loss", "valid/accuracy") at step = epoch, in an event file
// of `logdir` that `tensorboard --logdir` reads (each fit writes a file of its own). A fit
// resumed by auto_resume starts its file by telling TensorBoard to drop what earlier files
// logged from the epoch it continues with, so every epoch shows once, with the values of the
// run that finished it. Values are stored as float32, as TensorBoard's scalars are.
//
// Example:
//   learner.fit(data, torchpoint::FitOptions().callbacks({torchpoint::callbacks::tfevents(
//                         "logs")}));
struct TfeventsOptions {
  explicit TfeventsOptions(std::string logdir) : logdir_(std::move(logdir)) {}
  TORCH_ARG(std::string, logdir);
  // Names the callback in checkpoints (it keeps no state of its own).
  TORCH_ARG(std::string, name) = "tfevents";

 public:
  CallbackPtr build() const;
  operator CallbackPtr() const { return build(); }  // NOLINT: implicit by design
};
inline TfeventsOptions tfevents(std::string logdir = "logs") {
  return TfeventsOptions(std::move(logdir));
}

// Creates an LR scheduler on the fit's optimizer at the start of the fit and steps it at the
// end of every epoch (luz's default), or after every optimizer step with step_every_batch.
// The scheduler's state is the callback's state, with the name of the optimizer it is attached
// to: a resume that would attach it to another optimizer is an Incompatible error.
// With several optimizers, opt_name(name) says which one it schedules (luz's opt_name; it is
// an InvalidArgument error at the start of the fit to leave it out or to name one the Learner
// does not have); one scheduler per optimizer takes one callback each.
//
// Example:
//   torchpoint::callbacks::lr_scheduler([](torch::optim::Optimizer& opt) {
//     return std::make_unique<torchpoint::StepLR>(opt, torchpoint::StepLROptions(2)); })
struct LRSchedulerOptions {
  using Factory = std::function<std::unique_ptr<LRScheduler>(torch::optim::Optimizer&)>;
  explicit LRSchedulerOptions(Factory factory) : factory_(std::move(factory)) {}
  TORCH_ARG(Factory, factory);
  TORCH_ARG(bool, step_every_batch) = false;
  // The optimizer scheduled, by name; empty: the Learner's only one.
  TORCH_ARG(std::string, opt_name);
  // Names the callback's state in checkpoints (two in one fit are numbered if left alike).
  TORCH_ARG(std::string, name) = "lr_scheduler";

 public:
  CallbackPtr build() const;
  operator CallbackPtr() const { return build(); }  // NOLINT: implicit by design
};
inline LRSchedulerOptions lr_scheduler(LRSchedulerOptions::Factory factory) {
  return LRSchedulerOptions(std::move(factory));
}

}  // namespace callbacks
}  // namespace torchpoint
