#include "torchpoint/callbacks.h"

#include <fcntl.h>
#include <fmt/args.h>
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>

#include "checkpoint/committed.h"
#include "io/filename.h"
#include "io/posix_error.h"
#include "torchpoint/checkpoint_manager.h"
#include "torchpoint/error.h"
#include "torchpoint/retention.h"
#include "report/tfevents.h"

namespace torchpoint::callbacks {
namespace {

using detail::ensure_directory;

// Callbacks that restore a whole run go after the others' on_fit_begin; auto_resume also saves
// after the others' on_epoch_end.
constexpr int kResumeFromCheckpointOrder = 900;
constexpr int kAutoResumeOrder = 1000;

const char* mode_name(Mode mode) { return mode == Mode::kMin ? "min" : "max"; }

bool improves(double value, double best, Mode mode, double min_delta) {
  if (std::isnan(value)) return false;
  return mode == Mode::kMin ? value < best - min_delta : value > best + min_delta;
}

double worst(Mode mode) {
  return mode == Mode::kMin ? std::numeric_limits<double>::infinity()
                            : -std::numeric_limits<double>::infinity();
}

void check_monitor(const Context& ctx, const std::string& callback, const std::string& monitor) {
  if (std::find(ctx.monitors.begin(), ctx.monitors.end(), monitor) != ctx.monitors.end()) return;
  bool wants_valid = monitor.rfind("valid_", 0) == 0;
  throw Error(ErrorCode::InvalidArgument,
              fmt::format("{} monitors '{}', which this fit does not record; it records: {}{}",
                          callback, monitor, fmt::join(ctx.monitors, ", "),
                          wants_valid ? " (valid_* metrics need FitOptions::valid_data)"
                                      : " (pass one of these as monitor)"));
}

// Creates `dir` and its missing parents; the new entries are made durable.

double metric_value(const Context& ctx, const std::string& monitor) {
  auto it = ctx.metrics.find(monitor);
  if (it == ctx.metrics.end()) {
    throw Error(
        ErrorCode::InvalidArgument,
        fmt::format("the metric '{}' has no value at the end of epoch {}", monitor, ctx.epoch));
  }
  return it->second;
}

class AutoResume final : public Callback {
 public:
  explicit AutoResume(AutoResumeOptions options)
      : Callback("auto_resume"), options_(std::move(options)) {
    if (options_.path().empty() || options_.save_every_steps() < 0) {
      throw Error(ErrorCode::InvalidArgument,
                  "auto_resume needs a file path and save_every_steps >= 0");
    }
  }
  int order() const override { return kAutoResumeOrder; }

  void on_fit_begin(Context& ctx) override {
    if (ctx.env->stat(options_.path()).exists) {
      ctx.learner->restore_checkpoint(options_.path(), RestoreOptions(), ctx.env);
    }
  }
  void on_train_batch_end(Context& ctx) override {
    if (options_.save_every_steps() > 0 && ctx.step % options_.save_every_steps() == 0) {
      save(ctx);
    }
  }
  void on_epoch_end(Context& ctx) override { save(ctx); }
  void on_fit_end(Context& ctx) override {
    if (options_.async()) ctx.background_saver().wait();
    // The run is complete: as luz does, the next fit starts from scratch.
    if (ctx.is_main_process() && ctx.env->stat(options_.path()).exists) {
      ctx.env->remove_file(options_.path());
      std::string parent = parent_path(options_.path());
      ctx.env->sync_dir(parent.empty() ? "." : parent);
    }
  }

 private:
  void save(Context& ctx) {
    ensure_directory(*ctx.env, parent_path(options_.path()));
    if (options_.async()) {
      ctx.learner->save_checkpoint(options_.path(), ctx.background_saver());
    } else {
      ctx.learner->save_checkpoint(options_.path(), ctx.env);
    }
  }
  AutoResumeOptions options_;
};

class ModelCheckpoint final : public Callback {
 public:
  explicit ModelCheckpoint(ModelCheckpointOptions options)
      : Callback(options.name()), options_(std::move(options)), best_(worst(options_.mode())) {
    if (options_.path().empty()) {
      throw Error(ErrorCode::InvalidArgument, "model_checkpoint needs a directory or file path");
    }
    if (options_.save_top_k() && *options_.save_top_k() == 0) {
      throw Error(ErrorCode::InvalidArgument,
                  "model_checkpoint: save_top_k must be at least 1 (leave it unset to keep every "
                  "file)");
    }
  }

