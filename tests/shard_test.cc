// Sharded and incremental directory checkpoints: a large component in Hugging Face's shard
// layout loads whole; a later save hard-links the shards that did not change and writes the
// rest; every checkpoint stays complete on its own; faults and power cuts during a save that
// links keep every committed checkpoint.
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>

#include "format/container.h"
#include "format/manifest.h"
#include "format/zero_shards.h"
#include "io/filename.h"
#include "testing/fault_env.h"
#include "testing/test_util.h"
#include "torchpoint/checkpoint_dir.h"
#include "torchpoint/checkpoint_manager.h"
#include "torchpoint/error.h"
#include "torchpoint/state_dict.h"
#include "torchpoint/tensor_file.h"

namespace torchpoint {
namespace {

using testing::FaultEnv;
using testing::Op;
using testing::PowerCutMode;
using testing::TempDir;

constexpr std::uint64_t kShard = 1u << 20;  // 1 MiB shards in these tests

// A model of a frozen 2.5 MiB backbone (two tensors, one a buffer-like int64) and a trainable
// head that changes with `step`, and an optimizer small enough for one file.
std::vector<Component> state(int step) {
  return {
      {"model",
       {{{"backbone.0.weight", testing::make_tensor(at::kFloat, {256, 1024}, 7)},
         {"head.weight", testing::make_tensor(at::kFloat, {64, 1024}, 100 + step)},
         {"backbone.1.weight", testing::make_tensor(at::kFloat, {256, 1024}, 8)},
         {"backbone.1.count", testing::make_tensor(at::kLong, {65536}, 9)},
         {"head.bias", testing::make_tensor(at::kFloat, {64}, 200 + step)}},
        {{"order", "kept"}, {"step", step}}}},
      {"optimizer", {{{"step", at::tensor(std::int64_t{step})}}, {{"lr", 0.5}}}},
  };
}

SaveDirectoryOptions options(const std::string& link_from = "") {
  SaveDirectoryOptions o;
  o.shard_size = kShard;
  o.frozen = {"model/backbone.0.weight", "model/backbone.1.weight", "model/backbone.1.count"};
  o.link_from = link_from;
  return o;
}

void expect_holds(const std::string& path, int step) {
  VerifyReport report = verify(path);
  ASSERT_TRUE(report.ok()) << path << ": " << report.problems.front();
  DirectoryCheckpoint loaded = load_directory(path);
  std::vector<Component> expected = state(step);
  ASSERT_EQ(loaded.components.size(), expected.size());
  for (std::size_t c = 0; c < expected.size(); ++c) {
    EXPECT_EQ(loaded.components[c].name, expected[c].name);
    EXPECT_EQ(loaded.components[c].contents.state, expected[c].contents.state);
    const auto& a = expected[c].contents.tensors;
    const auto& b = loaded.components[c].contents.tensors;
    ASSERT_EQ(a.size(), b.size()) << path;
    for (std::size_t t = 0; t < a.size(); ++t) {
      EXPECT_EQ(a[t].first, b[t].first) << "the component's tensor order is kept";
      EXPECT_TRUE(testing::bitwise_equal(a[t].second, b[t].second)) << path << " " << a[t].first;
    }
  }
}

struct ::stat stat_of(const std::string& path) {
  struct ::stat st;
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return st;
}

bool same_file(const std::string& a, const std::string& b) {
  struct ::stat x = stat_of(a), y = stat_of(b);
  return x.st_ino == y.st_ino && x.st_dev == y.st_dev;
}

// Returns once a file written now in `dir` gets a modification time later than `path`'s: file
// times advance by the kernel's clock tick (a few ms), and a change made within the tick of a
// checkpoint's commit carries the same time as its manifest.
void wait_for_a_later_tick(const std::string& dir, const std::string& path) {
  const std::string probe = dir + "/tick-probe";
  for (int i = 0; i < 1000; ++i) {
    testing::write_bytes(probe, "x");
    bool later = stat_of(probe).st_mtim.tv_sec > stat_of(path).st_mtim.tv_sec ||
                 (stat_of(probe).st_mtim.tv_sec == stat_of(path).st_mtim.tv_sec &&
                  stat_of(probe).st_mtim.tv_nsec > stat_of(path).st_mtim.tv_nsec);
    ::unlink(probe.c_str());
    if (later) return;
    ::usleep(1000);
  }
  ADD_FAILURE() << "the file system's clock did not move past " << path;
}

// Frozen: backbone.0.weight (1 MiB), then backbone.1.weight (1 MiB) + count (0.5 MiB) over the
// limit, so three frozen shards; the head (256 KiB) is the fourth.
const std::vector<std::string> kShards = {
    "model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
    "model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors"};

TEST(Shards, ALargeComponentIsWrittenAsShardsWithAnIndexAndLoadsWhole) {
  TempDir dir;
  std::string path = dir / "checkpoint_0";
  save_directory(path, state(0), {.step = 3}, Env::posix(), options());
  std::vector<std::string> expected = kShards;
  expected.insert(expected.begin(), "manifest.json");
  expected.push_back("model.safetensors.index.json");
  expected.push_back("optimizer.safetensors");  // small: one file, as before
  std::sort(expected.begin(), expected.end());
  EXPECT_EQ(testing::list_sorted(path), expected);
  expect_holds(path, 0);
  EXPECT_EQ(load_directory(path).info.step, 3);

  // The index is Hugging Face's: total_size and every tensor's shard, in the model's order.
  Json index = Json::parse(testing::read_bytes(path + "/model.safetensors.index.json"));
  EXPECT_EQ(index["metadata"]["total_size"], (256 + 64 + 256) * 1024 * 4 + 65536 * 8 + 64 * 4);
  std::vector<std::string> names;
  for (const auto& [name, file] : index["weight_map"].items()) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"backbone.0.weight", "head.weight",
                                             "backbone.1.weight", "backbone.1.count",
                                             "head.bias"}));
  EXPECT_EQ(index["weight_map"]["backbone.0.weight"], kShards[0]);
  EXPECT_EQ(index["weight_map"]["backbone.1.weight"], kShards[1]);
  EXPECT_EQ(index["weight_map"]["backbone.1.count"], kShards[2]);
  EXPECT_EQ(index["weight_map"]["head.weight"], kShards[3]);
  EXPECT_EQ(index["weight_map"]["head.bias"], kShards[3]);
  // Each shard is a whole container of its own; the state goes with the last.
  EXPECT_EQ(load_file(path + "/" + kShards[0]).tensors.size(), 1u);
  EXPECT_TRUE(load_file(path + "/" + kShards[0]).state.empty());
  EXPECT_EQ(load_file(path + "/" + kShards[3]).state["step"], 0);
  // A manifest listing shards is format 2: older readers refuse it instead of misreading it.
  Json manifest = Json::parse(testing::read_bytes(path + "/manifest.json"));
  EXPECT_EQ(manifest["format_version"], "2.0");
  EXPECT_EQ(manifest["files"][kShards[1]]["shard"], Json::array({2, 4}));

  // Without shard_size, the same state is one file per component, with the same tensors.
  SaveDirectoryOptions whole;
  whole.shard_size = 0;
  save_directory(dir / "whole", state(0), {}, Env::posix(), whole);
  EXPECT_EQ(testing::list_sorted(dir / "whole"),
            (std::vector<std::string>{"manifest.json", "model.safetensors",
                                      "optimizer.safetensors"}));
  EXPECT_EQ(Json::parse(testing::read_bytes(dir / "whole/manifest.json"))["format_version"],
            "1.0");
}

