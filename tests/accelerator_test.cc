// The Accelerator front door: Accelerate's documented behaviour, and what Accelerate gets wrong.
#include "torchpoint/accelerator.h"

#include <torch/torch.h>

#include <filesystem>
#include <fstream>

#include "compat/torch_compat.h"
#include "format/manifest.h"
#include "io/filename.h"
#include "io/posix_error.h"
#include "testing/fault_env.h"
#include "testing/test_util.h"
#include "tests/accelerator_job.h"
#include "torchpoint/error.h"
#include "torchpoint/module_state.h"
#include "torchpoint/optimizer_state.h"

namespace torchpoint {
namespace {

using testing::AcceleratorJob;
using testing::expect_error;
using testing::TempDir;

ProjectConfiguration automatic(const std::string& dir) {
  return ProjectConfiguration().project_dir(dir).automatic_checkpoint_naming(true);
}

void expect_same_state(StateDict a, StateDict b) {
  ASSERT_EQ(a.keys(), b.keys());
  for (const auto& [key, value] : a.entries()) {
    if (a.is_tensor(key)) {
      EXPECT_TRUE(testing::bitwise_equal(a.tensor(key), b.tensor(key))) << key;
    } else {
      EXPECT_EQ(a.value(key), b.value(key)) << key;
    }
  }
}

TEST(Accelerator, ProjectConfigurationHasAcceleratesDefaults) {
  ProjectConfiguration c;
  EXPECT_EQ(c.project_dir(), "");
  EXPECT_FALSE(c.automatic_checkpoint_naming());
  EXPECT_FALSE(c.total_limit().has_value());
  EXPECT_EQ(c.iteration(), 0);
}

// The seed's example: save at the start, train, load checkpoint_0 back, skip 100 batches.
TEST(Accelerator, SeedScenarioSaveTrainLoadSkip) {
  TempDir dir;
  AcceleratorJob job(automatic(dir / "my/save/path"));
  StateDict initial = job.final_state();
  EXPECT_EQ(job.acc.save_state(), dir / "my/save/path/checkpoints/checkpoint_0");
  job.train(/*save_every=*/0);
  LoadStateReport r = job.acc.load_state(dir / "my/save/path/checkpoints/checkpoint_0");
  EXPECT_EQ(r.components,
            (std::vector<std::string>{"model", "optimizer", "sampler", "scheduler", "scaler",
                                      "custom_checkpoint_0", "random_states_0"}));
  StateDict restored = job.final_state();
  expect_same_state(initial, restored);
  EXPECT_EQ(job.counters.step, 0);
  EXPECT_EQ(job.acc.step(), 0);
  // The next automatic save continues after the loaded checkpoint.
  EXPECT_EQ(job.acc.save_state(), dir / "my/save/path/checkpoints/checkpoint_1");
}

// Every file of an Accelerator checkpoint opens with the real safetensors library, as a Python
// user of Accelerate would open it, with exactly the tensors torchpoint restores.
TEST(Accelerator, EveryCheckpointFileIsReadBySafetensors) {
  TempDir dir;
  AcceleratorJob job(automatic(dir / "run"));
  job.train(/*save_every=*/0);
  std::string checkpoint = job.acc.save_state();  // after training: Adam moments, scaler, ...
  std::vector<std::string> files;
  for (const std::string& name : testing::list_sorted(checkpoint)) {
    if (name.ends_with(".safetensors")) files.push_back(checkpoint + "/" + name);
  }
  EXPECT_EQ(files.size(), 7u);
  testing::expect_safetensors_reads(files, dir.path());
}

// The load report gives the LibTorch version that wrote the checkpoint, and a note when it is
// not the running one (a checkpoint from LibTorch 1.13 resumed under 2.13, or the reverse).
TEST(Accelerator, LoadReportNamesTheLibTorchThatWroteTheCheckpoint) {
  TempDir dir;
  AcceleratorJob job(automatic(dir.path()));
  std::string path = job.acc.save_state();
  LoadStateReport same = job.acc.load_state(path);
  EXPECT_EQ(same.libtorch_version, compat::torch_version());
  EXPECT_TRUE(same.notes.empty());

  // The same checkpoint as the other LibTorch would have written it (manifest resealed).
  const std::string other = TORCH_VERSION_MAJOR == 1 ? "2.13.0" : "1.13.0";
  Problems throwing;  // the manifest is intact: any problem throws
  Manifest manifest = parse_manifest(testing::read_bytes(path + "/manifest.json"), path, throwing);
  manifest.libtorch_version = other;
  testing::write_bytes(path + "/manifest.json", serialize_manifest(manifest));
  LoadStateReport r = job.acc.load_state(path);
  EXPECT_EQ(r.libtorch_version, other);
  ASSERT_EQ(r.notes.size(), 1u);
  EXPECT_NE(r.notes[0].find(fmt::format("written by LibTorch {} and is loaded by LibTorch {}",
                                        other, compat::torch_version())),
            std::string::npos)
      << r.notes[0];
}

TEST(Accelerator, SkipFirstBatchesStartsMidEpochThenWholeEpochs) {
  TempDir dir;
  AcceleratorJob job(automatic(dir.path()));
  auto order0 = job.loader->sampler().order_of(0);
  auto skipped = job.acc.skip_first_batches(job.loader, 10);
  std::vector<std::int64_t> first;
  for (auto& batch : *skipped) first.push_back(batch.data.size(0));
  EXPECT_EQ(first.size(), 3u) << "13 batches per epoch, 10 skipped";
  EXPECT_EQ(job.loader->sampler().epoch(), 0)
      << "skipping must not change the epoch (accelerate#3242)";
  std::size_t whole = 0;
  for (auto& batch : *job.loader) whole += batch.data.size(0);
  EXPECT_EQ(whole, 200u);
  EXPECT_EQ(job.loader->sampler().epoch(), 1);
}

TEST(Accelerator, LoadStateWithoutArgumentTakesTheNewestValidAndRestoresTheIteration) {
  TempDir dir;
  {
    AcceleratorJob job(automatic(dir.path()));
    job.train(/*save_every=*/5);  // 39 steps: checkpoint_0 .. checkpoint_6
  }
  AcceleratorJob again(automatic(dir.path()));
  LoadStateReport r = again.acc.load_state();
  EXPECT_EQ(r.path, dir / "checkpoints/checkpoint_6");
  EXPECT_EQ(again.counters.step, 35);
  EXPECT_EQ(again.acc.step(), 35);
  // accelerate#1601 / #3306: the iteration comes back, so no collision with checkpoint_0.
  EXPECT_EQ(again.acc.save_state(), dir / "checkpoints/checkpoint_7");
}

// An unreadable newest checkpoint (EIO on open, as a failing disk or a permission error gives)
// is not proven corrupt: load_state() fails naming it instead of resuming quietly from an
// older one, whose next save's total_limit would then delete the intact newest one.
TEST(Accelerator, UnreadableNewestCheckpointIsAnErrorNotAQuietFallback) {
  TempDir dir;
  {
    AcceleratorJob job(automatic(dir.path()).total_limit(3));
    job.train(/*save_every=*/10);  // checkpoint_0 (step 10) .. checkpoint_2 (step 30)
  }
  testing::FaultEnv fault;
  const std::string newest = dir / "checkpoints/checkpoint_2";
  fault.set_before_op([&](testing::Op op, const std::string& path) {
    if (op == testing::Op::Open && path.starts_with(newest + "/")) {
      throw posix_error(fmt::format("open of {}", path), EIO);
    }
  });
  {
    AcceleratorJob again(automatic(dir.path()).total_limit(3), fault);
    expect_error([&] { again.acc.load_state(); }, ErrorCode::IOError,
                 {newest, "cannot be loaded", "not passed over", "move"});
    EXPECT_EQ(again.counters.step, 0) << "a failed load changes nothing";
  }
  fault.set_before_op(nullptr);
  EXPECT_EQ(testing::list_sorted(dir / "checkpoints"),
            (std::vector<std::string>{".lock", "checkpoint_0", "checkpoint_1", "checkpoint_2"}));
  AcceleratorJob healed(automatic(dir.path()).total_limit(3));
  EXPECT_EQ(healed.acc.load_state().path, newest);
  EXPECT_EQ(healed.counters.step, 30);
}

// After load_state() of an older checkpoint, retention keeps every newer one that is not
// proven corrupt (it holds progress this run does not have), and deletes one that is first.
// The checkpoint resumed from counts toward total_limit like any other.
TEST(Accelerator, RetentionKeepsCheckpointsNewerThanTheResumedOneUnlessCorrupt) {
  for (bool corrupt : {false, true}) {
    SCOPED_TRACE(corrupt ? "checkpoint_2 corrupt" : "checkpoint_2 intact");
    TempDir dir;
    {
      AcceleratorJob job(automatic(dir.path()).total_limit(3));
      job.train(/*save_every=*/10);  // checkpoint_0 .. checkpoint_2
    }
    if (corrupt) {
      std::string bad = dir / "checkpoints/checkpoint_2/model.safetensors";
      testing::flip_bit(bad, testing::file_size(bad) - 3, 1);
    }
    AcceleratorJob older(automatic(dir.path()).total_limit(2));
    older.acc.load_state(dir / "checkpoints/checkpoint_1");
    EXPECT_EQ(older.acc.save_state(), dir / "checkpoints/checkpoint_3");
    std::vector<std::string> expected = {".lock", "checkpoint_1", "checkpoint_3"};
    if (!corrupt) expected = {".lock", "checkpoint_2", "checkpoint_3"};
    EXPECT_EQ(testing::list_sorted(dir / "checkpoints"), expected);
  }
}

// A new user's resume is one call: nothing on a fresh project, the newest valid checkpoint
// otherwise; a project whose checkpoints are all invalid is not fresh and says so.
TEST(Accelerator, TryLoadStateDoesNothingOnAFreshProject) {
  TempDir dir;
  {
    AcceleratorJob fresh(automatic(dir.path()));
    auto before = fresh.model->parameters().front().clone();
    EXPECT_FALSE(fresh.acc.try_load_state().has_value());
    EXPECT_TRUE(testing::bitwise_equal(fresh.model->parameters().front(), before));
    fresh.train(/*save_every=*/10);  // checkpoint_0 (step 10) .. checkpoint_2 (step 30)
  }
  AcceleratorJob again(automatic(dir.path()));
  std::optional<LoadStateReport> report = again.acc.try_load_state();
  ASSERT_TRUE(report.has_value());
  EXPECT_EQ(report->path, dir / "checkpoints/checkpoint_2");
  EXPECT_EQ(again.counters.step, 30);

  for (const char* name : {"checkpoint_0", "checkpoint_1", "checkpoint_2"}) {
    std::string bad = dir / "checkpoints/" + std::string(name) + "/model.safetensors";
    testing::flip_bit(bad, testing::file_size(bad) - 3, 1);
  }
  AcceleratorJob broken(automatic(dir.path()));
  expect_error([&] { broken.acc.try_load_state(); }, ErrorCode::NotFound,
               {"no valid checkpoint", "3 invalid ones skipped"});
}

TEST(Accelerator, CorruptNewestCheckpointFallsBackToThePreviousWithAWarning) {
  TempDir dir;
  {
    AcceleratorJob job(automatic(dir.path()));
    job.train(/*save_every=*/10);  // checkpoint_0 (step 10) .. checkpoint_2 (step 30)
  }
  std::string bad = dir / "checkpoints/checkpoint_2/optimizer.safetensors";
  testing::flip_bit(bad, testing::file_size(bad) - 5, 2);
  AcceleratorJob again(automatic(dir.path()));
  LoadStateReport r = again.acc.load_state();
  EXPECT_EQ(r.path, dir / "checkpoints/checkpoint_1");
  ASSERT_EQ(r.skipped.size(), 1u);
  EXPECT_NE(r.skipped[0].find("checkpoint_2"), std::string::npos) << r.skipped[0];
  EXPECT_EQ(again.counters.step, 20);
}

// The automatic choice does not verify the newest checkpoint and then read it again: its one
// read verifies every byte before anything changes (a corrupt one is passed over, above). So a
// resume reads about the checkpoint's size, where a verify first read it twice.
TEST(Accelerator, AnAutomaticLoadReadsTheCheckpointOnce) {
  TempDir dir;
  {
    AcceleratorJob job(automatic(dir.path()), Env::posix(), /*hidden=*/256);
    job.train(/*save_every=*/10);  // checkpoint_0 (step 10) .. checkpoint_2 (step 30)
  }
  std::uint64_t size = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir / "checkpoints/checkpoint_2")) {
    size += entry.file_size();
  }
  testing::FaultEnv counting;
  AcceleratorJob again(automatic(dir.path()), counting, /*hidden=*/256);
  const std::uint64_t before = counting.bytes_read();
  LoadStateReport r = again.acc.load_state();
  const std::uint64_t read = counting.bytes_read() - before;
  EXPECT_EQ(r.path, dir / "checkpoints/checkpoint_2");
  EXPECT_TRUE(r.skipped.empty());
  EXPECT_EQ(again.counters.step, 30);
  EXPECT_GE(read, size * 9 / 10);
  EXPECT_LT(read, size * 3 / 2) << "the checkpoint (" << size << " bytes) was read " << read;
}