  void on_fit_begin(Context& ctx) override {
    check_monitor(ctx, "model_checkpoint", options_.monitor());
    const std::string& path = options_.path();
    directory_ = path.back() == '/' || ctx.env->stat(path).is_directory;
    if (directory_) ensure_directory(*ctx.env, path);
  }

  void on_fit_end(Context& ctx) override {
    if (options_.async()) finish_previous_save(ctx);
  }

  void on_epoch_end(Context& ctx) override {
    double value = metric_value(ctx, options_.monitor());
    bool better = improves(value, best_, options_.mode(), options_.min_delta());
    if (better) best_ = value;
    if (options_.save_best_only() && !better) return;
    std::string path = file_for(ctx, value);
    ensure_directory(*ctx.env, parent_path(path));
    if (options_.async()) {
      finish_previous_save(ctx);
      ctx.learner->save_checkpoint(path, ctx.background_saver());
    } else {
      ctx.learner->save_checkpoint(path, ctx.env);
    }
    std::erase_if(saved_, [&](const Saved& f) { return f.path == path; });  // overwritten
    saved_.push_back({path, value});
    // The files are the main process's (with several processes, it wrote them).
    if (options_.save_top_k() && !options_.async() && ctx.is_main_process()) keep_top_k(*ctx.env);
  }

  StateDict state_dict() const override {
    StateDict s;
    s.set_double("best", best_);
    s.set("mode", mode_name(options_.mode()));
    s.set("monitor", options_.monitor());
    if (options_.save_top_k()) {
      Json files = Json::array();
      for (const Saved& f : saved_) {
        // JSON has no NaN: a value that is not finite is saved as null (never the best).
        files.push_back(
            {{"path", f.path}, {"value", std::isfinite(f.value) ? Json(f.value) : Json(nullptr)}});
      }
      s.set("saved", files);
    }
    return s;
  }
  void load_state_dict(const StateDict& s) override {
    if (s.get<std::string>("monitor") != options_.monitor() ||
        s.get<std::string>("mode") != mode_name(options_.mode())) {
      throw Error(ErrorCode::Incompatible,
                  fmt::format("{}: the saved best value is for monitor '{}' mode {}, this "
                              "callback monitors '{}' mode {}",
                              name(), s.get<std::string>("monitor"), s.get<std::string>("mode"),
                              options_.monitor(), mode_name(options_.mode())));
    }
    best_ = s.get_double("best");
    saved_.clear();
    if (s.contains("saved")) {
      for (const Json& f : s.value("saved")) {
        saved_.push_back({f.at("path").get<std::string>(),
                          f.at("value").is_number() ? f.at("value").get<double>()
                                                    : std::numeric_limits<double>::quiet_NaN()});
      }
    }
  }

 private:
  std::string file_for(const Context& ctx, double value) const {
    if (directory_) {
      return join_path(options_.path(), fmt::format("epoch-{:02d}-{}-{:.3f}.ckpt", ctx.epoch,
                                                    options_.monitor(), value));
    }
    // A template: {epoch}, {monitor} (the monitored value, as luz) and every metric of the
    // epoch, by name, each with a format spec if wanted ({epoch:02d}, {monitor:.2f}).
    fmt::dynamic_format_arg_store<fmt::format_context> args;
    args.push_back(fmt::arg("epoch", ctx.epoch));
    args.push_back(fmt::arg("monitor", value));
    for (const auto& [name, v] : ctx.metrics) {
      if (name != "epoch" && name != "monitor") args.push_back(fmt::arg(name.c_str(), v));
    }
    try {
      return fmt::vformat(options_.path(), args);
    } catch (const fmt::format_error& e) {
      std::vector<std::string> fields = {"{epoch}", "{monitor}"};
      for (const auto& [name, v] : ctx.metrics) fields.push_back("{" + name + "}");
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("model_checkpoint path template '{}' cannot be formatted ({}); the "
                              "fields it may use are {}",
                              options_.path(), e.what(), fmt::join(fields, ", ")));
    }
  }