// Python users read the shards as any Hugging Face sharded checkpoint: through the index with
// safetensors, and with accelerate's and transformers' loaders of sharded checkpoints into a
// torch module.
TEST(Shards, PythonReadsTheShardsThroughTheIndex) {
  TempDir dir;
  std::string path = dir / "checkpoint_0";
  save_directory(path, state(0), {}, Env::posix(), options());
  save_file(dir / "reference.safetensors", state(0)[0].contents);
  testing::CommandOutput out =
      testing::run_python_script("sharded_check.py", {path, "model", dir / "reference.safetensors"});
  EXPECT_EQ(out.status, 0) << out.output;
  EXPECT_NE(out.output.find("ok: 5 tensors from 4 shards, with safetensors, accelerate and "
                            "transformers"),
            std::string::npos)
      << out.output;
}

TEST(Shards, ComponentNamesShapedLikeShardsAreRefused) {
  TempDir dir;
  testing::expect_error(
      [&] {
        save_directory(dir / "c", {{"model-00001-of-00002", {{{"x", at::ones({2})}}, {}}}});
      },
      ErrorCode::InvalidArgument, {"model-00001-of-00002", "shard"});
  EXPECT_FALSE(Env::posix().stat(dir / "c").exists);
}

TEST(Shards, ADamagedIndexOrMissingShardIsReportedAndNothingLoads) {
  TempDir dir;
  std::string path = dir / "checkpoint_0";
  save_directory(path, state(0), {}, Env::posix(), options());
  std::string index = path + "/model.safetensors.index.json";
  std::string original = testing::read_bytes(index);
  std::string edited = original;
  edited.replace(edited.find("model-00004"), 11, "model-00003");  // head moved to another shard
  testing::write_bytes(index, edited);
  testing::expect_error([&] { load_directory(path); }, ErrorCode::Corruption,
                        {"model.safetensors.index.json", "checksum"});
  EXPECT_FALSE(verify(path).ok());
  testing::write_bytes(index, original);
  expect_holds(path, 0);

  std::rename((path + "/" + kShards[2]).c_str(), (dir / "aside").c_str());
  testing::expect_error([&] { load_directory(path); }, ErrorCode::Corruption,
                        {kShards[2], "missing"});
  VerifyReport report = verify(path);
  ASSERT_FALSE(report.ok());
  EXPECT_NE(report.problems.front().find(kShards[2]), std::string::npos);
}