TEST(Accelerator, TotalLimitDeletesOldestByNumberOnlyAfterCommit) {
  TempDir dir;
  AcceleratorJob job(automatic(dir.path()).total_limit(3));
  for (int i = 0; i < 12; ++i) job.acc.save_state();
  // accelerate#1163: numeric order, so checkpoint_10 and checkpoint_11 survive.
  std::vector<std::string> names;
  for (const auto& [n, path] : job.acc.list_checkpoints()) names.push_back(base_name(path));
  EXPECT_EQ(names, (std::vector<std::string>{"checkpoint_9", "checkpoint_10", "checkpoint_11"}));
  for (const std::string& name : testing::list_sorted(dir / "checkpoints")) {
    EXPECT_FALSE(is_temp_name(name)) << name;
  }

  // Resuming from an older checkpoint continues the numbering after the newest one (never
  // colliding with it), and that run never deletes the valid ones newer than the one it resumed
  // from (DESIGN.md, commit protocol step 5); the one it resumed from and its own older saves go.
  AcceleratorJob resumed(automatic(dir.path()).total_limit(1));
  resumed.acc.load_state(dir / "checkpoints/checkpoint_9");
  EXPECT_EQ(resumed.acc.save_state(), dir / "checkpoints/checkpoint_12");
  EXPECT_EQ(resumed.acc.save_state(), dir / "checkpoints/checkpoint_13");
  names.clear();
  for (const auto& [n, path] : resumed.acc.list_checkpoints()) names.push_back(base_name(path));
  EXPECT_EQ(names, (std::vector<std::string>{"checkpoint_10", "checkpoint_11", "checkpoint_13"}));
}