  // With async: waits for the saves in flight (the last one this callback started among them),
  // then applies save_top_k, which must never run before the newest file is committed.
  void finish_previous_save(Context& ctx) {
    ctx.background_saver().wait();
    if (options_.save_top_k()) keep_top_k(*ctx.env);
  }

  // The retention policy of the checkpoint layer over the files this callback wrote, oldest
  // first: the best k by the monitored value, and the newest.
  void keep_top_k(Env& env) {
    std::vector<RetentionEntry> entries;
    for (const Saved& f : saved_) {
      RetentionEntry e;
      e.name = f.path;
      if (!std::isnan(f.value)) e.metric = f.value;
      entries.push_back(std::move(e));
    }
    RetentionPolicy policy = RetentionPolicy()
                                 .best_metric(options_.monitor())
                                 .keep_best(*options_.save_top_k())
                                 .best_mode_max(options_.mode() == Mode::kMax);
    std::vector<RetentionDecision> decisions;
    try {
      decisions = plan_retention(entries, policy);
    } catch (const Error& e) {
      // Swallowed on purpose: no file has a finite value yet, so no best can be told and
      // everything is kept.
      if (e.code() == ErrorCode::NotFound) return;
      throw;
    }
    std::vector<Saved> kept;
    for (std::size_t i = 0; i < saved_.size(); ++i) {
      if (decisions[i].keep) {
        kept.push_back(saved_[i]);
      } else if (env.stat(saved_[i].path).exists) {
        env.remove_file(saved_[i].path);
      }
    }
    saved_ = std::move(kept);
  }

  struct Saved {
    std::string path;
    double value;
  };
  ModelCheckpointOptions options_;
  double best_;
  bool directory_ = false;
  std::vector<Saved> saved_;  // with save_top_k: the files written and kept, oldest first
};

class ResumeFromCheckpoint final : public Callback {
 public:
  explicit ResumeFromCheckpoint(ResumeFromCheckpointOptions options)
      : Callback("resume_from_checkpoint"), options_(std::move(options)) {}
  int order() const override { return kResumeFromCheckpointOrder; }

  void on_fit_begin(Context& ctx) override {
    RestoreOptions what = RestoreOptions()
                              .model(options_.restore_model_state())
                              .optimizer(options_.restore_optimizer_state())
                              .records(options_.restore_records())
                              .callbacks(options_.restore_callbacks_state())
                              .strict_callbacks(false)
                              .position(false);
    const std::string& path = options_.path();
    FileInfo info = ctx.env->stat(path);
    if (!info.exists) {
      // As luz: a first run of a script that resumes "if there is something to resume".
      ctx.warn(
          fmt::format("resume_from_checkpoint: {} does not exist; training starts from "
                      "scratch",
                      path));
      return;
    }
    if (!info.is_directory) {
      restore(ctx, path, what);
      return;
    }
    std::vector<std::pair<std::optional<std::uint64_t>, std::string>> candidates;
    for (const std::string& name : ctx.env->list_dir(path)) {
      if (name.empty() || name[0] == '.' || is_temp_name(name)) continue;
      if (ctx.env->stat(join_path(path, name)).is_directory) continue;
      candidates.emplace_back(checkpoint_number(name), name);
    }
    // Newest first: by checkpoint number as a number (never lexical order), then by name in
    // natural order.
    std::sort(candidates.begin(), candidates.end(), [](const auto& a, const auto& b) {
      if (a.first != b.first) return a.first > b.first;
      return natural_less(b.second, a.second);
    });
    for (const auto& [number, name] : candidates) {
      std::string file = join_path(path, name);
      try {
        restore(ctx, file, what);
        return;
      } catch (const Error& e) {
        if (e.code() != ErrorCode::Corruption && e.code() != ErrorCode::NotFound) throw;
        ctx.warn(fmt::format("skipping invalid checkpoint {}: {}", file, e.what()));
      }
    }
    throw Error(ErrorCode::NotFound,
                fmt::format("resume_from_checkpoint: {} holds no valid checkpoint", path));
  }