TEST(Incremental, UnchangedShardsAreHardLinkedAndOnlyTheChangedOnesWritten) {
  TempDir dir;
  std::string first = dir / "checkpoint_0", second = dir / "checkpoint_1";
  save_directory(first, state(0), {}, Env::posix(), options());
  save_directory(second, state(1), {}, Env::posix(), options(first));
  for (int k = 0; k < 3; ++k) {
    EXPECT_TRUE(same_file(first + "/" + kShards[k], second + "/" + kShards[k])) << kShards[k];
    EXPECT_EQ(stat_of(second + "/" + kShards[k]).st_nlink, 2u);
  }
  EXPECT_FALSE(same_file(first + "/" + kShards[3], second + "/" + kShards[3]));
  expect_holds(first, 0);
  expect_holds(second, 1);

  // The listing tells what is shared: the three frozen shards.
  std::uint64_t frozen_bytes = 0;
  for (int k = 0; k < 3; ++k) frozen_bytes += testing::file_size(second + "/" + kShards[k]);
  CheckpointListing listing = list_checkpoints(dir.path());
  ASSERT_EQ(listing.entries.size(), 2u);
  for (const ListedCheckpoint& e : listing.entries) EXPECT_EQ(e.shared_bytes, frozen_bytes);

  // Deleting the older checkpoint (as total_limit does) leaves the newer one whole.
  Env::posix().remove_all(first);
  expect_holds(second, 1);
  EXPECT_EQ(stat_of(second + "/" + kShards[0]).st_nlink, 1u);
  EXPECT_EQ(list_checkpoints(dir.path()).entries.at(0).shared_bytes, 0u);

  // A chain: the third links from the second, whose shards came from the deleted first.
  std::string third = dir / "checkpoint_2";
  save_directory(third, state(2), {}, Env::posix(), options(second));
  EXPECT_TRUE(same_file(second + "/" + kShards[0], third + "/" + kShards[0]));
  expect_holds(third, 2);
}