// total_limit is a maximum after a resume too: the checkpoint resumed from is one of the
// checkpoints it counts (before, it was kept forever, one more than the limit).
TEST(Accelerator, TotalLimitIsAMaximumAfterAResume) {
  for (std::int64_t limit : {1, 2}) {
    SCOPED_TRACE(limit);
    TempDir dir;
    AcceleratorJob job(automatic(dir.path()).total_limit(limit));
    job.acc.save_state();  // checkpoint_0
    job.acc.save_state();  // checkpoint_1
    AcceleratorJob resumed(automatic(dir.path()).total_limit(limit));
    EXPECT_EQ(resumed.acc.load_state().path, dir / "checkpoints/checkpoint_1");
    resumed.acc.save_state();  // checkpoint_2
    std::vector<std::int64_t> numbers;
    for (const auto& [n, path] : resumed.acc.list_checkpoints()) numbers.push_back(n);
    EXPECT_EQ(numbers,
              (limit == 1 ? std::vector<std::int64_t>{2} : std::vector<std::int64_t>{1, 2}));
    resumed.acc.save_state();  // checkpoint_3
    numbers.clear();
    for (const auto& [n, path] : resumed.acc.list_checkpoints()) numbers.push_back(n);
    EXPECT_EQ(numbers,
              (limit == 1 ? std::vector<std::int64_t>{3} : std::vector<std::int64_t>{2, 3}));
  }
}

