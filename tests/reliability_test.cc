// The reliability suite of issue #7 (reference/reliability.md §3):
//   R3/R4   power cuts at every call of a save, then the same with each fsync and directory
//           fsync of the commit protocol removed in turn: the simulation must catch every removal;
//   R10/R11 truncations and bit flips across every file of a directory checkpoint, manifest
//           included, and load_state()'s fall-back to the previous checkpoint;
//   R9/R15  retention (total_limit 1-3) under a full disk and under kills during the save and
//           during the deletion of old checkpoints, with numbers crossing 9→10 and 99999→100000.
// Every failure names its seed, call index or byte offset so it can be replayed alone.
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <optional>
#include <random>

#include "io/filename.h"
#include "io/posix_error.h"
#include "testing/fault_env.h"
#include "testing/test_util.h"
#include "torchpoint/accelerator.h"
#include "torchpoint/checkpoint_dir.h"
#include "torchpoint/error.h"
#include "torchpoint/tensor_file.h"

namespace torchpoint {
namespace {

// These tests judge durability with the power-cut simulation, not with the disk, so their files
// go to tmpfs when there is one (unless TMPDIR says otherwise): a disk that builds and other
// tests keep busy would make them several times slower and prove nothing more.
[[maybe_unused]] const bool kTmpfs = [] {
  if (std::getenv("TMPDIR") == nullptr && ::access("/dev/shm", W_OK) == 0) {
    ::setenv("TMPDIR", "/dev/shm", 0);
    return true;
  }
  return false;
}();

using testing::FaultEnv;
using testing::Op;
using testing::PowerCutMode;
using testing::TempDir;

constexpr PowerCutMode kModes[] = {PowerCutMode::DropUnsynced, PowerCutMode::RandomPrefix,
                                   PowerCutMode::Garbage};

// On in the *Sharded* variants of the tests (ShardedMode): every Project also prepares a frozen
// backbone, which its checkpoints hold as two shards of their own (the shard size is 2 KiB), so
// each save after the first in one run hard-links them from the checkpoint before: the same
// sweeps then judge sharded, incremental checkpoints.
bool sharded_mode = false;

struct ShardedMode {
  ShardedMode() { sharded_mode = true; }
  ~ShardedMode() { sharded_mode = false; }
};

ProjectConfiguration automatic(const std::string& dir) {
  ProjectConfiguration config =
      ProjectConfiguration().project_dir(dir).automatic_checkpoint_naming(true);
  if (sharded_mode) config.shard_size(2048);
  return config;
}

// A small run whose parameters say which save wrote them: every value derives from a mark,
// and the tests use the checkpoint number as the mark. Without an Env of its own, it writes
// through one whose syncs never reach the disk: here durability is judged by the power-cut
// simulation, and real fsyncs would only make the suite slow.
struct Project {
  FaultEnv fast;
  torch::nn::Linear model{torch::nn::LinearOptions(4, 3)};
  torch::nn::Linear backbone{torch::nn::LinearOptions(32, 32)};  // sharded_mode only: model_1
  Accelerator acc;

  explicit Project(ProjectConfiguration config, Env* env = nullptr)
      : acc(std::move(config), env != nullptr ? *env : fast) {
    fast.set_real_syncs(false);
    acc.prepare(model);
    if (sharded_mode) {
      torch::NoGradGuard no_grad;
      backbone->weight.copy_(testing::make_tensor(at::kFloat, {32, 32}, 4444));
      backbone->bias.copy_(testing::make_tensor(at::kFloat, {32}, 4445));
      for (at::Tensor& p : backbone->parameters()) p.requires_grad_(false);
      acc.prepare(backbone);
    }
  }

  void mark(std::int64_t mark) {
    torch::NoGradGuard no_grad;
    model->weight.copy_(weight_for(mark));
    model->bias.copy_(bias_for(mark));
  }
  bool has_mark(std::int64_t mark) const {
    return testing::bitwise_equal(model->weight, weight_for(mark)) &&
           testing::bitwise_equal(model->bias, bias_for(mark));
  }
  // Saves checkpoint_<iteration> holding that number as its mark.
  std::string save() {
    mark(acc.project_configuration().iteration());
    return acc.save_state();
  }
  std::vector<std::int64_t> numbers() const {
    std::vector<std::int64_t> out;
    for (const auto& [n, path] : acc.list_checkpoints()) out.push_back(n);
    return out;
  }

  static at::Tensor weight_for(std::int64_t mark) {
    return testing::make_tensor(at::kFloat, {3, 4}, static_cast<std::uint64_t>(mark));
  }
  static at::Tensor bias_for(std::int64_t mark) {
    return testing::make_tensor(at::kFloat, {3}, static_cast<std::uint64_t>(mark) + 7777777);
  }
};

std::int64_t number_of(const std::string& path) {
  auto n = parse_checkpoint_name(base_name(path));
  return n ? static_cast<std::int64_t>(*n) : -1;
}

std::vector<std::string> temporaries(const std::string& dir) {
  std::vector<std::string> out;
  if (!Env::posix().stat(dir).exists) return out;
  for (const std::string& name : testing::list_sorted(dir)) {
    if (is_temp_name(name)) out.push_back(name);
  }
  return out;
}

// Captures what the library writes to stderr (load_state's warnings) for as long as it lives.
class StderrCapture {
 public:
  StderrCapture() { ::testing::internal::CaptureStderr(); }
  ~StderrCapture() {
    if (!taken_) ::testing::internal::GetCapturedStderr();
  }
  std::string take() {
    taken_ = true;
    return ::testing::internal::GetCapturedStderr();
  }