TEST(Incremental, ATensorChangedInPlaceIsAlwaysWritten) {
  TempDir dir;
  std::vector<Component> s = state(0);
  std::string first = dir / "a", second = dir / "b";
  save_directory(first, s, {}, Env::posix(), options());
  // A write through the raw pointer: same storage, same version counter, new bytes (one bit
  // flipped: make_tensor's random floats are often too large for an added 1 to change them).
  at::Tensor frozen = s[0].contents.tensors[2].second;  // backbone.1.weight: shard 2
  static_cast<std::uint8_t*>(frozen.data_ptr())[12345 * sizeof(float)] ^= 0x01;
  save_directory(second, s, {}, Env::posix(), options(first));
  EXPECT_TRUE(same_file(first + "/" + kShards[0], second + "/" + kShards[0]));
  EXPECT_FALSE(same_file(first + "/" + kShards[1], second + "/" + kShards[1]));
  EXPECT_TRUE(same_file(first + "/" + kShards[2], second + "/" + kShards[2]));
  DirectoryCheckpoint loaded = load_directory(second);
  EXPECT_TRUE(testing::bitwise_equal(loaded.components[0].contents.tensors[2].second, frozen));
  EXPECT_FALSE(testing::bitwise_equal(load_directory(first).components[0].contents.tensors[2].second,
                                      frozen));
}

TEST(Incremental, AShardChangedAfterItsCommitIsNotLinkedButWrittenAgain) {
  TempDir dir;
  std::string first = dir / "a", second = dir / "b";
  save_directory(first, state(0), {}, Env::posix(), options());
  // Bit rot or a stray write in a tensor's bytes: the header and manifest still agree, only the
  // data checksum fails. The file's modification time betrays it; the new save writes its own.
  wait_for_a_later_tick(dir.path(), first + "/manifest.json");
  testing::flip_bit(first + "/" + kShards[0], testing::file_size(first + "/" + kShards[0]) - 100,
                    3);
  save_directory(second, state(1), {}, Env::posix(), options(first));
  EXPECT_FALSE(same_file(first + "/" + kShards[0], second + "/" + kShards[0]));
  EXPECT_TRUE(same_file(first + "/" + kShards[1], second + "/" + kShards[1]));
  expect_holds(second, 1);
  VerifyReport report = verify(first);
  ASSERT_FALSE(report.ok());
  EXPECT_NE(report.problems.front().find(kShards[0]), std::string::npos);
}

TEST(Incremental, ALinkedShardCorruptedOrDeletedUnderOneCheckpoint) {
  TempDir dir;
  std::string first = dir / "a", second = dir / "b";
  save_directory(first, state(0), {}, Env::posix(), options());
  save_directory(second, state(1), {}, Env::posix(), options(first));
  // Deleted under the first: the second still has its own name for the same bytes.
  Env::posix().remove_file(first + "/" + kShards[1]);
  expect_holds(second, 1);
  EXPECT_FALSE(verify(first).ok());
  testing::expect_error([&] { load_directory(first); }, ErrorCode::Corruption, {kShards[1]});
  // Corrupted through the first's name: one file, so both checkpoints see it and say where.
  testing::flip_bit(first + "/" + kShards[0], testing::file_size(first + "/" + kShards[0]) - 8, 0);
  for (const std::string& path : {first, second}) {
    VerifyReport report = verify(path);
    ASSERT_FALSE(report.ok()) << path;
    bool named = false;
    for (const std::string& p : report.problems) named |= p.find(kShards[0]) != std::string::npos;
    EXPECT_TRUE(named) << report.problems.front();
  }
  testing::expect_error([&] { load_directory(second); }, ErrorCode::Corruption, {kShards[0]});
}

TEST(Incremental, WhereHardLinksAreRefusedTheShardIsWrittenAgain) {
  TempDir dir;
  std::string first = dir / "a", second = dir / "b";
  save_directory(first, state(0), {}, Env::posix(), options());
  FaultEnv env;
  env.fail_nth({Op::Link}, 1, EXDEV, /*persistent=*/true);
  save_directory(second, state(1), {}, env, options(first));
  EXPECT_EQ(env.faults_fired(), 3u);  // one refused link per frozen shard
  for (const std::string& shard : kShards) {
    EXPECT_FALSE(same_file(first + "/" + shard, second + "/" + shard)) << shard;
  }
  expect_holds(second, 1);
  expect_holds(first, 0);
}