TEST(Accelerator, ACrashDuringSaveKeepsThePreviousCheckpoints) {
  TempDir dir;
  testing::FaultEnv env;
  AcceleratorJob job(automatic(dir.path()).total_limit(1), env);
  job.acc.save_state();  // checkpoint_0
  env.fail_nth(testing::all_ops(), 9, ENOSPC);
  EXPECT_THROW(job.acc.save_state(), Error);
  env.clear_faults();
  AcceleratorJob again(automatic(dir.path()));
  EXPECT_EQ(again.acc.load_state().path, dir / "checkpoints/checkpoint_0");
}

struct Note {
  std::string text;
  StateDict state_dict() const {
    StateDict s;
    s.set("text", text);
    return s;
  }
  void load_state_dict(const StateDict& s) { text = s.get<std::string>("text"); }
};

TEST(Accelerator, RegisteredObjectsAreSavedInOrderAndCountsMustMatch) {
  TempDir dir;
  Note a{"first"}, b{"second"};
  {
    AcceleratorJob job(automatic(dir.path()));
    job.acc.register_for_checkpointing(a, b);
    job.acc.save_state();
  }
  auto files = testing::list_sorted(dir / "checkpoints/checkpoint_0");
  EXPECT_NE(std::find(files.begin(), files.end(), "custom_checkpoint_2.safetensors"), files.end());
  Note c, d;
  AcceleratorJob job(automatic(dir.path()));
  job.acc.register_for_checkpointing(c, d);
  job.acc.load_state();
  EXPECT_EQ(c.text, "first");
  EXPECT_EQ(d.text, "second");

  AcceleratorJob fewer(automatic(dir.path()));
  Error e = expect_error([&] { fewer.acc.load_state(); }, ErrorCode::Incompatible);
  EXPECT_NE(
      std::string(e.what()).find("holds 3 objects saved with register_for_checkpointing but 1"),
      std::string::npos)
      << e.what();
}