 private:
  // Restores `file`; with the records (and counters), the fit then trains its epochs beyond the
  // restored one, as luz does, rather than stopping at its total.
  void restore(Context& ctx, const std::string& file, const RestoreOptions& what) {
    ctx.learner->restore_checkpoint(file, what, ctx.env);
    if (what.records()) ctx.epochs = ctx.learner->counters().epoch + ctx.options->epochs();
  }

  ResumeFromCheckpointOptions options_;
};

class CsvLogger final : public Callback {
 public:
  explicit CsvLogger(CsvLoggerOptions options)
      : Callback(options.name()), options_(std::move(options)) {
    if (options_.path().empty()) {
      throw Error(ErrorCode::InvalidArgument, "csv_logger needs a file path");
    }
  }

  void on_fit_begin(Context&) override {
    // The file is written at the first epoch end: by then a restore (auto_resume runs after
    // this callback's on_fit_begin) has said how much of it to keep.
    bytes_ = 0;
    rows_ = 0;
    restored_ = false;
    started_ = false;
  }

  void on_epoch_end(Context& ctx) override {
    if (!ctx.is_main_process()) return;  // one log of the run, the main process's
    namespace fs = std::filesystem;
    const std::string& path = options_.path();
    if (!started_) {
      ensure_directory(*ctx.env, parent_path(path));
      if (restored_) {
        std::error_code ec;
        auto size = fs::file_size(path, ec);
        if (ec || size < bytes_) {
          throw Error(ErrorCode::NotFound,
                      fmt::format("csv_logger: {} holds fewer bytes than the {} of the "
                                  "checkpoint's {} rows: it was changed or removed since",
                                  path, bytes_, rows_));
        }
        fs::resize_file(path, bytes_);  // rows of epochs the resumed fit repeats go
      } else {
        const std::string first_line = header(ctx);
        std::ofstream(path, std::ios::binary | std::ios::trunc) << first_line;
        bytes_ = first_line.size();
      }
      started_ = true;
    }
    std::string rows;
    for (const std::string& set : sets(ctx)) {
      rows += fmt::format("{},{}", ctx.epoch, set);
      for (const std::string& metric : metric_names(ctx)) {
        auto it = ctx.metrics.find(set + "_" + metric);
        rows += it == ctx.metrics.end() ? std::string(",") : fmt::format(",{}", it->second);
      }
      rows += "\n";
      ++rows_;
    }
    std::ofstream out(path, std::ios::binary | std::ios::app);
    out << rows;
    out.flush();
    if (!out) {
      throw Error(ErrorCode::IOError, fmt::format("csv_logger: cannot write to {}", path));
    }
    bytes_ += rows.size();
  }

  StateDict state_dict() const override {
    StateDict s;
    s.set("bytes", bytes_);
    s.set("rows", rows_);
    return s;
  }
  void load_state_dict(const StateDict& s) override {
    bytes_ = s.get<std::uint64_t>("bytes");
    rows_ = s.get<std::uint64_t>("rows");
    restored_ = true;
  }

 private:
  // "train", then "valid" when the fit records it.
  static std::vector<std::string> sets(const Context& ctx) {
    std::vector<std::string> out;
    for (const std::string& m : ctx.monitors) {
      std::string set = m.substr(0, m.find('_'));
      if (std::find(out.begin(), out.end(), set) == out.end()) out.push_back(set);
    }
    return out;
  }
  // loss, then each metric, in the order the fit records them.
  static std::vector<std::string> metric_names(const Context& ctx) {
    std::vector<std::string> out;
    for (const std::string& m : ctx.monitors) {
      std::string metric = m.substr(m.find('_') + 1);
      if (std::find(out.begin(), out.end(), metric) == out.end()) out.push_back(metric);
    }
    return out;
  }
  static std::string header(const Context& ctx) {
    return fmt::format("epoch,set,{}\n", fmt::join(metric_names(ctx), ","));
  }