TEST(Incremental, EveryCallOfALinkingSaveFailsInTurn) {
  for (bool persistent : {false, true}) {
    TempDir dir;
    std::string first = dir / "checkpoint_0", second = dir / "checkpoint_1";
    save_directory(first, state(0), {}, Env::posix(), options());
    std::uint64_t failures = 0;
    for (std::uint64_t n = 1;; ++n) {
      SCOPED_TRACE(fmt::format("EIO at call {} ({})", n, persistent ? "persistent" : "once"));
      FaultEnv env;
      env.fail_nth(testing::all_ops(), n, EIO, persistent);
      try {
        save_directory(second, state(1), {}, env, options(first));
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find("injected"), std::string::npos) << e.what();
      }
      expect_holds(first, 0);
      if (Env::posix().stat(second).exists) {
        expect_holds(second, 1);  // committed (a failure after the rename, or a refused link)
        Env::posix().remove_all(second);
      }
      if (env.faults_fired() == 0) break;
      ++failures;
      ASSERT_LT(n, 2000u);
    }
    EXPECT_GT(failures, 30u);
  }
}

// Thrown by the hook to stop a save dead at a chosen call, as a power cut would.
struct LinkingPowerCut {};

TEST(Incremental, PowerCutsDuringALinkingSaveKeepOnlyCommittedCheckpoints) {
  std::uint64_t cuts = 0;
  for (PowerCutMode mode : {PowerCutMode::DropUnsynced, PowerCutMode::Garbage}) {
    TempDir dir;
    std::string first = dir / "checkpoint_0", second = dir / "checkpoint_1";
    save_directory(first, state(0), {}, Env::posix(), options());
    for (std::uint64_t k = 1;; ++k) {
      SCOPED_TRACE(fmt::format("power cut ({}) before call {}", power_cut_mode_name(mode), k));
      FaultEnv env;
      env.set_real_syncs(false);
      // Atomic: two shards are written at once, and the hook runs on both threads.
      std::atomic<std::uint64_t> seen{0};
      std::atomic<bool> cut{false};
      env.set_before_op([&](Op, const std::string&) {
        if (++seen >= k) {
          cut = true;
          throw LinkingPowerCut{};
        }
      });
      try {
        save_directory(second, state(1), {}, env, options(first));
      } catch (const LinkingPowerCut&) {
      }
      env.set_before_op(nullptr);
      env.simulate_power_cut(mode, k);
      ++cuts;
      expect_holds(first, 0);
      if (Env::posix().stat(second).exists) {
        expect_holds(second, 1);  // whatever survived under the final name is whole
        Env::posix().remove_all(second);
      }
      if (!cut) break;
      ASSERT_LT(k, 2000u);
    }
  }
  EXPECT_GT(cuts, 40u);
}

// A layout of one optimizer over `world` processes in parts of `part` elements.
detail::ZeroLayout zero_layout(int world, std::int64_t total, std::int64_t part,
                               std::int64_t chunk, std::vector<detail::ZeroLayout::Param> params) {
  detail::ZeroLayout layout;
  layout.optimizer = "optimizer";
  layout.world = world;
  layout.total = total;
  layout.part = part;
  layout.chunk = chunk;
  layout.params = std::move(params);
  return layout;
}

ContainerHeader header_of(const std::string& path) {
  std::unique_ptr<File> file = Env::posix().open(path, OpenMode::Read);
  Problems throwing;
  ContainerHeader header = read_container_header(*file, path, throwing);
  file->close();
  return header;
}