TEST(Accelerator, RngRestoreFailureIsAnErrorNotALogLine) {
  TempDir dir;
  {
    AcceleratorJob job(automatic(dir.path()));
    job.acc.save_state();
  }
  AcceleratorJob job(automatic(dir.path()));
  job.acc.rng().register_generator("augment", at::detail::createCPUGenerator(3));
  expect_error([&] { job.acc.load_state(); }, ErrorCode::Incompatible);  // accelerate#4283
}

TEST(Accelerator, BadInputGivesClearErrors) {
  TempDir dir;
  AcceleratorJob manual(ProjectConfiguration().project_dir(dir.path()));
  Error e = expect_error([&] { manual.acc.save_state(); }, ErrorCode::InvalidArgument);
  EXPECT_NE(std::string(e.what()).find("automatic_checkpoint_naming"), std::string::npos);
  expect_error([&] { manual.acc.load_state(dir / "missing"); }, ErrorCode::NotFound);

  AcceleratorJob fresh(automatic(dir / "empty"));
  Error none = expect_error([&] { fresh.acc.load_state(); }, ErrorCode::NotFound);
  EXPECT_NE(std::string(none.what()).find("no valid checkpoint"), std::string::npos);

  // A model of another shape: refused before anything changes.
  manual.acc.save_state(dir / "manual_ckpt");
  AcceleratorJob other(ProjectConfiguration().project_dir(dir.path()), Env::posix(), /*hidden=*/64);
  auto wide = other.model;
  auto before = wide->parameters()[0].clone();
  Error shape =
      expect_error([&] { other.acc.load_state(dir / "manual_ckpt"); }, ErrorCode::Incompatible);
  EXPECT_NE(std::string(shape.what())
                .find("size mismatch for 0.weight: checkpoint [32, 10], model [64, 10]"),
            std::string::npos)
      << shape.what();
  EXPECT_TRUE(wide->parameters()[0].equal(before));
  EXPECT_THROW(Accelerator(ProjectConfiguration().total_limit(0)), Error);
}