  CsvLoggerOptions options_;
  std::uint64_t bytes_ = 0;  // of the file, as of the last epoch end
  std::uint64_t rows_ = 0;
  bool restored_ = false;
  bool started_ = false;
};

class Tfevents final : public Callback {
 public:
  explicit Tfevents(TfeventsOptions options)
      : Callback(options.name()), options_(std::move(options)) {
    if (options_.logdir().empty()) {
      throw Error(ErrorCode::InvalidArgument, "tfevents needs a log directory");
    }
  }
  Tfevents(const Tfevents&) = delete;
  Tfevents& operator=(const Tfevents&) = delete;
  ~Tfevents() override { close(); }

  void on_fit_begin(Context&) override { close(); }
  void on_fit_end(Context&) override { close(); }

  void on_epoch_end(Context& ctx) override {
    if (!ctx.is_main_process()) return;  // one event file of the run, the main process's
    const double now =
        std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
    std::string records;
    if (fd_ < 0) {
      open_file(ctx, now);
      records += detail::tfrecord(detail::event_file_version(now));
      records += detail::tfrecord(detail::event_session_start(now, ctx.epoch));
    }
    std::vector<std::pair<std::string, float>> values;
    for (const std::string& monitor : ctx.monitors) {
      auto it = ctx.metrics.find(monitor);
      if (it == ctx.metrics.end()) continue;
      std::string tag = monitor;
      tag[tag.find('_')] = '/';  // "valid_loss" is "valid/loss"
      values.emplace_back(tag, static_cast<float>(it->second));
    }
    records += detail::tfrecord(detail::event_scalars(now, ctx.epoch, values));
    for (std::size_t done = 0; done < records.size();) {
      ssize_t n = ::write(fd_, records.data() + done, records.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw posix_error("tfevents: write of " + path_, errno);
      done += static_cast<std::size_t>(n);
    }
  }

 private:
  void open_file(Context& ctx, double now) {
    ensure_directory(*ctx.env, options_.logdir());
    // A name of its own, even for fits started in the same second by the same process.
    static std::atomic<int> serial{0};
    for (;;) {
      path_ = options_.logdir() + "/" + detail::event_file_name(now, serial++);
      fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644);
      if (fd_ >= 0) return;
      if (errno != EEXIST) throw posix_error("tfevents: create " + path_, errno);
    }
  }
  void close() {
    if (fd_ >= 0) ::close(fd_);  // written with write(2): nothing buffered to lose
    fd_ = -1;
  }

  TfeventsOptions options_;
  std::string path_;
  int fd_ = -1;
};

class EarlyStopping final : public Callback {
 public:
  explicit EarlyStopping(EarlyStoppingOptions options)
      : Callback(options.name()), options_(std::move(options)), best_(worst(options_.mode())) {
    if (options_.patience() < 0) {
      throw Error(ErrorCode::InvalidArgument, "early_stopping: patience must be >= 0");
    }
  }
  void on_fit_begin(Context& ctx) override {
    check_monitor(ctx, "early_stopping", options_.monitor());
  }
  void on_epoch_end(Context& ctx) override {
    double value = metric_value(ctx, options_.monitor());
    if (improves(value, best_, options_.mode(), options_.min_delta())) {
      best_ = value;
      wait_ = 0;
      return;
    }
    ++wait_;
    if (wait_ >= std::max<std::int64_t>(1, options_.patience())) {
      stopped_epoch_ = ctx.epoch;
      ctx.stop_training();
    }
  }
  StateDict state_dict() const override {
    StateDict s;
    s.set_double("best", best_);
    s.set("wait", wait_);
    s.set("stopped_epoch", stopped_epoch_);
    return s;
  }
  void load_state_dict(const StateDict& s) override {
    double best = s.get_double("best");
    auto wait = s.get<std::int64_t>("wait");
    auto stopped = s.get<std::int64_t>("stopped_epoch");
    best_ = best;
    wait_ = wait;
    stopped_epoch_ = stopped;
  }