// A ZeRO shard is read only where it meets a process's range: the header whole, then the state
// of the pieces meeting [begin, end), each checked against its checksum; damage in a piece that
// is not read goes unseen by that load (another process, or verify, reads it), and damage in a
// piece that is read is Corruption.
TEST(Shards, AZeroShardIsReadOnlyWhereItMeetsTheRange) {
  TempDir dir;
  const detail::ZeroLayout layout = zero_layout(1, 10, 10, 0, {{0, 0, 0, {6}}, {0, 1, 6, {2, 2}}});
  StateDict shard;
  shard.set("zero.rank", 0);
  shard.set("zero.world", 1);
  shard.set("zero.0.0.begin", 0);
  shard.set("zero.0.0.numel", 6);
  shard.set("state.0.0.exp_avg", testing::make_tensor(at::kFloat, {6}, 1));
  shard.set("state.0.0.step", 3);
  shard.set("zero.0.1.begin", 0);
  shard.set("zero.0.1.numel", 4);
  shard.set("state.0.1.exp_avg", testing::make_tensor(at::kFloat, {4}, 2));
  shard.set("state.0.1.step", 3);
  const std::string path = dir / "optimizer_zero_0.safetensors";
  write_container(Env::posix(), path, shard.to_container());

  std::uint64_t checksum = 0, read = 0;
  Container second = load_container_part(Env::posix(), path,
                                         detail::zero_shard_filter(layout, 6, 10), &checksum,
                                         &read);
  ASSERT_EQ(second.tensors.size(), 1u);
  EXPECT_EQ(second.tensors[0].first, "state.0.1.exp_avg");
  EXPECT_TRUE(testing::bitwise_equal(second.tensors[0].second, shard.tensor("state.0.1.exp_avg")));
  const ContainerHeader header = header_of(path);
  EXPECT_EQ(read, header.data_start + 4 * sizeof(float));
  // The parse of what was read still knows both pieces and their steps.
  const detail::ZeroShard parsed =
      detail::ZeroShard::parse(StateDict::from_container(second), layout, 0, path);
  EXPECT_EQ(parsed.pieces.size(), 2u);
  // A range that meets both pieces reads both; one at the boundary only the first.
  EXPECT_EQ(load_container_part(Env::posix(), path, detail::zero_shard_filter(layout, 5, 7),
                                nullptr, nullptr)
                .tensors.size(),
            2u);
  EXPECT_EQ(load_container_part(Env::posix(), path, detail::zero_shard_filter(layout, 0, 6),
                                nullptr, nullptr)
                .tensors.size(),
            1u);

  // Damage in the first piece's data: unseen by the load of [6, 10), Corruption for [0, 6).
  const TensorEntry& first = header.entries[0].name == "state.0.0.exp_avg" ? header.entries[0]
                                                                           : header.entries[1];
  ASSERT_EQ(first.name, "state.0.0.exp_avg");
  testing::flip_bit(path, header.data_start + first.begin + 1, 3);
  EXPECT_EQ(load_container_part(Env::posix(), path, detail::zero_shard_filter(layout, 6, 10),
                                nullptr, nullptr)
                .tensors.size(),
            1u);
  testing::expect_error(
      [&] {
        load_container_part(Env::posix(), path, detail::zero_shard_filter(layout, 0, 6), nullptr,
                            nullptr);
      },
      ErrorCode::Corruption, {"state.0.0.exp_avg", "fails its checksum"});
}