TEST(Accelerator, PreHooksSeeThePaths) {
  TempDir dir;
  AcceleratorJob job(automatic(dir.path()));
  std::vector<std::string> seen;
  job.acc.register_save_state_pre_hook([&](const std::string& p) { seen.push_back("save " + p); });
  job.acc.register_load_state_pre_hook([&](const std::string& p) { seen.push_back("load " + p); });
  job.acc.save_state();
  job.acc.load_state();
  ASSERT_EQ(seen.size(), 2u);
  // The save hook gets the directory being written, which becomes checkpoint_0 on commit.
  EXPECT_TRUE(seen[0].starts_with("save " + dir / "checkpoints/checkpoint_0.tmp-")) << seen[0];
  EXPECT_EQ(seen[1], "load " + dir / "checkpoints/checkpoint_0");
}

// Save hooks write files into the checkpoint, as save_pretrained-style hooks do in Accelerate:
// they become part of it (in the manifest, checksummed, verified on load), and saving goes on
// working (before, the hook's directory made this save and every later one fail).
TEST(Accelerator, FilesASaveHookWritesArePartOfTheCheckpoint) {
  TempDir dir;
  AcceleratorJob job(automatic(dir.path()));
  job.acc.register_save_state_pre_hook([](const std::string& out) {
    std::ofstream(out + "/config.json") << R"({"hidden": 32})";
    std::ofstream(out + "/notes.txt") << "written by a hook\n";
  });
  const std::string first = job.acc.save_state();
  const std::string second = job.acc.save_state();
  EXPECT_EQ(second, dir / "checkpoints/checkpoint_1");
  EXPECT_EQ(testing::read_bytes(first + "/config.json"), R"({"hidden": 32})");
  DirectoryCheckpoint loaded = load_directory(first);
  EXPECT_EQ(loaded.extra_files, (std::vector<std::string>{"config.json", "notes.txt"}));
  EXPECT_TRUE(verify(first).ok());
  EXPECT_NE(testing::read_bytes(first + "/manifest.json").find("\"extra_files\""),
            std::string::npos);
  // Changed afterwards: caught by verify and by a load.
  testing::write_bytes(first + "/config.json", R"({"hidden": 64})");
  VerifyReport report = verify(first);
  ASSERT_FALSE(report.ok());
  EXPECT_TRUE(report.proven_corrupt());
  EXPECT_NE(report.problems[0].find("config.json fails its checksum"), std::string::npos)
      << report.problems[0];
  expect_error([&] { job.acc.load_state(first); }, ErrorCode::Corruption, {"config.json"});
  // A hook that writes a directory, or a component's file name, fails that save only.
  AcceleratorJob bad(automatic(dir / "other"));
  bad.acc.register_save_state_pre_hook(
      [](const std::string& out) { std::filesystem::create_directory(out + "/sub"); });
  expect_error([&] { bad.acc.save_state(); }, ErrorCode::InvalidArgument, {"sub", "a directory"});
  EXPECT_TRUE(bad.acc.list_checkpoints().empty());
}