 private:
  EarlyStoppingOptions options_;
  double best_;
  std::int64_t wait_ = 0;
  std::int64_t stopped_epoch_ = 0;
};

class LRSchedulerCallback final : public Callback {
 public:
  explicit LRSchedulerCallback(LRSchedulerOptions options)
      : Callback(options.name()), options_(std::move(options)) {
    if (!options_.factory()) {
      throw Error(ErrorCode::InvalidArgument, "lr_scheduler needs a scheduler factory");
    }
  }
  void on_fit_begin(Context& ctx) override {
    const NamedOptimizers& optimizers = *ctx.optimizers;
    attached_ = options_.opt_name();
    if (attached_.empty()) {
      if (optimizers.size() != 1) {
        throw Error(ErrorCode::InvalidArgument,
                    fmt::format("{}: this fit has {} optimizers ({}); say which one the scheduler "
                                "is for with .opt_name(name)",
                                name(), optimizers.size(), fmt::join(optimizers.names(), ", ")));
      }
      attached_ = optimizers.begin()->first;
    } else if (!optimizers.contains(attached_)) {
      throw Error(ErrorCode::InvalidArgument,
                  fmt::format("{}: opt_name '{}' is not an optimizer of this fit (it has: {})",
                              name(), attached_, fmt::join(optimizers.names(), ", ")));
    }
    scheduler_ = options_.factory()(optimizers[attached_]);
  }
  void on_train_batch_end(Context&) override {
    if (options_.step_every_batch()) scheduler_->step();
  }
  void on_epoch_end(Context&) override {
    if (!options_.step_every_batch()) scheduler_->step();
  }
  StateDict state_dict() const override {
    if (!scheduler_) return StateDict();
    StateDict s = scheduler_->state_dict();
    s.set(kOptName, attached_);
    return s;
  }
  void load_state_dict(const StateDict& s) override {
    if (!scheduler_) {
      throw Error(ErrorCode::InvalidArgument,
                  "lr_scheduler: its state can only be restored during a fit");
    }
    if (!s.contains(kOptName)) {  // saved before schedulers recorded their optimizer
      scheduler_->load_state_dict(s);
      return;
    }
    auto saved = s.get<std::string>(kOptName);
    if (saved != attached_) {
      throw Error(ErrorCode::Incompatible,
                  fmt::format("{}: the saved scheduler was attached to optimizer '{}', this "
                              "fit's is attached to '{}'; give it .opt_name(\"{}\") (or give "
                              "the callback another name)",
                              name(), saved, attached_, saved));
    }
    StateDict own = s.clone();
    own.erase(kOptName);
    scheduler_->load_state_dict(own);
  }
  LRScheduler* scheduler() const { return scheduler_.get(); }

 private:
  static constexpr const char* kOptName = "opt_name";
  LRSchedulerOptions options_;
  std::string attached_;  // the name of the optimizer scheduled
  std::unique_ptr<LRScheduler> scheduler_;
};

}  // namespace

CallbackPtr AutoResumeOptions::build() const { return std::make_shared<AutoResume>(*this); }
CallbackPtr ModelCheckpointOptions::build() const {
  return std::make_shared<ModelCheckpoint>(*this);
}
CallbackPtr ResumeFromCheckpointOptions::build() const {
  return std::make_shared<ResumeFromCheckpoint>(*this);
}
CallbackPtr CsvLoggerOptions::build() const { return std::make_shared<CsvLogger>(*this); }
CallbackPtr TfeventsOptions::build() const { return std::make_shared<Tfevents>(*this); }
CallbackPtr EarlyStoppingOptions::build() const { return std::make_shared<EarlyStopping>(*this); }
CallbackPtr LRSchedulerOptions::build() const {
  return std::make_shared<LRSchedulerCallback>(*this);
}

}  // namespace torchpoint::callbacks