 private:
  bool taken_ = false;
};

// ---------------------------------------------------------------------------------------------
// R3 / R4: power cuts, with and without each barrier.

// Thrown by the before-op hook: the machine loses power before that call, and every later call
// (the save's own cleanup included) fails the same way, so nothing runs after the cut.
struct PowerCut {};

enum class Verdict {
  Ok,        // the newest checkpoint a save reported committed loads, and nothing torn is visible
  Detected,  // that promise is broken, but the library notices (missing, or refused as invalid)
  Silent,    // wrong data was accepted: always a failure
};

struct Check {
  Verdict verdict = Verdict::Ok;
  std::string why;
};

// Runs one or more saves through `env`; `reported` counts the saves that returned.
using Scenario = std::function<void(const std::string& root, Env& env, int& reported)>;
// Judges what a power cut left, knowing how many saves had returned before it.
using Checker = std::function<Check(const std::string& root, int reported)>;

struct Barrier {
  Op op;
  std::uint64_t nth;   // among the calls of `op` in the scenario
  std::uint64_t call;  // index (1-based) of that call among all calls of the scenario
  std::string path;
  // The next barrier syncs the same directory again, before anything else is made durable: no
  // power cut can tell whether this one happened (the commit's sync of the checkpoints
  // directory, when retention renames an old checkpoint away and syncs it right after).
  bool masked = false;
};

std::string describe(const Barrier& b) {
  return fmt::format("{} #{} (call {}, {})", op_name(b.op), b.nth, b.call, b.path);
}

// Runs the scenario once without faults and lists its barriers in order.
std::vector<Barrier> barriers_of(const Scenario& scenario) {
  TempDir dir;
  FaultEnv env;
  int reported = 0;
  env.set_real_syncs(false);
  scenario(dir.path(), env, reported);
  std::vector<Barrier> out;
  std::uint64_t syncs = 0, dir_syncs = 0;
  std::vector<std::string> log = env.log();
  for (std::size_t i = 0; i < log.size(); ++i) {
    const std::string& line = log[i];
    if (line.starts_with("sync ")) out.push_back({Op::Sync, ++syncs, i + 1, line.substr(5)});
    if (line.starts_with("sync_dir ")) {
      out.push_back({Op::SyncDir, ++dir_syncs, i + 1, line.substr(9)});
    }
  }
  for (std::size_t i = 0; i + 1 < out.size(); ++i) {
    out[i].masked =
        out[i].op == Op::SyncDir && out[i + 1].op == Op::SyncDir && out[i].path == out[i + 1].path;
  }
  return out;
}

struct SweepStats {
  std::uint64_t cuts = 0;
  std::uint64_t detected = 0;
  std::string first;  // the first cut that exposed a dropped barrier, for the report
};

// Cuts the power before every call of `scenario` (and once after its end), in each of the three
// modes, then asks `checker`. Without `drop`, every cut must leave an Ok state; with it, cuts
// start after the dropped call (earlier ones cannot tell the difference), and none may be
// Silent.
SweepStats sweep(const std::string& label, const Scenario& scenario, const Checker& checker,
                 const std::optional<Barrier>& drop) {
  SweepStats stats;
  for (PowerCutMode mode : kModes) {
    for (std::uint64_t k = drop ? drop->call + 1 : 1;; ++k) {
      const std::uint64_t seed = k * 7919 + static_cast<std::uint64_t>(mode);
      const std::string where = fmt::format(
          "{}: power cut ({}, seed {}) before call {}{}", label, power_cut_mode_name(mode), seed, k,
          drop ? fmt::format(", with sync {} dropped", describe(*drop)) : "");
      TempDir dir;
      FaultEnv env;
      env.set_real_syncs(false);
      if (drop) env.drop_nth_barrier(drop->op, drop->nth);
      // Atomic: a sharded save calls the Env from several threads.
      std::atomic<std::uint64_t> seen{0};
      std::atomic<bool> cut{false};
      env.set_before_op([&](Op, const std::string&) {
        if (++seen >= k) {
          cut = true;
          throw PowerCut{};
        }
      });
      int reported = 0;
      try {
        scenario(dir.path(), env, reported);
      } catch (const PowerCut&) {
      }
      env.set_before_op(nullptr);
      env.simulate_power_cut(mode, seed);
      ++stats.cuts;
      Check c = checker(dir.path(), reported);
      EXPECT_NE(c.verdict, Verdict::Silent) << where << ": " << c.why;
      if (!drop) {
        EXPECT_EQ(c.verdict, Verdict::Ok) << where << ": " << c.why;
      }
      if (c.verdict != Verdict::Ok) {
        ++stats.detected;
        if (stats.first.empty()) stats.first = where + ": " + c.why;
      }
      if (!cut) break;
      if (k > 5000) {
        ADD_FAILURE() << where << ": the scenario never ends";
        break;
      }
    }
  }
  return stats;
}

// Runs the sweep with every barrier present, then with each one removed, and expects the
// first to find nothing and each of the others to find a broken promise.
void expect_every_barrier_matters(const std::string& label, const Scenario& scenario,
                                  const Checker& checker, std::size_t min_barriers) {
  std::vector<Barrier> barriers = barriers_of(scenario);
  ASSERT_GE(barriers.size(), min_barriers) << label;
  SweepStats intact = sweep(label, scenario, checker, std::nullopt);
  EXPECT_EQ(intact.detected, 0u) << intact.first;
  std::uint64_t cuts = intact.cuts, caught = 0, masked = 0;
  for (const Barrier& b : barriers) {
    SweepStats s = sweep(label, scenario, checker, b);
    cuts += s.cuts;
    if (b.masked) {
      ++masked;
      std::printf(
          "  %s: removed %s -> masked, the next barrier syncs the same directory (%llu "
          "of %llu cuts noticed)\n",
          label.c_str(), describe(b).c_str(), static_cast<unsigned long long>(s.detected),
          static_cast<unsigned long long>(s.cuts));
      continue;
    }
    EXPECT_GT(s.detected, 0u) << label << ": removing sync " << describe(b) << " went unnoticed by "
                              << s.cuts << " power cuts";
    if (s.detected > 0) {
      ++caught;
      std::printf("  %s: removed %s -> caught by %llu of %llu cuts, first: %s\n", label.c_str(),
                  describe(b).c_str(), static_cast<unsigned long long>(s.detected),
                  static_cast<unsigned long long>(s.cuts), s.first.c_str());
    }
  }
  EXPECT_LE(masked, 1u) << label;
  std::printf(
      "%s: %llu power cuts simulated (%llu with every barrier, 0 violations); %zu barriers "
      "removed one at a time, %llu caught, %llu masked by the next barrier\n",
      label.c_str(), static_cast<unsigned long long>(cuts),
      static_cast<unsigned long long>(intact.cuts), barriers.size(),
      static_cast<unsigned long long>(caught), static_cast<unsigned long long>(masked));
}

// Directory checkpoints through the Accelerator: the first save creates the project's
// directories, the second commits checkpoint_1 and then deletes checkpoint_0 (total_limit 1).
void two_accelerator_saves(const std::string& root, Env& env, int& reported) {
  Project p(automatic(root + "/proj").total_limit(1), &env);
  for (int i = 0; i < 2; ++i) {
    p.save();
    ++reported;
  }
}

Check check_project(const std::string& root, int reported) {
  Project p(automatic(root + "/proj"));
  Check c;
  // A final name holds a whole checkpoint or nothing: a directory there without its manifest is
  // a deleted checkpoint come back in part (nothing would ever clean it up).
  const std::string checkpoints = root + "/proj/checkpoints";
  if (Env::posix().stat(checkpoints).exists) {
    for (const std::string& name : testing::list_sorted(checkpoints)) {
      if (parse_checkpoint_name(name) &&
          !Env::posix().stat(checkpoints + "/" + name + "/manifest.json").exists) {
        c = {Verdict::Detected,
             fmt::format("{}/{} is left without a manifest under a final name", checkpoints, name)};
      }
    }
  }
  for (const auto& [n, path] : p.acc.list_checkpoints()) {
    VerifyReport v = verify(path);
    if (!v.ok()) {
      c = {Verdict::Detected,
           fmt::format("{} looks committed but is invalid: {}", path, v.problems.front())};
    }
  }
  std::int64_t loaded = -1;
  {
    StderrCapture quiet;  // warnings about skipped checkpoints are expected here
    try {
      loaded = number_of(p.acc.load_state().path);
    } catch (const Error& e) {
      if (e.code() != ErrorCode::NotFound) {
        return {Verdict::Detected, fmt::format("load_state refused: {}", e.what())};
      }
    }
  }
  if (loaded >= 0 && !p.has_mark(loaded)) {
    return {Verdict::Silent,
            fmt::format("load_state accepted checkpoint_{} but restored other parameters", loaded)};
  }
  const std::int64_t newest = reported - 1;
  if (loaded < newest) {
    c = {Verdict::Detected,
         fmt::format("checkpoint_{} was reported committed, but load_state {}", newest,
                     loaded < 0 ? std::string("found no checkpoint")
                                : fmt::format("fell back to checkpoint_{}", loaded))};
  }
  return c;
}

TEST(Barriers, PowerCutsCatchEveryMissingSyncOfADirectoryCheckpoint) {
  // 2 saves x (2 files + manifest) file syncs; directory syncs: 2 new project directories,
  // 2 x (temporary + parent), 1 for the deletion of checkpoint_0.
  expect_every_barrier_matters("directory (Accelerator::save_state)", two_accelerator_saves,
                               check_project, 11);
}

TEST(Barriers, PowerCutsCatchEveryMissingSyncOfAShardedIncrementalCheckpoint) {
  ShardedMode sharded;
  // As above, plus the backbone's two shards and index in the first save and its index in the
  // second, whose shards are links: new directory entries made durable by the temporary's sync.
  expect_every_barrier_matters("sharded directory (links in the second save)",
                               two_accelerator_saves, check_project, 15);
}

// File checkpoints: state.ckpt written, then replaced (the luz auto-resume file).
at::Tensor file_tensor(int version) {
  return testing::make_tensor(at::kFloat, {257}, 1000 + static_cast<std::uint64_t>(version));
}

void two_file_saves(const std::string& root, Env& env, int& reported) {
  for (int v = 0; v < 2; ++v) {
    save_file(root + "/state.ckpt", {{{"w", file_tensor(v)}}, {{"version", v}}}, env);
    ++reported;
  }
}

Check check_file(const std::string& root, int reported) {
  const std::string path = root + "/state.ckpt";
  const int newest = reported - 1;
  if (!Env::posix().stat(path).exists) {
    if (newest < 0) return {};
    return {Verdict::Detected,
            fmt::format("version {} was reported saved but {} is missing", newest, path)};
  }
  Container c;
  try {
    c = load_file(path);
  } catch (const Error& e) {
    return {Verdict::Detected, fmt::format("{} is refused: {}", path, e.what())};
  }
  int v = c.state.value("version", -1);
  if (v < 0 || c.tensors.size() != 1 ||
      !testing::bitwise_equal(c.tensors[0].second, file_tensor(v))) {
    return {Verdict::Silent, fmt::format("{} loaded with contents no save wrote", path)};
  }
  if (v < newest) {
    return {Verdict::Detected,
            fmt::format("version {} was reported saved but {} holds version {}", newest, path, v)};
  }
  return {};
}

TEST(Barriers, PowerCutsCatchEveryMissingSyncOfAFileCheckpoint) {
  // Per save: the file's sync and the directory sync after the rename.
  expect_every_barrier_matters("file (save_file)", two_file_saves, check_file, 4);
}

// ---------------------------------------------------------------------------------------------
// R10 / R11: corruption sweeps over every file of a directory checkpoint.

struct Counter {
  std::int64_t value = 0;
  StateDict state_dict() const {
    StateDict s;
    s.set("value", Json(value));
    s.set("history", testing::make_tensor(at::kDouble, {5}, static_cast<std::uint64_t>(value)));
    return s;
  }
  void load_state_dict(const StateDict& s) { value = s.get<std::int64_t>("value"); }
};

void corruption_sweep() {
  TempDir dir;
  const std::string project = dir / "proj";
  Counter counter;
  {
    Project p(automatic(project));
    p.acc.register_for_checkpointing(counter);
    counter.value = 100;
    p.save();  // checkpoint_0
    counter.value = 101;
    p.save();  // checkpoint_1: the one we damage
  }
  const std::string target = project + "/checkpoints/checkpoint_1";
  const DirectoryCheckpoint reference = load_directory(target);
  std::vector<std::string> files = testing::list_sorted(target);
  ASSERT_NE(std::find(files.begin(), files.end(), "manifest.json"), files.end());
  ASSERT_GE(files.size(), 4u);  // model, custom_checkpoint_0, random_states_0, manifest

  // Every damaged state must be refused by load_directory (Corruption) and by verify, and
  // load_state must fall back to checkpoint_0, naming checkpoint_1 in its warning.
  std::uint64_t fallbacks = 0;
  const std::string previous = project + "/checkpoints/checkpoint_0";
  // A shard that checkpoint_1 shares with checkpoint_0 (a hard link) is damaged in both.
  bool shared = false;
  auto expect_detected = [&](const std::string& what, std::uint64_t index) {
    SCOPED_TRACE(what);
    try {
      DirectoryCheckpoint loaded = load_directory(target);
      ADD_FAILURE() << what << ": load_directory accepted the damaged checkpoint";
      return false;
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::Corruption) << what << ": " << e.what();
      if (e.code() != ErrorCode::Corruption) return false;
    }
    if (verify(target).ok()) {
      ADD_FAILURE() << what << ": verify passed the damaged checkpoint";
      return false;
    }
    if (shared) {
      if (verify(previous).ok()) {
        ADD_FAILURE() << what << ": a shard shared with " << previous << " was damaged, but "
                      << previous << " verifies";
        return false;
      }
      return true;
    }
    // load_state's fall-back is slower (it restores a model): every 7th case is enough.
    if (index % 7 == 0) {
      Counter restored;
      Project p(automatic(project));
      p.acc.register_for_checkpointing(restored);
      StderrCapture capture;
      LoadStateReport r = p.acc.load_state();
      std::string warnings = capture.take();
      EXPECT_EQ(r.path, project + "/checkpoints/checkpoint_0") << what;
      EXPECT_TRUE(p.has_mark(0)) << what;
      EXPECT_EQ(restored.value, 100) << what;
      EXPECT_EQ(r.skipped.size(), 1u) << what;
      EXPECT_NE(warnings.find("skipping invalid checkpoint " + target), std::string::npos)
          << what << ": the warning must name the bad checkpoint; stderr was: " << warnings;
      ++fallbacks;
    }
    return true;
  };