// save_state(dir) into an existing empty directory works (Accelerate creates it with
// exist_ok=True); into a committed checkpoint only with overwrite, which replaces it whole; and
// the errors say what is there.
TEST(Accelerator, SaveIntoExistingDirectories) {
  TempDir dir;
  AcceleratorJob job(ProjectConfiguration().project_dir(dir.path()));
  std::filesystem::create_directories(dir / "empty");
  EXPECT_EQ(job.acc.save_state(dir / "empty"), dir / "empty");
  EXPECT_TRUE(verify(dir / "empty").ok());

  job.train(/*save_every=*/0);  // the state moves on
  Error e = expect_error([&] { job.acc.save_state(dir / "empty"); }, ErrorCode::InvalidArgument,
                         {dir / "empty", "is a committed checkpoint", "overwrite"});
  EXPECT_EQ(load_directory(dir / "empty").info.step, 0) << "the old checkpoint is untouched";
  EXPECT_EQ(job.acc.save_state(dir / "empty", /*overwrite=*/true), dir / "empty");
  EXPECT_EQ(load_directory(dir / "empty").info.step, job.acc.step());
  EXPECT_TRUE(verify(dir / "empty").ok());
  for (const std::string& name : testing::list_sorted(dir.path())) {
    EXPECT_FALSE(is_temp_name(name)) << "the replaced checkpoint is gone: " << name;
  }

  std::filesystem::create_directories(dir / "busy");
  testing::write_bytes(dir / "busy/readme.txt", "not a checkpoint");
  expect_error([&] { job.acc.save_state(dir / "busy"); }, ErrorCode::InvalidArgument,
               {dir / "busy", "no manifest.json", "not a committed checkpoint"});
  expect_error([&] { job.acc.save_state(dir / "busy", /*overwrite=*/true); },
               ErrorCode::InvalidArgument, {"no manifest.json"});
  EXPECT_EQ(testing::read_bytes(dir / "busy/readme.txt"), "not a checkpoint");
}

// load_state() reads a model's parameters straight into the memory they have (the optimizer
// keeps stepping the same tensors), from one file or from shards, and bumps their versions.
TEST(Accelerator, LoadStateFillsTheModelInPlaceFromOneFileOrShards) {
  for (std::uint64_t shard_size : {std::uint64_t{0}, std::uint64_t{512}}) {
    SCOPED_TRACE(shard_size);
    TempDir dir;
    AcceleratorJob job(automatic(dir / "p").shard_size(shard_size));
    job.train(/*save_every=*/0);
    StateDict trained = job.final_state();
    std::string path = job.acc.save_state();
    if (shard_size > 0) {
      ASSERT_TRUE(std::filesystem::exists(path + "/model.safetensors.index.json"));
    }
    AcceleratorJob other(automatic(dir / "p").shard_size(shard_size));
    std::vector<const void*> memory;
    std::vector<std::uint32_t> versions;
    for (const at::Tensor& p : other.model->parameters()) {
      memory.push_back(p.data_ptr());
      versions.push_back(p._version());
    }
    LoadStateReport r = other.acc.load_state(path);
    EXPECT_EQ(r.components.front(), "model");
    expect_same_state(trained, other.final_state());
    std::vector<at::Tensor> params = other.model->parameters();
    for (std::size_t i = 0; i < params.size(); ++i) {
      EXPECT_EQ(params[i].data_ptr(), memory[i]) << "parameter " << i << " was replaced";
      EXPECT_GT(params[i]._version(), versions[i]) << "parameter " << i;
      EXPECT_EQ(other.optimizer.param_groups()[0].params()[i].data_ptr(), memory[i]);
    }
  }
}

// Refuses the state it is given when `refuse` is set, as a component whose checks fail would.
struct Refuser {
  bool refuse = false;
  StateDict state_dict() const {
    StateDict s;
    s.set("x", 1);
    return s;
  }
  void load_state_dict(const StateDict&) {
    if (refuse) throw Error(ErrorCode::Incompatible, "Refuser: refused");
  }
};