// A layout with chunks (format 4.0): each piece's state is cut into chunks of `chunk`
// elements, each a tensor with its own checksum, and a process whose range begins or ends inside
// a piece reads and verifies only the chunks meeting it; what it reads assembles into exactly
// those elements. A chunk that does not fit its piece is Corruption naming it.
TEST(Shards, AChunkedZeroShardIsReadOnlyInTheChunksMeetingTheRange) {
  TempDir dir;
  const detail::ZeroLayout layout = zero_layout(2, 20, 10, 4, {{0, 0, 0, {4, 5}}});
  const at::Tensor exp_avg = testing::make_tensor(at::kFloat, {10}, 3);
  const at::Tensor exp_avg_sq = testing::make_tensor(at::kDouble, {10}, 4);
  StateDict shard;  // rank 1's: elements [10, 20), the parameter's second half
  shard.set("zero.rank", 1);
  shard.set("zero.world", 2);
  shard.set("zero.0.0.begin", 10);
  shard.set("zero.0.0.numel", 10);
  shard.set("state.0.0.step", 7);
  for (const auto& [field, t] :
       {std::pair{"exp_avg", exp_avg}, std::pair{"exp_avg_sq", exp_avg_sq}}) {
    for (int k = 0; k < 3; ++k) {
      const std::int64_t n = std::min<std::int64_t>(4, 10 - 4 * k);
      shard.set(fmt::format("state.0.0.{}.{}", field, k), t.narrow(0, 4 * k, n).clone());
    }
  }
  const std::string path = dir / "optimizer_zero_1.safetensors";
  write_container(Env::posix(), path, shard.to_container());
  const ContainerHeader header = header_of(path);

  // Elements [15, 17) of the flat space: piece elements [5, 7), inside chunk 1 alone.
  std::uint64_t read = 0;
  Container part = load_container_part(Env::posix(), path,
                                       detail::zero_shard_filter(layout, 15, 17), nullptr, &read);
  std::vector<std::string> names;
  for (const auto& [name, t] : part.tensors) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"state.0.0.exp_avg.1", "state.0.0.exp_avg_sq.1"}));
  EXPECT_EQ(read, header.data_start + 4 * sizeof(float) + 4 * sizeof(double));
  const detail::ZeroShard parsed =
      detail::ZeroShard::parse(StateDict::from_container(part), layout, 1, path);
  ASSERT_EQ(parsed.pieces.size(), 1u);
  ASSERT_EQ(parsed.pieces.begin()->second.runs.size(), 1u);
  EXPECT_EQ(parsed.pieces.begin()->second.runs[0].begin, 14);
  EXPECT_EQ(parsed.pieces.begin()->second.runs[0].numel, 4);
  std::map<int, detail::ZeroShard> shards;
  shards.emplace(1, parsed);
  StateDict got = detail::zero_piece_state(layout, shards, layout.params[0], 15, 2, path);
  EXPECT_EQ(got.keys(), (std::vector<std::string>{"step", "exp_avg", "exp_avg_sq"}));
  EXPECT_EQ(got.get<int>("step"), 7);
  EXPECT_TRUE(testing::bitwise_equal(got.tensor("exp_avg"), exp_avg.narrow(0, 5, 2)));
  EXPECT_TRUE(testing::bitwise_equal(got.tensor("exp_avg_sq"), exp_avg_sq.narrow(0, 5, 2)));

  // Across a chunk boundary, [17, 19): chunks 1 and 2 of each field, assembled in order.
  shards[1] = detail::ZeroShard::parse(
      StateDict::from_container(load_container_part(
          Env::posix(), path, detail::zero_shard_filter(layout, 17, 19), nullptr, &read)),
      layout, 1, path);
  EXPECT_EQ(read, header.data_start + 6 * sizeof(float) + 6 * sizeof(double));
  got = detail::zero_piece_state(layout, shards, layout.params[0], 17, 2, path);
  EXPECT_TRUE(testing::bitwise_equal(got.tensor("exp_avg"), exp_avg.narrow(0, 7, 2)));
  EXPECT_TRUE(testing::bitwise_equal(got.tensor("exp_avg_sq"), exp_avg_sq.narrow(0, 7, 2)));

  // Damage in chunk 0 of exp_avg: unseen by [15, 17), Corruption naming it for [10, 12).
  const TensorEntry* chunk0 = nullptr;
  for (const TensorEntry& e : header.entries) {
    if (e.name == "state.0.0.exp_avg.0") chunk0 = &e;
  }
  ASSERT_NE(chunk0, nullptr);
  testing::flip_bit(path, header.data_start + chunk0->begin + 2, 5);
  EXPECT_EQ(load_container_part(Env::posix(), path, detail::zero_shard_filter(layout, 15, 17),
                                nullptr, nullptr)
                .tensors.size(),
            2u);
  testing::expect_error(
      [&] {
        load_container_part(Env::posix(), path, detail::zero_shard_filter(layout, 10, 12),
                            nullptr, nullptr);
      },
      ErrorCode::Corruption, {"state.0.0.exp_avg.0", "fails its checksum"});

  // A chunk of the wrong size, a chunk past the piece's end, and a key that is not a chunk.
  for (const auto& [key, n] : std::vector<std::pair<std::string, std::int64_t>>{
           {"state.0.0.exp_avg.1", 3}, {"state.0.0.exp_avg.3", 2}, {"state.0.0.exp_avg", 10}}) {
    StateDict bad = shard;
    bad.erase("state.0.0.exp_avg.1");
    bad.set(key, testing::make_tensor(at::kFloat, {n}, 9));
    testing::expect_error([&] { detail::ZeroShard::parse(bad, layout, 1, path); },
                          ErrorCode::Corruption, {"optimizer_zero_1", key});
  }
}

}  // namespace
}  // namespace torchpoint