  const std::uint64_t per_file_truncations = (520 + files.size() - 1) / files.size();
  const std::uint64_t per_file_flips = (1040 + files.size() - 1) / files.size();
  const std::uint64_t per_file_blocks = 10;
  std::uint64_t truncations = 0, truncations_detected = 0;
  std::uint64_t flips = 0, flips_detected = 0;
  std::uint64_t blocks = 0, blocks_detected = 0;
  std::uint64_t index = 0;
  for (std::size_t f = 0; f < files.size(); ++f) {
    const std::string path = target + "/" + files[f];
    shared = testing::file_link_count(path) > 1;
    if (sharded_mode && files[f].find("-of-") != std::string::npos) {
      EXPECT_TRUE(shared) << path << " should be a link to checkpoint_0's shard";
    }
    const std::string pristine = testing::read_bytes(path);
    const std::uint64_t size = pristine.size();
    ASSERT_GT(size, 1u) << path;
    const std::uint64_t seed = 4242 + f;
    std::mt19937_64 rng(seed);

    // Truncations: 0, 1, size-1 and the rest spread evenly with a random jitter.
    std::set<std::uint64_t> lengths = {0, 1, size - 1};
    for (std::uint64_t i = 0; lengths.size() < std::min(per_file_truncations, size); ++i) {
      std::uint64_t spread = size * (i % per_file_truncations) / per_file_truncations;
      lengths.insert(std::min(size - 1, spread + rng() % 8));
    }
    for (std::uint64_t len : lengths) {
      testing::truncate_to(path, len);
      ++truncations;
      if (expect_detected(
              fmt::format("{} truncated to {} of {} bytes (seed {})", files[f], len, size, seed),
              ++index)) {
        ++truncations_detected;
      }
      testing::write_bytes(path, pristine);
    }

    // Single-bit flips at random offsets (the first and last byte always among them).
    for (std::uint64_t i = 0; i < per_file_flips; ++i) {
      std::uint64_t offset = i == 0 ? 0 : i == 1 ? size - 1 : rng() % size;
      int bit = static_cast<int>(rng() % 8);
      testing::flip_bit(path, offset, bit);
      ++flips;
      if (expect_detected(fmt::format("{}: bit {} of byte {} flipped (flip {}, seed {})", files[f],
                                      bit, offset, i, seed),
                          ++index)) {
        ++flips_detected;
      }
      testing::write_bytes(path, pristine);
    }

    // 4 KiB of garbage (the whole file when smaller) at a random place.
    for (std::uint64_t i = 0; i < per_file_blocks; ++i) {
      std::string damaged = pristine;
      std::uint64_t len = std::min<std::uint64_t>(4096, size);
      std::uint64_t at = rng() % (size - len + 1);
      for (std::uint64_t j = 0; j < len; ++j) damaged[at + j] = static_cast<char>(rng());
      if (damaged == pristine) continue;
      testing::write_bytes(path, damaged);
      ++blocks;
      if (expect_detected(fmt::format("{}: {} garbage bytes at {} (block {}, seed {})", files[f],
                                      len, at, i, seed),
                          ++index)) {
        ++blocks_detected;
      }
      testing::write_bytes(path, pristine);
    }
  }
  // The pristine checkpoint is intact again, and it was never the reason for a failure.
  DirectoryCheckpoint again = load_directory(target);
  ASSERT_EQ(again.components.size(), reference.components.size());
  EXPECT_GE(truncations, 500u);
  EXPECT_GE(flips, 1000u);
  EXPECT_EQ(truncations_detected, truncations);
  EXPECT_EQ(flips_detected, flips);
  EXPECT_EQ(blocks_detected, blocks);
  std::printf(
      "corruption sweep over %zu files of a directory checkpoint: %llu/%llu truncations, "
      "%llu/%llu bit flips, %llu/%llu 4 KiB garbage blocks detected; load_state fell back to "
      "the previous checkpoint with a warning in %llu sampled cases\n",
      files.size(), static_cast<unsigned long long>(truncations_detected),
      static_cast<unsigned long long>(truncations), static_cast<unsigned long long>(flips_detected),
      static_cast<unsigned long long>(flips), static_cast<unsigned long long>(blocks_detected),
      static_cast<unsigned long long>(blocks), static_cast<unsigned long long>(fallbacks));
}

TEST(Corruption, TruncationsAndBitFlipsOfEveryFileAreDetectedAndLoadStateFallsBack) {
  corruption_sweep();
}

// The same over a checkpoint whose backbone shards are hard links to the previous checkpoint's:
// damage to those shows in both, and verify reports it in both.
TEST(Corruption, TruncationsAndBitFlipsOfEveryFileOfAShardedIncrementalCheckpoint) {
  ShardedMode sharded;
  corruption_sweep();
}

// ---------------------------------------------------------------------------------------------
// R9 / R15: retention under a full disk and under kills.

// Thrown by the before-op hook: the process dies before that call, and no later call runs.
struct Killed {};

// A project holding checkpoint_<base-n> .. checkpoint_<base-1>, saved with total_limit n.
void make_history(const std::string& project, std::int64_t n, std::int64_t base) {
  Project p(automatic(project).total_limit(n).iteration(base - n));
  for (std::int64_t i = 0; i < n; ++i) p.save();
}

std::vector<std::int64_t> range(std::int64_t from, std::int64_t to) {  // [from, to]
  std::vector<std::int64_t> out;
  for (std::int64_t i = from; i <= to; ++i) out.push_back(i);
  return out;
}

std::uint64_t checkpoint_bytes(const std::string& path) {
  std::uint64_t total = 0;
  for (const std::string& name : testing::list_sorted(path)) {
    total += testing::file_size(path + "/" + name);
  }
  return total;
}

// What must hold after any failed or interrupted save of checkpoint_<base> into a project that
// held checkpoint_<base-n> .. checkpoint_<base-1>: every listed checkpoint verifies, and the
// list is the old one, the old one plus the new, or (after retention) the new window. Returns
// every way this does not hold.
std::vector<std::string> retention_violations(const std::string& project, std::int64_t n,
                                              std::int64_t base) {
  std::vector<std::string> out;
  Project look(automatic(project));
  for (const auto& [number, path] : look.acc.list_checkpoints()) {
    VerifyReport v = verify(path);
    if (!v.ok()) out.push_back(path + " looks committed but is invalid: " + v.problems.front());
  }
  const std::vector<std::int64_t> numbers = look.numbers();
  if (numbers.empty() || numbers.back() < base - 1) {
    out.push_back(fmt::format("the newest valid checkpoint, checkpoint_{}, was deleted", base - 1));
  }
  if (numbers != range(base - n, base - 1) && numbers != range(base - n, base) &&
      numbers != range(base - n + 1, base)) {
    out.push_back(fmt::format("checkpoints left: {}", fmt::join(numbers, ", ")));
  }
  return out;
}

// After retention_violations() found nothing, a restarted run resumes from the newest, saves
// the next checkpoint, sweeps every leftover and keeps at most n, the new one among them.
void expect_recovers(const std::string& project, std::int64_t n, std::int64_t base) {
  const std::string checkpoints = project + "/checkpoints";
  EXPECT_EQ(retention_violations(project, n, base), std::vector<std::string>{});
  std::vector<std::int64_t> numbers = Project(automatic(project)).numbers();
  ASSERT_FALSE(numbers.empty());
  const std::int64_t newest = numbers.back();

  Project restarted(automatic(project).total_limit(n));
  LoadStateReport r;
  {
    StderrCapture quiet;
    r = restarted.acc.load_state();
  }
  EXPECT_EQ(r.path, checkpoints + "/" + checkpoint_name(newest));
  EXPECT_TRUE(restarted.has_mark(newest)) << r.path;
  EXPECT_EQ(restarted.save(), checkpoints + "/" + checkpoint_name(newest + 1));
  EXPECT_EQ(temporaries(checkpoints), std::vector<std::string>{});
  std::vector<std::int64_t> kept = restarted.numbers();
  EXPECT_TRUE(std::is_sorted(kept.begin(), kept.end()));
  EXPECT_LE(kept.size(), static_cast<std::size_t>(n));
  EXPECT_EQ(kept.back(), newest + 1);
  for (const auto& [number, path] : restarted.acc.list_checkpoints()) {
    EXPECT_TRUE(verify(path).ok()) << path;
  }
}

TEST(Retention, DiskFullAtEveryBudgetNeverCostsTheNewestCheckpoint) {
  std::uint64_t runs = 0, failed_saves = 0;
  for (std::int64_t n : {1, 2, 3}) {
    for (std::int64_t base : {10, 100000}) {
      // The size of checkpoint_<base> (its manifest is longer than checkpoint_<base-1>'s).
      std::uint64_t one = 0;
      {
        TempDir scratch;
        Project p(automatic(scratch.path()).iteration(base));
        one = checkpoint_bytes(p.save());
      }
      for (int percent = 0; percent <= 100; percent += 5) {
        SCOPED_TRACE(
            fmt::format("total_limit {}, saving checkpoint_{}, byte budget {}%", n, base, percent));
        TempDir dir;
        const std::string project = dir / "proj";
        make_history(project, n, base);
        FaultEnv env;
        env.set_real_syncs(false);
        env.set_byte_budget(one * static_cast<std::uint64_t>(percent) / 100);
        bool committed = false;
        {
          Project p(automatic(project).total_limit(n).iteration(base), &env);
          try {
            p.save();
            committed = true;
          } catch (const Error& e) {
            EXPECT_EQ(e.code(), ErrorCode::IOError) << e.what();
            EXPECT_NE(std::string(e.what()).find("byte budget spent"), std::string::npos)
                << e.what();
            ++failed_saves;
          }
        }
        // A checkpoint needs all of its bytes: it commits exactly when they all fit.
        EXPECT_EQ(committed, percent == 100);
        // Nothing was deleted to make room, and the failed save left no temporary.
        Project look(automatic(project));
        EXPECT_EQ(look.numbers(),
                  committed ? range(base - n + 1, base) : range(base - n, base - 1));
        EXPECT_EQ(temporaries(project + "/checkpoints"), std::vector<std::string>{});
        expect_recovers(project, n, base);
        ++runs;
      }
    }
  }
  std::printf(
      "disk full: %llu saves under byte budgets of 0-100%% (total_limit 1-3), %llu "
      "refused with ENOSPC, 0 checkpoints lost\n",
      static_cast<unsigned long long>(runs), static_cast<unsigned long long>(failed_saves));
}

void killed_at_every_call() {
  std::uint64_t kills = 0, during_deletion = 0;
  std::atomic<std::uint64_t> linked{0};  // the hook runs on the save's threads
  for (std::int64_t n : {1, 2, 3}) {
    for (std::int64_t base : {10, 100000}) {
      for (std::uint64_t k = 1;; ++k) {
        SCOPED_TRACE(
            fmt::format("total_limit {}, saving checkpoint_{}, killed before call {}", n, base, k));
        TempDir dir;
        const std::string project = dir / "proj";
        make_history(project, n, base);
        FaultEnv env;
        env.set_real_syncs(false);
        std::atomic<std::uint64_t> seen{0};
        std::atomic<bool> killed{false}, deleting{false};
        auto hook = [&](Op op, const std::string& path) {
          // Retention renames a committed checkpoint away before removing it.
          if (op == Op::Rename && parse_checkpoint_name(base_name(path))) deleting = true;
          if (op == Op::Link) ++linked;
          if (++seen >= k) {
            killed = true;
            throw Killed{};
          }
        };
        if (!sharded_mode) env.set_before_op(hook);
        {
          Project p(automatic(project).total_limit(n).iteration(base), &env);
          if (sharded_mode) {
            // A resumed run, whose save links the backbone's shards from the one it loaded
            // while retention deletes the oldest checkpoints.
            StderrCapture quiet;
            p.acc.load_state();
            env.set_before_op(hook);
          }
          try {
            p.save();
          } catch (const Killed&) {
          }
        }
        env.set_before_op(nullptr);
        expect_recovers(project, n, base);
        if (!killed) break;
        ++kills;
        if (deleting) ++during_deletion;
        if (k > 2000) {
          ADD_FAILURE() << "the save never ends";
          break;
        }
      }
    }
  }
  EXPECT_GT(during_deletion, 0u);
  if (sharded_mode) {
    EXPECT_GT(linked.load(), 0u);
  }
  std::printf(
      "kills: %llu (total_limit 1-3, checkpoint numbers crossing 9->10 and "
      "99999->100000), %llu of them while deleting old checkpoints, %llu shard links made; "
      "every restart resumed from the newest valid checkpoint\n",
      static_cast<unsigned long long>(kills), static_cast<unsigned long long>(during_deletion),
      static_cast<unsigned long long>(linked.load()));
}

TEST(Retention, KilledAtEveryCallOfASaveAndItsDeletionsKeepsTheNewest) { killed_at_every_call(); }

TEST(Retention, KilledAtEveryCallOfAShardedSaveThatLinksKeepsTheNewest) {
  ShardedMode sharded;
  killed_at_every_call();
}

// The checks above can fail: Accelerate's order (delete the oldest checkpoint to make room, then
// save) under the same full disk breaks them for every total_limit.
TEST(Retention, ChecksCatchDeletingBeforeTheNewCheckpointIsCommitted) {
  for (std::int64_t n : {1, 2, 3}) {
    SCOPED_TRACE(fmt::format("total_limit {}", n));
    TempDir dir;
    const std::string project = dir / "proj";
    const std::int64_t base = 10;
    make_history(project, n, base);
    EXPECT_EQ(retention_violations(project, n, base), std::vector<std::string>{});
    Env::posix().remove_all(project + "/checkpoints/" + checkpoint_name(base - n));
    FaultEnv env;
    env.set_real_syncs(false);
    env.set_byte_budget(100);
    Project p(automatic(project).iteration(base), &env);
    EXPECT_THROW(p.save(), Error);
    EXPECT_NE(retention_violations(project, n, base), std::vector<std::string>{});
  }
}

}  // namespace
}  // namespace torchpoint