// The model is copied in last: when a later component refuses its state, the model has not
// changed, although no copy of it was held; and the components restored before it are put back.
TEST(Accelerator, AComponentRefusingItsStateLeavesTheModelUntouched) {
  TempDir dir;
  auto make = [&](std::uint64_t seed) {
    torch::manual_seed(seed);
    return torch::nn::Sequential(torch::nn::Linear(40, 30), torch::nn::Linear(30, 2));
  };
  torch::nn::Sequential model = make(1);
  torch::optim::Adam adam(model->parameters(), 1e-2);
  Refuser refuser;
  Accelerator acc(automatic(dir / "p"));
  acc.prepare(model, adam);
  acc.register_for_checkpointing(refuser);
  model->forward(torch::randn({4, 40})).sum().backward();
  adam.step();
  std::string path = acc.save_state();

  torch::nn::Sequential other = make(2);
  torch::optim::Adam other_adam(other->parameters(), 1e-2);
  Refuser other_refuser;
  other_refuser.refuse = true;
  Accelerator other_acc(automatic(dir / "q"));
  other_acc.prepare(other, other_adam);
  other_acc.register_for_checkpointing(other_refuser);
  StateDict model_before = module_state_dict(*other).clone();
  StateDict optimizer_before = optimizer_state_dict(other_adam).clone();
  std::vector<std::uint32_t> versions;
  for (const at::Tensor& p : other->parameters()) versions.push_back(p._version());
  expect_error([&] { other_acc.load_state(path); }, ErrorCode::Incompatible, {"refused"});
  expect_same_state(model_before, module_state_dict(*other));
  // Not even written and put back (which would have bumped the versions twice).
  for (std::size_t i = 0; i < versions.size(); ++i) {
    EXPECT_EQ(other->parameters()[i]._version(), versions[i]) << "parameter " << i;
  }
  expect_same_state(optimizer_before, optimizer_state_dict(other_adam));
  other_refuser.refuse = false;
  other_acc.load_state(path);
  expect_same_state(module_state_dict(*model), module_state_dict(*other));
}

// A model that does not fit the checkpoint is not read into: the module's own check names
// every key that differs, as before.
TEST(Accelerator, AModelOfAnotherShapeIsReportedByKey) {
  TempDir dir;
  AcceleratorJob job(automatic(dir / "p"));
  std::string path = job.acc.save_state();
  AcceleratorJob wider(automatic(dir / "q"), Env::posix(), /*hidden=*/33);
  StateDict before = wider.final_state();
  expect_error([&] { wider.acc.load_state(path); }, ErrorCode::Incompatible,
               {"does not fit this module", "size mismatch for 0.weight"});
  expect_same_state(before, wider.final_state());
}

// ZeRO on one process, with an optimizer that stepped before prepare(): its state becomes the
// part's (one part: all of it), steps go on from it as without ZeRO, and the checkpoint holds it
// once, in the shard, not also in the optimizer's own file.
TEST(Accelerator, ZeroTakesTheStateAnOptimizerHeldBeforePrepare) {
  TempDir dir;
  auto run = [&](int stage) {
    torch::manual_seed(3);
    torch::nn::Linear net(4, 3);
    torch::optim::Adam adam(net->parameters(), torch::optim::AdamOptions(1e-2));
    for (int i = 0; i < 2; ++i) {  // before prepare: the user's own steps
      adam.zero_grad();
      net(torch::ones({2, 4})).pow(2).sum().backward();
      adam.step();
    }
    Accelerator acc(automatic(dir / ("zero" + std::to_string(stage))));
    acc.set_zero_stage(stage);
    auto [model, optimizer] = acc.prepare(net, adam);
    (void)model;
    optimizer.zero_grad();
    acc.backward(net(torch::ones({2, 4})).pow(2).sum());
    optimizer.step();
    const std::string path = acc.save_state();
    return std::pair{module_state_dict(*net), path};
  };
  auto [plain_model, plain_path] = run(0);
  auto [zero_model, zero_path] = run(1);
  expect_same_state(zero_model, plain_model);
  const auto component = [](const std::string& path, const std::string& name) {
    for (const Component& c : load_directory(path).components) {
      if (c.name == name) return StateDict::from_container(c.contents);
    }
    ADD_FAILURE() << path << " has no component " << name;
    return StateDict();
  };
  expect_same_state(component(zero_path, "optimizer"), component(plain_path, "optimizer"));
  EXPECT_TRUE(load_file(zero_path + "/optimizer.safetensors").tensors.empty());
  EXPECT_FALSE(load_file(zero_path + "/optimizer_zero_0.safetensors").tensors.empty());
}

}  // namespace
}  // namespace torchpoint