// ---------------------------------------------------------------------------------------------
// Hostile files (#12): a newest checkpoint that cannot be read, or that this build cannot judge,
// is never passed over quietly and never deleted by retention; only one its own checksums prove
// corrupt is (the control, which shows the sweep tells the two apart).

namespace torchpoint {
namespace {

enum class Hostile {
  Fifo,              // a FIFO where a file belongs (before: every reader blocked in open)
  Socket,            // a Unix socket there
  Directory,         // a directory there
  LinkToCopy,        // a symbolic link to an intact copy outside the checkpoint
  LinkOutside,       // a symbolic link to some other file
  PermissionDenied,  // EACCES on open (this suite runs as root, where chmod denies nothing)
  ReadError,         // EIO on read, as a failing disk gives
  NewerVersion,      // a manifest of format version 9 (resealed): from a newer torchpoint
  BitFlip,           // control: a flipped bit, proven corrupt by its checksum
};

const char* hostile_name(Hostile h) {
  constexpr const char* kNames[] = {"fifo",         "socket",        "directory",
                                    "link-to-copy", "link-outside",  "permission-denied",
                                    "read-error",   "newer-version", "bit-flip (control)"};
  return kNames[static_cast<int>(h)];
}

void make_socket(const std::string& path) {
  int fd = ::socket(AF_UNIX, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  ASSERT_LT(path.size(), sizeof addr.sun_path) << path;
  std::memcpy(addr.sun_path, path.c_str(), path.size() + 1);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0) << path;
  ::close(fd);  // the socket file stays
}

// Makes `file` hostile; an Env-level kind installs its fault in `env` instead.
void make_hostile(Hostile h, const std::string& file, const std::string& outside, FaultEnv& env) {
  const std::string pristine = testing::read_bytes(file);
  switch (h) {
    case Hostile::Fifo:
      ASSERT_EQ(::unlink(file.c_str()), 0);
      ASSERT_EQ(::mkfifo(file.c_str(), 0644), 0);
      return;
    case Hostile::Socket:
      ASSERT_EQ(::unlink(file.c_str()), 0);
      make_socket(file);
      return;
    case Hostile::Directory:
      ASSERT_EQ(::unlink(file.c_str()), 0);
      ASSERT_EQ(::mkdir(file.c_str(), 0755), 0);
      return;
    case Hostile::LinkToCopy:
    case Hostile::LinkOutside:
      testing::write_bytes(outside, h == Hostile::LinkToCopy ? pristine : "private bytes");
      ASSERT_EQ(::unlink(file.c_str()), 0);
      ASSERT_EQ(::symlink(outside.c_str(), file.c_str()), 0);
      return;
    case Hostile::PermissionDenied:
    case Hostile::ReadError: {
      const Op op = h == Hostile::ReadError ? Op::Read : Op::Open;
      const int err = h == Hostile::ReadError ? EIO : EACCES;
      env.set_before_op([file, op, err](Op o, const std::string& path) {
        if (o == op && path == file)
          throw posix_error(fmt::format("{} of {}", op_name(o), path), err);
      });
      return;
    }
    case Hostile::NewerVersion:
      testing::make_manifest_newer(file);
      return;
    case Hostile::BitFlip:
      testing::flip_bit(file, testing::file_size(file) - 20, 3);
      return;
  }
}

TEST(HostileFiles, TheNewestCheckpointIsNeverPassedOverOrDeletedUnlessProvenCorrupt) {
  const std::vector<Hostile> kinds = {
      Hostile::Fifo,       Hostile::Socket,       Hostile::Directory,
      Hostile::LinkToCopy, Hostile::LinkOutside,  Hostile::PermissionDenied,
      Hostile::ReadError,  Hostile::NewerVersion, Hostile::BitFlip};
  for (const char* role : {"manifest.json", "model.safetensors"}) {
    for (Hostile h : kinds) {
      if (h == Hostile::NewerVersion && std::string(role) != "manifest.json") continue;
      SCOPED_TRACE(fmt::format("{} is {}", role, hostile_name(h)));
      TempDir dir;
      const std::string project = dir / "proj";
      const std::string newest = project + "/checkpoints/checkpoint_2";
      {
        Project p(automatic(project).total_limit(3));
        for (int i = 0; i < 3; ++i) p.save();  // checkpoint_0 .. checkpoint_2
      }
      FaultEnv env;
      make_hostile(h, newest + "/" + role, dir / "outside", env);
      const bool proven_corrupt = h == Hostile::BitFlip;
      ::alarm(60);  // a reader that blocks (on a FIFO) kills the suite instead of hanging it

      // 1. load_state() of the latest: an error naming the newest checkpoint, nothing loaded;
      //    the control falls back to checkpoint_1.
      {
        Project fresh(automatic(project).total_limit(2), &env);
        StderrCapture capture;
        if (proven_corrupt) {
          EXPECT_EQ(fresh.acc.load_state().path, project + "/checkpoints/checkpoint_1");
          EXPECT_TRUE(fresh.has_mark(1));
        } else {
          try {
            fresh.acc.load_state();
            ADD_FAILURE() << "load_state passed over " << newest;
          } catch (const Error& e) {
            EXPECT_NE(std::string(e.what()).find(newest), std::string::npos) << e.what();
            EXPECT_EQ(std::string(e.what()).find("private bytes"), std::string::npos) << e.what();
          }
          EXPECT_FALSE(fresh.has_mark(1) || fresh.has_mark(2)) << "a failed load loads nothing";
        }
      }
      // 2. Resumed explicitly from checkpoint_1, a save with total_limit 2 keeps checkpoint_2,
      //    which holds progress this run lacks, and deletes the oldest; the control deletes the
      //    corrupt checkpoint_2 first.
      {
        Project older(automatic(project).total_limit(2), &env);
        older.acc.load_state(project + "/checkpoints/checkpoint_1");
        EXPECT_EQ(older.save(), project + "/checkpoints/checkpoint_3");
        std::vector<std::string> expected = {".lock", "checkpoint_2", "checkpoint_3"};
        if (proven_corrupt) expected = {".lock", "checkpoint_1", "checkpoint_3"};
        EXPECT_EQ(testing::list_sorted(project + "/checkpoints"), expected);
      }
      ::alarm(0);
    }
  }
}

}  // namespace
}  // namespace torchpoint
