// The io and format layers: container round trips, corruption, bad input, directory
// checkpoints, locking and naming.
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <thread>

#include "compat/torch_compat.h"
#include "format/checksum.h"
#include "format/container.h"
#include "format/dtype.h"
#include "format/json_depth.h"
#include "format/ordered_json.h"
#include "io/atomic_commit.h"
#include "io/filename.h"
#include "io/posix_error.h"
#include "testing/fault_env.h"
#include "testing/test_util.h"
#include "torchpoint/checkpoint_dir.h"
#include "torchpoint/error.h"
#include "torchpoint/interop.h"
#include "torchpoint/state_dict.h"
#include "torchpoint/tensor_file.h"

namespace torchpoint {
namespace {

using testing::bitwise_equal;
using testing::expect_error;
using testing::make_tensor;
using testing::TempDir;

const std::vector<c10::ScalarType> kAllDtypes = {at::kBool,  at::kByte,  at::kChar, at::kShort,
                                                 at::kInt,   at::kLong,  at::kHalf, at::kBFloat16,
                                                 at::kFloat, at::kDouble};

const std::vector<std::vector<std::int64_t>> kShapes = {{},  {0},    {0, 3},   {1},
                                                        {7}, {3, 5}, {2, 3, 4}};

void expect_same(const Container& a, const Container& b) {
  ASSERT_EQ(a.tensors.size(), b.tensors.size());
  for (std::size_t i = 0; i < a.tensors.size(); ++i) {
    EXPECT_EQ(a.tensors[i].first, b.tensors[i].first) << "order differs at " << i;
    EXPECT_TRUE(bitwise_equal(a.tensors[i].second, b.tensors[i].second)) << a.tensors[i].first;
  }
  // A null state is saved as an empty object.
  EXPECT_EQ(a.state.is_null() ? Json::object() : a.state, b.state);
}

Container mixed_container() {
  Container c;
  std::uint64_t seed = 1;
  for (c10::ScalarType dtype : kAllDtypes) {
    for (const auto& shape : kShapes) {
      std::string name = fmt::format("{}.{}d.{}", c10::toString(dtype), shape.size(), seed);
      c.tensors.emplace_back(name, make_tensor(dtype, shape, seed++));
    }
  }
  c.state = {{"epoch", 3}, {"lr", 0.1}, {"tiny", 5e-324}, {"name", "ünï"}, {"list", {1, 2, 3}}};
  return c;
}

// Rewrites the header checksum of a container after a deliberate edit.
void reseal_header(std::string& bytes) {
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<std::uint8_t>(bytes[i]);
  std::string key = fmt::format("\"{}\":\"", kHeaderChecksumKey);
  std::size_t at = bytes.rfind(key, 8 + n) + key.size();
  bytes.replace(at, 16, std::string(16, '0'));
  bytes.replace(at, 16, checksum_hex(xxh3(bytes.data(), 8 + n)));
}

std::uint64_t data_start_of(const std::string& path) {
  std::string bytes = testing::read_bytes(path);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<std::uint8_t>(bytes[i]);
  return 8 + n;
}

TEST(Container, RoundTripsEveryDtypeAndShapeBitForBit) {
  TempDir dir;
  Container c = mixed_container();
  save_file(dir / "a.safetensors", c);
  Container back = load_file(dir / "a.safetensors");
  expect_same(c, back);
  EXPECT_EQ(back.state["tiny"].get<double>(), 5e-324);
  EXPECT_EQ(data_start_of(dir / "a.safetensors") % 8, 0u);
}

TEST(Container, WritesNonContiguousTensorsContiguously) {
  TempDir dir;
  at::Tensor base = make_tensor(at::kFloat, {6, 8}, 7);
  at::Tensor transposed = base.t();
  at::Tensor strided = base.slice(1, 0, 8, 3);
  save_file(dir / "nc.safetensors", {{{"t", transposed}, {"s", strided}}});
  Container back = load_file(dir / "nc.safetensors");
  EXPECT_TRUE(back.tensors[0].second.equal(transposed));
  EXPECT_TRUE(back.tensors[1].second.equal(strided));
  EXPECT_TRUE(back.tensors[0].second.is_contiguous());
}

TEST(Container, LargeTensorsRoundTripThroughTheDirectIoPipeline) {
  TempDir dir;
  Container c;
  c.tensors.emplace_back("small", make_tensor(at::kShort, {3}, 1));
  c.tensors.emplace_back("big", make_tensor(at::kFloat, {5, 1024, 1024}, 2));  // 20 MiB
  c.tensors.emplace_back("odd", make_tensor(at::kDouble, {12345}, 3));
  save_file(dir / "big.safetensors", c);
  expect_same(c, load_file(dir / "big.safetensors"));
  std::uint64_t data = 3 * 2 + 5 * 1024 * 1024 * 4 + 12345 * 8;
  EXPECT_EQ(testing::file_size(dir / "big.safetensors"),
            data_start_of(dir / "big.safetensors") + data)
      << "the O_DIRECT padding must be cut off";
}

TEST(Container, KeepsTheOrderOfThousandsOfSmallTensors) {
  TempDir dir;
  Container c;
  for (int i = 0; i < 3000; ++i) {
    c.tensors.emplace_back(fmt::format("t{}", (i * 7919) % 3000),
                           make_tensor(i % 2 ? at::kFloat : at::kHalf, {i % 5, 3}, i));
  }
  save_file(dir / "many.safetensors", c);
  expect_same(c, load_file(dir / "many.safetensors"));
}

TEST(Container, LoadedTensorsAreWritableAndOutliveTheFile) {
  TempDir dir;
  at::Tensor t = at::randn({1000});
  save_file(dir / "w.safetensors", {{{"t", t}}});
  Container back = load_file(dir / "w.safetensors");
  Env::posix().remove_file(dir / "w.safetensors");
  back.tensors[0].second.add_(1.0);
  EXPECT_TRUE(back.tensors[0].second.equal(t + 1.0));
}

// What a file goes through after a load never reaches the loaded tensors. Each case has its
// control: the opt-in zero-copy load shows the very effect the default load must not have.
Container big_container() {
  // 12 MiB in three tensors, so the verifier's bounded reads take several pieces.
  return {{{"a", at::arange(1 << 20, at::kFloat)},
           {"b", at::arange(1 << 20, at::kDouble)},
           {"c", at::arange(1 << 20, at::kFloat) * 2}},
          {{"step", 1}}};
}

// Overwrites every data byte of `path` in place (same inode, same size), as `dd conv=notrunc`.
void overwrite_data_in_place(const std::string& path) {
  std::string bytes = testing::read_bytes(path);
  std::uint64_t start = data_start_of(path);
  std::fill(bytes.begin() + static_cast<std::ptrdiff_t>(start), bytes.end(), '\x7f');
  std::ofstream out(path, std::ios::binary | std::ios::in | std::ios::out);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  ASSERT_TRUE(out.good());
}

// big_container() saved at `path`, then loaded by load_file and by load_file_mapped.
struct LoadedBothWays {
  Container saved, copied, mapped;
};
LoadedBothWays save_and_load_both_ways(const std::string& path) {
  LoadedBothWays out{big_container(), {}, {}};
  save_file(path, out.saved);
  out.copied = load_file(path);
  out.mapped = load_file_mapped(path);
  return out;
}

TEST(ChangingFiles, TensorsLoadedNeverChangeWhenTheFileIsOverwrittenInPlace) {
  TempDir dir;
  const std::string path = dir / "w.safetensors";
  auto [saved, copied, mapped] = save_and_load_both_ways(path);
  expect_same(saved, mapped);
  overwrite_data_in_place(path);
  expect_same(saved, copied);
  // Control: the mapped tensors do see the new bytes, which is what the test would catch.
  EXPECT_FALSE(bitwise_equal(mapped.tensors[0].second, saved.tensors[0].second));
  EXPECT_FALSE(verify(path).ok());
}

// Touches every byte of `t` in a forked child; returns the child's wait status.
int touch_in_child(const at::Tensor& t) {
  const volatile std::uint8_t* p = static_cast<const std::uint8_t*>(t.data_ptr());
  std::size_t n = t.nbytes();
  pid_t pid = ::fork();
  if (pid == 0) {
    ::signal(SIGBUS, SIG_DFL);  // a sanitizer's handler would turn the signal into an exit code
    std::uint8_t sum = 0;
    for (std::size_t i = 0; i < n; i += 512) sum = static_cast<std::uint8_t>(sum + p[i]);
    ::_exit(sum == 255 ? 3 : 0);  // any exit code but a signal means it read everything
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return status;
}

TEST(ChangingFiles, TensorsLoadedSurviveTheFileBeingTruncated) {
  TempDir dir;
  const std::string path = dir / "w.safetensors";
  auto [saved, copied, mapped] = save_and_load_both_ways(path);
  testing::truncate_to(path, 100);  // as `cp smaller.safetensors w.safetensors` does
  int status = touch_in_child(copied.tensors[1].second);
  EXPECT_TRUE(WIFEXITED(status)) << "signal " << WTERMSIG(status);
  expect_same(saved, copied);
  // Control: past the new end of the file, the mapped tensor faults.
  status = touch_in_child(mapped.tensors[1].second);
  ASSERT_TRUE(WIFSIGNALED(status));
  EXPECT_EQ(WTERMSIG(status), SIGBUS);
}

// A file truncated after its header was read but before its data was: both loads and verify
// say so with a Corruption error naming the file; none is killed by SIGBUS.
TEST(ChangingFiles, TruncationDuringALoadOrVerifyIsAnErrorNotASignal) {
  TempDir dir;
  const std::string path = dir / "w.safetensors";
  save_file(path, big_container());
  const std::string kept = testing::read_bytes(path);
  auto truncate_after_header = [&](testing::FaultEnv& env) {
    // The env copies its hook for every call: the count lives outside it.
    auto reads = std::make_shared<int>(0);
    env.set_before_op([&path, &kept, reads](testing::Op op, const std::string&) {
      // The header takes two reads (its length, then the JSON); the third reads data.
      if (op == testing::Op::Read && ++*reads == 3) testing::truncate_to(path, kept.size() / 2);
    });
  };
  {
    testing::FaultEnv env;
    truncate_after_header(env);
    expect_error([&] { load_file(path, env); }, ErrorCode::Corruption, {path, "truncated"});
  }
  testing::write_bytes(path, kept);
  {
    testing::FaultEnv env;
    truncate_after_header(env);
    expect_error([&] { load_file_mapped(path, env); }, ErrorCode::Corruption, {path, "truncated"});
  }
  testing::write_bytes(path, kept);
  {
    testing::FaultEnv env;
    truncate_after_header(env);
    VerifyReport report = verify(path, env);
    ASSERT_FALSE(report.ok());
    EXPECT_NE(report.problems[0].find("truncated"), std::string::npos) << report.problems[0];
  }
  testing::write_bytes(path, kept);
  EXPECT_TRUE(verify(path).ok()) << "control: the restored file verifies";
}

// verify and load_file in a loop while another thread truncates and regrows the file (the
// operator's `cp` over a checkpoint being checked): every result is a clean verdict, never a
// signal, and never a wrong "ok" for bytes that were not the saved ones.
TEST(ChangingFiles, VerifyAndLoadWhileTheFileIsTruncatedAndRegrown) {
  TempDir dir;
  const std::string path = dir / "w.safetensors";
  Container saved = big_container();
  save_file(path, saved);
  const std::string kept = testing::read_bytes(path);
  std::atomic<bool> stop{false};
  std::thread churn([&] {
    while (!stop.load()) {
      testing::truncate_to(path, 4096);
      std::ofstream out(path, std::ios::binary | std::ios::in | std::ios::out);
      out.write(kept.data(), static_cast<std::streamsize>(kept.size()));
    }
  });
  for (int i = 0; i < 40; ++i) {
    VerifyReport report = verify(path);
    if (!report.ok()) {
      EXPECT_EQ(report.worst_code(), ErrorCode::Corruption) << report.problems[0];
    }
    try {
      Container back = load_file(path);
      expect_same(saved, back);  // whatever loads is exactly what was saved
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::Corruption) << e.what();
    }
  }
  stop = true;
  churn.join();
  EXPECT_TRUE(verify(path).ok());
}

// parse_ordered_json gives exactly what ordered_json::parse gives (values, key order, duplicate
// keys keeping their first position and last value), for small objects and for the large ones it
// indexes, and throws the same exception types.
TEST(OrderedJson, ParsesExactlyAsNlohmannDoes) {
  std::vector<std::string> texts = {
      "null",
      "true",
      "-3",
      "18446744073709551615",
      "1.5e300",
      "\"\\u00e9\"",
      "[]",
      "{}",
      R"({"b":1,"a":[1,{"z":null,"y":[[]]}],"c":{"k":"v"}})",
      R"({"a":1,"b":2,"a":3})",            // duplicate: first position, last value
      R"([{"x":{"x":{"x":1}}},{"x":2}])",  // the same key at several depths
  };
  // Objects past the indexing threshold, with duplicates early, late and repeated.
  for (int n : {31, 32, 33, 200}) {
    std::string big = "{";
    for (int i = 0; i < n; ++i) big += fmt::format("\"k{}\":{},", i, i);
    big += R"("k0":"again","k31":[1],"k0":"last","k199":{}})";
    texts.push_back(big);
    texts.push_back("[" + big + "," + big + "]");
  }
  for (const std::string& text : texts) {
    SCOPED_TRACE(text.substr(0, 80));
    Json want = Json::parse(text);
    Json got = parse_ordered_json(text);
    EXPECT_EQ(got, want);
    EXPECT_EQ(got.dump(), want.dump()) << "same key order";
  }
  for (const char* bad : {"", "{", R"({"a":})", "[1,]", R"({"a" 1})", "1e99999", "nul"}) {
    SCOPED_TRACE(bad);
    std::size_t want_byte = 0;
    try {
      Json accepted = Json::parse(bad);
      ADD_FAILURE() << "nlohmann accepted it: " << accepted.dump();
    } catch (const Json::parse_error& e) {
      want_byte = e.byte;
    } catch (const Json::out_of_range&) {
      want_byte = 0;
    }
    try {
      Json accepted = parse_ordered_json(bad);
      ADD_FAILURE() << "accepted: " << accepted.dump();
    } catch (const Json::parse_error& e) {
      EXPECT_EQ(e.byte, want_byte);
    } catch (const Json::out_of_range&) {
      EXPECT_EQ(want_byte, 0u);
    }
  }
}

// 100,000 JSON values in a state and 100,000 metadata keys in a manifest round-trip in order.
// (How long they take is the benchmark's business: torchpoint_bench --states J.)
TEST(OrderedJson, HundredThousandKeysRoundTripInOrder) {
  TempDir dir;
  constexpr int kKeys = 100'000;
  StateDict state;
  Json metadata = Json::object();
  for (int i = 0; i < kKeys; ++i) {
    // Descending, so that an order kept by sorting would be caught.
    std::string key = fmt::format("key.{:06d}", kKeys - i);
    state.set(key, Json(i));
    append_new_key(metadata, key, Json(i));
  }
  save_file(dir / "state.ckpt", state.to_container());
  StateDict back = StateDict::from_container(load_file(dir / "state.ckpt"));
  ASSERT_EQ(back.keys(), state.keys());
  EXPECT_EQ(back.value(state.keys()[kKeys - 1]), Json(kKeys - 1));

  CheckpointInfo info;
  info.metadata = metadata;
  save_directory(dir / "checkpoint_0", {{"model", {{{"w", at::ones({2})}}, {}}}}, info);
  DirectoryCheckpoint loaded = load_directory(dir / "checkpoint_0");
  EXPECT_EQ(loaded.info.metadata.dump(), metadata.dump());
}

TEST(Container, SaveReplacesAtomicallyAndLeavesNoTemporary) {
  TempDir dir;
  save_file(dir / "s.ckpt", {{{"v", at::ones({2})}}, {{"n", 1}}});
  save_file(dir / "s.ckpt", {{{"v", at::zeros({2})}}, {{"n", 2}}});
  EXPECT_EQ(load_file(dir / "s.ckpt").state["n"], 2);
  EXPECT_EQ(testing::list_sorted(dir.path()), std::vector<std::string>{"s.ckpt"});
}

TEST(Container, PythonReaderThatKnowsOnlyTheSpecAcceptsOurFiles) {
  TempDir dir;
  nlohmann::json expect = nlohmann::json::object();
  Container c;
  c.tensors.emplace_back("f32", at::tensor({1.5f, -2.25f, 3.0f}).reshape({3, 1}));
  c.tensors.emplace_back("i64", at::tensor({int64_t{-7}, int64_t{1} << 40}));
  c.tensors.emplace_back("b", at::tensor({1, 0, 1}).to(at::kBool));
  c.tensors.emplace_back("h", at::tensor({0.5f, 2.0f}).to(at::kHalf));
  c.tensors.emplace_back("bf", at::tensor({1.0f, -3.0f}).to(at::kBFloat16));
  c.tensors.emplace_back("u8", at::tensor({0, 255}).to(at::kByte));
  c.tensors.emplace_back("scalar", at::scalar_tensor(2.5, at::kDouble));
  c.tensors.emplace_back("empty", at::empty({0, 4}, at::kInt));
  save_file(dir / "py.safetensors", c);
  save_file(dir / "mixed.safetensors", mixed_container());
  Container big;
  big.tensors.emplace_back("big", make_tensor(at::kFloat, {600, 1024}, 9));
  big.tensors.emplace_back("tail", at::tensor({int16_t{1}, int16_t{2}, int16_t{3}}));
  save_file(dir / "big.safetensors", big);
  nlohmann::json values = {
      {"f32", {{"dtype", "F32"}, {"shape", {3, 1}}, {"values", {1.5, -2.25, 3.0}}}},
      {"i64", {{"dtype", "I64"}, {"shape", {2}}, {"values", {-7, int64_t{1} << 40}}}},
      {"b", {{"dtype", "BOOL"}, {"shape", {3}}, {"values", {true, false, true}}}},
      {"h", {{"dtype", "F16"}, {"shape", {2}}, {"values", {0.5, 2.0}}}},
      {"bf", {{"dtype", "BF16"}, {"shape", {2}}, {"values", {1.0, -3.0}}}},
      {"u8", {{"dtype", "U8"}, {"shape", {2}}, {"values", {0, 255}}}},
      {"scalar", {{"dtype", "F64"}, {"shape", nlohmann::json::array()}, {"values", {2.5}}}},
      {"empty", {{"dtype", "I32"}, {"shape", {0, 4}}, {"values", nlohmann::json::array()}}},
  };
  expect[dir / "py.safetensors"] = values;
  std::ofstream(dir / "expect.json") << expect.dump();
  const char* src = std::getenv("TORCHPOINT_SOURCE_DIR");
  ASSERT_NE(src, nullptr) << "TORCHPOINT_SOURCE_DIR is set by CTest";
  std::string cmd = fmt::format("{} {}/tests/python/check_safetensors.py --expect-json {} {} {} {}",
                                testing::python(), src, dir / "expect.json", dir / "py.safetensors",
                                dir / "mixed.safetensors", dir / "big.safetensors");
  int rc = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(rc));
  EXPECT_EQ(WEXITSTATUS(rc), 0) << cmd;
}

TEST(Container, EveryHeaderByteFlipIsDetected) {
  TempDir dir;
  Container c = mixed_container();
  std::string path = dir / "h.safetensors";
  save_file(path, c);
  std::string pristine = testing::read_bytes(path);
  std::uint64_t data_start = data_start_of(path);
  int detected = 0;
  for (std::uint64_t i = 0; i < data_start; ++i) {
    std::string bytes = pristine;
    bytes[i] = static_cast<char>(bytes[i] ^ (1 << (i % 8)));
    testing::write_bytes(path, bytes);
    try {
      load_file(path);
      ADD_FAILURE() << "flip of bit " << i % 8 << " of header byte " << i << " went unnoticed";
    } catch (const Error& e) {
      EXPECT_EQ(e.code(), ErrorCode::Corruption) << "byte " << i << ": " << e.what();
      EXPECT_NE(std::string(e.what()).find(path), std::string::npos);
      ++detected;
    }
    EXPECT_FALSE(verify(path).ok()) << "byte " << i;
  }
  EXPECT_EQ(detected, static_cast<int>(data_start));
}

TEST(Container, DataFlipsAreDetectedAndNameTheTensor) {
  TempDir dir;
  Container c;
  for (int i = 0; i < 6; ++i) {
    c.tensors.emplace_back(fmt::format("layer{}.weight", i), make_tensor(at::kFloat, {64, 33}, i));
  }
  std::string path = dir / "d.safetensors";
  save_file(path, c);
  std::string pristine = testing::read_bytes(path);
  std::uint64_t start = data_start_of(path);
  std::uint64_t per_tensor = 64 * 33 * 4;
  int checked = 0;
  for (int t = 0; t < 6; ++t) {
    for (std::uint64_t k = 0; k < per_tensor; k += 211) {
      std::string bytes = pristine;
      std::uint64_t at = start + t * per_tensor + k;
      bytes[at] = static_cast<char>(bytes[at] ^ (1 << (k % 8)));
      testing::write_bytes(path, bytes);
      Error e = expect_error([&] { load_file(path); }, ErrorCode::Corruption);
      EXPECT_NE(std::string(e.what()).find(fmt::format("'layer{}.weight'", t)), std::string::npos)
          << e.what();
      ++checked;
    }
  }
  EXPECT_GT(checked, 200);
}

TEST(Container, TruncationAtEveryLengthClassIsDetected) {
  TempDir dir;
  std::string path = dir / "t.safetensors";
  save_file(path, mixed_container());
  std::string pristine = testing::read_bytes(path);
  std::uint64_t start = data_start_of(path);
  std::vector<std::uint64_t> lengths = {0,
                                        7,
                                        8,
                                        9,
                                        start / 2,
                                        start - 1,
                                        start,
                                        start + 1,
                                        (start + pristine.size()) / 2,
                                        pristine.size() - 1};
  for (std::uint64_t len : lengths) {
    testing::write_bytes(path, pristine.substr(0, len));
    Error e = expect_error([&] { load_file(path); }, ErrorCode::Corruption);
    EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
    EXPECT_FALSE(verify(path).ok()) << "length " << len;
  }
}

TEST(Container, VerifyReportsEveryCorruptTensorNotOnlyTheFirst) {
  TempDir dir;
  std::string path = dir / "v.safetensors";
  save_file(path, {{{"a", make_tensor(at::kFloat, {100}, 1)},
                    {"b", make_tensor(at::kFloat, {100}, 2)},
                    {"c", make_tensor(at::kFloat, {100}, 3)}}});
  EXPECT_TRUE(verify(path).ok());
  std::uint64_t start = data_start_of(path);
  testing::flip_bit(path, start + 10, 3);           // in a
  testing::flip_bit(path, start + 2 * 400 + 5, 0);  // in c
  VerifyReport report = verify(path);
  ASSERT_EQ(report.problems.size(), 2u);
  EXPECT_NE(report.problems[0].find("'a'"), std::string::npos) << report.problems[0];
  EXPECT_NE(report.problems[1].find("'c'"), std::string::npos) << report.problems[1];
}

TEST(BadInput, MissingPathIsNotFound) {
  TempDir dir;
  Error e = expect_error([&] { load_file(dir / "nope.safetensors"); }, ErrorCode::NotFound);
  EXPECT_NE(std::string(e.what()).find("nope.safetensors"), std::string::npos);
  expect_error([&] { load_directory(dir / "nope"); }, ErrorCode::NotFound);
  EXPECT_FALSE(verify(dir / "nope").ok());
}

TEST(BadInput, DirectoryThatIsNotACheckpointIsNotFound) {
  TempDir dir;
  Env::posix().mkdir(dir / "plain");
  testing::write_bytes(dir / "plain/model.safetensors", "junk");
  Error e = expect_error([&] { load_directory(dir / "plain"); }, ErrorCode::NotFound);
  EXPECT_NE(std::string(e.what()).find("manifest.json"), std::string::npos) << e.what();
  expect_error([&] { load_directory(dir / "plain/model.safetensors"); },
               ErrorCode::InvalidArgument);
}

TEST(BadInput, NonContainerFilesAreCorruption) {
  TempDir dir;
  testing::write_bytes(dir / "x", std::string("\xff\xff\xff\xff\xff\xff\xff\x7f", 8) + "{}");
  expect_error([&] { load_file(dir / "x"); }, ErrorCode::Corruption);
  testing::write_bytes(dir / "y", std::string("\x02\0\0\0\0\0\0\0{}", 10));
  expect_error([&] { load_file(dir / "y"); }, ErrorCode::Corruption);
}

TEST(BadInput, FutureMajorVersionIsIncompatibleAndNamesBothVersions) {
  TempDir dir;
  std::string path = dir / "future.safetensors";
  save_file(path, {{{"w", at::ones({2})}}});
  std::string bytes = testing::read_bytes(path);
  std::size_t at = bytes.find(R"(format_version\":\"1.0)");
  ASSERT_NE(at, std::string::npos);
  bytes.replace(at + 19, 3, "7.2");
  reseal_header(bytes);
  testing::write_bytes(path, bytes);
  Error e = expect_error([&] { load_file(path); }, ErrorCode::Incompatible);
  EXPECT_NE(std::string(e.what()).find("7.2"), std::string::npos) << e.what();
  EXPECT_NE(std::string(e.what()).find("1.0"), std::string::npos) << e.what();
}

// Replaces the header JSON of a container's bytes with `text` (the data keeps its place
// relative to the header's end) and reseals its checksum.
void rewrite_header(std::string& bytes, const std::string& text) {
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<std::uint8_t>(bytes[i]);
  bytes.replace(8, n, text);
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((text.size() >> (8 * i)) & 0xff);
  reseal_header(bytes);
}

std::string header_text(const std::string& bytes) {
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<std::uint8_t>(bytes[i]);
  return bytes.substr(8, n);
}

// Headers are read by a fast reader (simdjson) that takes only what torchpoint writes and
// leaves anything else to the full reader (nlohmann). Odd but valid JSON, sealed with a good
// checksum, is judged as it always was: here a duplicate key, text after the root object and a
// tensor named twice.
TEST(BadInput, OddHeadersAreJudgedAsBefore) {
  TempDir dir;
  std::string path = dir / "odd.safetensors";
  save_file(path, {{{"aa", at::ones({2})}, {"bb", at::full({3}, 2.0)}}});
  const std::string good = testing::read_bytes(path);
  const std::string text = header_text(good);
  {
    // "dtype" twice in one entry: JSON readers keep the last, so the file still loads.
    std::string bytes = good;
    std::size_t at = text.find("\"dtype\":\"F32\"");
    ASSERT_NE(at, std::string::npos) << text;
    std::string edited = text;
    edited.insert(at, "\"dtype\":\"I64\",");
    rewrite_header(bytes, edited);
    testing::write_bytes(path, bytes);
    Container back = load_file(path);
    ASSERT_EQ(back.tensors.size(), 2u);
    EXPECT_TRUE(back.tensors[1].second.equal(at::full({3}, 2.0)));
    EXPECT_TRUE(verify(path).ok());
  }
  {
    // A complete JSON object before the real one: not one JSON value.
    std::string bytes = good;
    rewrite_header(bytes, "{\"x\":1} " + text);
    testing::write_bytes(path, bytes);
    expect_error([&] { load_file(path); }, ErrorCode::Corruption,
                 {"not valid JSON", "syntax error at byte"});
    EXPECT_FALSE(verify(path).ok());
  }
  {
    // "bb" renamed "aa": the reader keeps the last, whose bytes leave a hole where the first
    // one's were.
    std::string bytes = good;
    std::string edited = text;
    std::size_t at = edited.find("\"bb\":{");
    ASSERT_NE(at, std::string::npos) << text;
    edited.replace(at, 4, "\"aa\"");
    rewrite_header(bytes, edited);
    testing::write_bytes(path, bytes);
    expect_error([&] { load_file(path); }, ErrorCode::Corruption, {"a hole"});
    EXPECT_FALSE(verify(path).ok());
  }
}

// Nesting is bounded wherever a header holds it: in a member of a tensor's entry or of
// __metadata__ that torchpoint does not read, in the torchpoint metadata or its state. Up to
// 1,000 levels in all the file loads; one more and it is refused, naming the bound.
TEST(BadInput, NestingIsBoundedWhereverAHeaderHoldsIt) {
  TempDir dir;
  std::string path = dir / "deep.safetensors";
  save_file(path, {{{"aa", at::ones({2})}, {"bb", at::full({3}, 2.0)}}, {{"k", 1}}});
  const std::string good = testing::read_bytes(path);
  const std::string text = header_text(good);
  auto nested = [](int depth) { return std::string(depth, '[') + std::string(depth, ']'); };
  struct Place {
    std::string where;     // inserted after the first occurrence of this
    std::string member;    // the member's name as it reads in the header text
    int levels_above;      // arrays and objects around the inserted value
    std::string refusal;   // what the error says past the bound
  };
  const std::vector<Place> places = {
      {"\"aa\":{", "\"x\":", 2, "header JSON nests deeper than 1000 levels"},
      {"\"__metadata__\":{", "\"x\":", 2, "header JSON nests deeper than 1000 levels"},
      {"\"{\\\"format\\\"", "", 1, "torchpoint metadata nests deeper than 1000 levels"},
      {"\\\"state\\\":{", "\\\"deep\\\":", 2,
       "torchpoint metadata nests deeper than 1000 levels"},
  };
  for (const Place& place : places) {
    for (int extra : {0, 1}) {
      SCOPED_TRACE(place.where + (extra ? " past the bound" : " at the bound"));
      std::size_t at = text.find(place.where);
      ASSERT_NE(at, std::string::npos) << text;
      at += place.where.size();
      std::string member = place.member;
      if (member.empty()) {  // the torchpoint metadata itself: after its opening brace
        at = text.find(',', text.find(place.where)) + 1;
        member = "\\\"x\\\":";
      }
      std::string edited = text;
      edited.insert(at, member + nested(kMaxJsonDepth - place.levels_above + extra) + ",");
      std::string bytes = good;
      rewrite_header(bytes, edited);
      testing::write_bytes(path, bytes);
      if (extra == 0) {
        Container back = load_file(path);
        ASSERT_EQ(back.tensors.size(), 2u);
        EXPECT_TRUE(back.tensors[1].second.equal(at::full({3}, 2.0)));
        EXPECT_TRUE(verify(path).ok());
      } else {
        expect_error([&] { load_file(path); }, ErrorCode::Corruption, {place.refusal});
        EXPECT_FALSE(verify(path).ok());
      }
    }
  }
}

TEST(BadInput, UnsupportedDtypesAreRefusedOnSaveAndLoad) {
  TempDir dir;
  Error e = expect_error(
      [&] {
        save_file(dir / "c.safetensors", {{{"z", at::zeros({2}, at::kComplexFloat)}}});
      },
      ErrorCode::Unsupported);
  EXPECT_NE(std::string(e.what()).find("'z'"), std::string::npos) << e.what();
  EXPECT_FALSE(Env::posix().stat(dir / "c.safetensors").exists);
  EXPECT_TRUE(testing::list_sorted(dir.path()).empty()) << "no temporary may remain";

  // A U16 tensor: LibTorch 2.3 and later hold it, 1.13 refuses it naming tensor and dtype.
  std::string path = dir / "u16.safetensors";
  save_file(path, {{{"q", at::zeros({2}, at::kShort)}}});
  std::string bytes = testing::read_bytes(path);
  bytes.replace(bytes.find("\"I16\""), 5, "\"U16\"");
  reseal_header(bytes);
  testing::write_bytes(path, bytes);
  if (auto u16 = compat::scalar_type_for("U16")) {
    Container back = load_file(path);
    ASSERT_EQ(back.tensors.size(), 1u);
    EXPECT_EQ(back.tensors[0].second.scalar_type(), *u16);
  } else {
    expect_error([&] { load_file(path); }, ErrorCode::Unsupported, {"'q'", "U16", "LibTorch 1.13"});
  }
}

TEST(BadInput, BadTensorNamesAreInvalidArguments) {
  TempDir dir;
  expect_error(
      [&] {
        save_file(dir / "a", {{{"x", at::ones({1})}, {"x", at::ones({1})}}});
      },
      ErrorCode::InvalidArgument);
  expect_error([&] { save_file(dir / "a", {{{"", at::ones({1})}}}); }, ErrorCode::InvalidArgument);
  expect_error(
      [&] {
        save_file(dir / "a", {{{"__metadata__", at::ones({1})}}});
      },
      ErrorCode::InvalidArgument);
  expect_error(
      [&] {
        save_file(dir / "a", {{{"\xff\xfe", at::ones({1})}}});
      },
      ErrorCode::InvalidArgument);
  EXPECT_TRUE(testing::list_sorted(dir.path()).empty());
}

std::vector<Component> sample_components(int seed) {
  return {
      {"model",
       {{{"fc.weight", make_tensor(at::kFloat, {4, 3}, seed)},
         {"fc.bias", make_tensor(at::kFloat, {4}, seed + 1)}},
        {}}},
      {"optimizer", {{{"state.0.step", at::tensor(int64_t{seed})}}, {{"lr", 0.01 * seed}}}},
      {"random_states_0", {{{"cpu", make_tensor(at::kByte, {5056}, seed + 2)}}, {}}},
  };
}

TEST(Directory, RoundTripsComponentsAndManifest) {
  TempDir dir;
  std::string path = dir / "checkpoints/checkpoint_0";
  auto components = sample_components(3);
  CheckpointInfo info;
  info.step = 120;
  info.iteration = 0;
  info.metadata = {{"run", "exp1"}};
  save_directory(path, components, info);
  EXPECT_EQ(testing::list_sorted(path),
            (std::vector<std::string>{"manifest.json", "model.safetensors", "optimizer.safetensors",
                                      "random_states_0.safetensors"}));
  EXPECT_EQ(testing::list_sorted(dir / "checkpoints"),
            (std::vector<std::string>{".lock", "checkpoint_0"}));
  DirectoryCheckpoint back = load_directory(path);
  ASSERT_EQ(back.components.size(), 3u);
  for (std::size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(back.components[i].name, components[i].name);
    expect_same(components[i].contents, back.components[i].contents);
  }
  EXPECT_EQ(back.info.step, 120);
  EXPECT_EQ(back.info.metadata["run"], "exp1");
  EXPECT_EQ(back.libtorch_version, compat::torch_version());
  EXPECT_TRUE(verify(path).ok());
}

TEST(Directory, NeverWritesIntoACommittedCheckpoint) {
  TempDir dir;
  std::string path = dir / "checkpoint_1";
  save_directory(path, sample_components(1));
  Error e =
      expect_error([&] { save_directory(path, sample_components(2)); }, ErrorCode::InvalidArgument);
  EXPECT_NE(std::string(e.what()).find("never overwritten"), std::string::npos);
  expect_same(sample_components(1)[0].contents, load_directory(path).components[0].contents);
}

TEST(Directory, CorruptManifestOrFilesAreDetected) {
  TempDir dir;
  std::string path = dir / "checkpoint_2";
  save_directory(path, sample_components(2));
  std::string manifest = path + "/manifest.json";
  std::string pristine = testing::read_bytes(manifest);
  for (std::size_t i = 0; i < pristine.size(); i += 7) {
    std::string bytes = pristine;
    bytes[i] = static_cast<char>(bytes[i] ^ (1 << (i % 8)));
    testing::write_bytes(manifest, bytes);
    expect_error([&] { load_directory(path); }, ErrorCode::Corruption);
    EXPECT_FALSE(verify(path).ok());
  }
  testing::write_bytes(manifest, pristine);
  EXPECT_TRUE(verify(path).ok());

  testing::write_bytes(path + "/extra.safetensors", "x");
  VerifyReport extra = verify(path);
  ASSERT_EQ(extra.problems.size(), 1u);
  EXPECT_NE(extra.problems[0].find("not listed"), std::string::npos);
  Env::posix().remove_file(path + "/extra.safetensors");

  Env::posix().remove_file(path + "/optimizer.safetensors");
  Error e = expect_error([&] { load_directory(path); }, ErrorCode::Corruption);
  EXPECT_NE(std::string(e.what()).find("optimizer.safetensors"), std::string::npos);
}

TEST(Directory, ReplacedFileIsDetectedThroughTheManifest) {
  TempDir dir;
  save_directory(dir / "a", sample_components(1));
  save_directory(dir / "b", sample_components(2));
  // A valid file of the same size from another checkpoint must not pass for the original.
  Env::posix().remove_file(dir / "a/model.safetensors");
  testing::write_bytes(dir / "a/model.safetensors",
                       testing::read_bytes(dir / "b/model.safetensors"));
  expect_error([&] { load_directory(dir / "a"); }, ErrorCode::Corruption);
  EXPECT_FALSE(verify(dir / "a").ok());
}

// A checkpoint whose manifest is of a newer format version gets one problem, Incompatible, that
// says to upgrade; its files are not called strays "not listed in the manifest".
TEST(Directory, NewerFormatManifestIsOneIncompatibleProblem) {
  TempDir dir;
  const std::string checkpoint = dir / "checkpoint_0";
  save_directory(checkpoint, {{"model", {{{"w", at::ones({2})}}, {}}},
                              {"optimizer", {{{"m", at::zeros({2})}}, {}}}});
  ASSERT_TRUE(verify(checkpoint).ok()) << "control";
  const std::string manifest = checkpoint + "/manifest.json";
  testing::make_manifest_newer(manifest);

  VerifyReport report = verify(checkpoint);
  ASSERT_EQ(report.problems.size(), 1u) << fmt::format("{}", fmt::join(report.problems, "\n"));
  EXPECT_EQ(report.codes[0], ErrorCode::Incompatible);
  EXPECT_NE(report.problems[0].find("upgrade torchpoint"), std::string::npos) << report.problems[0];
  EXPECT_FALSE(report.proven_corrupt());
  expect_error([&] { load_directory(checkpoint); }, ErrorCode::Incompatible, {"upgrade"});
}

TEST(Directory, InvalidComponentNamesAreRefused) {
  TempDir dir;
  expect_error([&] { save_directory(dir / "c", {{"../evil", {}}}); }, ErrorCode::InvalidArgument);
  expect_error(
      [&] {
        save_directory(dir / "c", {{"m", {}}, {"m", {}}});
      },
      ErrorCode::InvalidArgument);
  EXPECT_FALSE(Env::posix().stat(dir / "c").exists);
}

TEST(Commit, StaleTemporariesAreRemovedAndOthersKept) {
  TempDir dir;
  Env& env = Env::posix();
  env.mkdir(dir / "checkpoint_3.tmp-999999999-00ff00ff00ff00ff");
  testing::write_bytes(dir / "checkpoint_3.tmp-999999999-00ff00ff00ff00ff/model.safetensors",
                       "half");
  testing::write_bytes(dir / "state.ckpt.tmp-999999998-abcdef0123456789", "half");
  testing::write_bytes(dir / "notes.tmp-txt", "mine");
  // A temporary that a live save of this process owns is kept; an abandoned one is not.
  PendingFile in_progress(Env::posix(), dir / "state.ckpt");
  std::string live = base_name(in_progress.temp_path());
  testing::write_bytes(dir / live, "in progress");
  testing::write_bytes(dir / temp_name("state.ckpt"), "abandoned by this process");
  env.mkdir(dir / "checkpoint_1");
  save_directory(dir / "checkpoint_4", sample_components(4));
  EXPECT_EQ(
      testing::list_sorted(dir.path()),
      (std::vector<std::string>{".lock", "checkpoint_1", "checkpoint_4", "notes.tmp-txt", live}));
}

TEST(Commit, SecondWriterInThisProcessIsLocked) {
  TempDir dir;
  ProjectLock first(Env::posix(), dir.path());
  Error e = expect_error([&] { ProjectLock second(Env::posix(), dir.path()); }, ErrorCode::Locked);
  EXPECT_NE(std::string(e.what()).find(".lock"), std::string::npos);
  expect_error([&] { save_directory(dir / "checkpoint_0", sample_components(0)); },
               ErrorCode::Locked);
  EXPECT_FALSE(Env::posix().stat(dir / "checkpoint_0").exists);
}

TEST(Commit, WriterInAnotherProcessIsLockedAndTheLockDiesWithIt) {
  TempDir dir;
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ProjectLock held(Env::posix(), dir.path());
    char c = 'x';
    [[maybe_unused]] auto n = ::write(ready[1], &c, 1);
    ::pause();  // until killed
    ::_exit(0);
  }
  char c;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  auto t0 = std::chrono::steady_clock::now();
  expect_error([&] { save_directory(dir / "checkpoint_0", sample_components(0)); },
               ErrorCode::Locked);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
  save_directory(dir / "checkpoint_0", sample_components(0));  // the lock died with the holder
  EXPECT_TRUE(verify(dir / "checkpoint_0").ok());
  ::close(ready[0]);
  ::close(ready[1]);
}

TEST(Names, CheckpointNamesParseOnlyTheirCanonicalForm) {
  EXPECT_EQ(checkpoint_name(10), "checkpoint_10");
  EXPECT_EQ(parse_checkpoint_name("checkpoint_10"), 10u);
  EXPECT_EQ(parse_checkpoint_name("checkpoint_0"), 0u);
  EXPECT_EQ(parse_checkpoint_name("checkpoint_100000"), 100000u);
  for (const char* bad : {"checkpoint_", "checkpoint_07", "checkpoint_1.tmp-1-ab", "checkpoint_x",
                          "checkpoint_-1", "ckpt_1", "checkpoint_99999999999999999999999"}) {
    EXPECT_FALSE(parse_checkpoint_name(bad).has_value()) << bad;
  }
  std::string tmp = temp_name("checkpoint_3");
  EXPECT_TRUE(tmp.starts_with("checkpoint_3.tmp-")) << tmp;
  EXPECT_TRUE(is_temp_name(tmp));
  EXPECT_NE(temp_name("a"), temp_name("a"));
  EXPECT_FALSE(is_temp_name("checkpoint_3"));
  EXPECT_FALSE(is_temp_name("notes.tmp-txt"));
  EXPECT_EQ(parent_path("a/b/c"), "a/b");
  EXPECT_EQ(parent_path("c"), ".");
  EXPECT_EQ(base_name("a/b/"), "b");
}

TEST(Errors, PosixErrorsCarryCodeContextAndHint) {
  Error full = posix_error("write of /x/model.safetensors", ENOSPC);
  EXPECT_EQ(full.code(), ErrorCode::IOError);
  EXPECT_NE(std::string(full.what()).find("/x/model.safetensors"), std::string::npos);
  EXPECT_NE(std::string(full.what()).find("disk is full"), std::string::npos);
  EXPECT_EQ(posix_error("open of /nope", ENOENT).code(), ErrorCode::NotFound);
  EXPECT_NE(std::string(posix_error("rename", EXDEV).what()).find("same file system"),
            std::string::npos);
}

}  // namespace
}  // namespace torchpoint

namespace torchpoint {
namespace {

std::string golden(const std::string& name) {
  const char* src = std::getenv("TORCHPOINT_SOURCE_DIR");
  return std::string(src ? src : ".") + "/tests/data/golden_v1/" + name;
}

TEST(Golden, Version1FilesLoadBitIdentically) {
  Container w = load_file(golden("w.safetensors"));
  ASSERT_EQ(w.tensors.size(), 1u);
  EXPECT_TRUE(testing::bitwise_equal(w.tensors[0].second, at::tensor({1.0f, 2.0f})));
  EXPECT_EQ(w.state, Json({{"step", 7}}));

  Container m = load_file(golden("mixed.safetensors"));
  std::vector<std::string> names;
  for (const auto& [name, t] : m.tensors) names.push_back(name);
  EXPECT_EQ(names, (std::vector<std::string>{"weight", "step", "mask", "half", "bf16", "empty"}));
  EXPECT_TRUE(
      testing::bitwise_equal(m.tensors[0].second, at::arange(6, at::kFloat).reshape({2, 3})));
  EXPECT_TRUE(
      testing::bitwise_equal(m.tensors[1].second, at::scalar_tensor(int64_t{42}, at::kLong)));
  EXPECT_TRUE(testing::bitwise_equal(m.tensors[2].second, at::tensor({1, 0, 1}).to(at::kBool)));
  EXPECT_TRUE(testing::bitwise_equal(m.tensors[3].second, at::tensor({0.5f, -1.5f}).to(at::kHalf)));
  EXPECT_TRUE(testing::bitwise_equal(m.tensors[4].second, at::tensor({3.0f}).to(at::kBFloat16)));
  EXPECT_EQ(m.tensors[5].second.sizes(), (std::vector<std::int64_t>{0, 2}));
  EXPECT_EQ(m.state, Json({{"epoch", 3}, {"lr", 0.1}, {"name", "golden"}}));

  DirectoryCheckpoint d = load_directory(golden("checkpoint_1"));
  EXPECT_EQ(d.info.step, 12);
  EXPECT_EQ(d.info.iteration, 1);
  EXPECT_EQ(d.info.metadata, Json({{"run", "golden"}}));
  ASSERT_EQ(d.components.size(), 2u);
  EXPECT_TRUE(testing::bitwise_equal(d.components[0].contents.tensors[0].second,
                                     at::arange(4, at::kFloat).reshape({2, 2})));
  EXPECT_EQ(d.components[1].contents.state, Json({{"type", "Adam"}}));
  EXPECT_TRUE(verify(golden("checkpoint_1")).ok());
}

// Format 2.0: a directory checkpoint whose model is sharded (tests/data/golden_v2/checkpoint_1,
// committed). With TORCHPOINT_WRITE_GOLDEN=1 and the folder absent, this writes it instead.
std::vector<Component> golden_v2_components() {
  return {{"model",
           {{{"frozen.a", at::arange(8, at::kFloat).reshape({2, 4})},
             {"frozen.b", at::arange(3, at::kLong)},
             {"head.w", at::tensor({1.5f, -2.0f})}},
            {{"kind", "golden-sharded"}}}},
          {"optimizer", {{{"step", at::scalar_tensor(int64_t{5}, at::kLong)}}, {{"type", "Adam"}}}}};
}

TEST(Golden, Version2ShardedCheckpointLoadsWhole) {
  const char* src = std::getenv("TORCHPOINT_SOURCE_DIR");
  const std::string path = std::string(src ? src : ".") + "/tests/data/golden_v2/checkpoint_1";
  const char* write = std::getenv("TORCHPOINT_WRITE_GOLDEN");
  if (write != nullptr && std::string(write) == "1" && !Env::posix().stat(path).exists) {
    SaveDirectoryOptions o;
    o.shard_size = 32;  // frozen.a fills shard 1, frozen.b shard 2, head.w shard 3
    o.frozen = {"model/frozen.a", "model/frozen.b"};
    CheckpointInfo info;
    info.step = 5;
    info.iteration = 1;
    info.metadata = {{"run", "golden-v2"}};
    save_directory(path, golden_v2_components(), info, Env::posix(), o);
  }
  std::vector<std::string> files = testing::list_sorted(path);
  EXPECT_EQ(files, (std::vector<std::string>{
                       "manifest.json", "model-00001-of-00003.safetensors",
                       "model-00002-of-00003.safetensors", "model-00003-of-00003.safetensors",
                       "model.safetensors.index.json", "optimizer.safetensors"}));
  DirectoryCheckpoint d = load_directory(path);
  EXPECT_EQ(d.info.step, 5);
  EXPECT_EQ(d.info.metadata, Json({{"run", "golden-v2"}}));
  std::vector<Component> expected = golden_v2_components();
  ASSERT_EQ(d.components.size(), expected.size());
  for (std::size_t c = 0; c < expected.size(); ++c) {
    EXPECT_EQ(d.components[c].name, expected[c].name);
    EXPECT_EQ(d.components[c].contents.state, expected[c].contents.state);
    ASSERT_EQ(d.components[c].contents.tensors.size(), expected[c].contents.tensors.size());
    for (std::size_t t = 0; t < expected[c].contents.tensors.size(); ++t) {
      EXPECT_EQ(d.components[c].contents.tensors[t].first, expected[c].contents.tensors[t].first);
      EXPECT_TRUE(testing::bitwise_equal(d.components[c].contents.tensors[t].second,
                                         expected[c].contents.tensors[t].second));
    }
  }
  EXPECT_TRUE(verify(path).ok());
  EXPECT_NE(testing::read_bytes(path + "/manifest.json").find("\"format_version\": \"2.0\""),
            std::string::npos);
}

// The writer appends the header's text itself (names copied, the metadata string escaped by
// hand): it must be, byte for byte, what nlohmann writes for the same values, for every name a
// user may give (quotes, backslashes, control characters, DEL, UTF-8) and any state strings.
TEST(Golden, HeaderTextIsExactlyWhatNlohmannWrites) {
  TempDir dir;
  const std::vector<std::string> names = {
      "fc.weight", "quote\"d",        "back\\slash",     "tab\there", "line\nfeed", "ctrl\x01",
      "del\x7f",   "\xc3\xa9t\xc3\xa9", "{\"json\":[1]}", "\xe2\x82\xac/\xf0\x9f\x98\x80"};
  Container c;
  for (std::size_t i = 0; i < names.size(); ++i) {
    c.tensors.emplace_back(names[i], make_tensor(at::kFloat, {2, static_cast<std::int64_t>(i + 1)},
                                                 static_cast<int>(i)));
  }
  c.state = {{"quoted", "a \"b\" \\ c"},
             {"newline", "x\ny\tz\x01"},
             {"utf8", "\xc3\xbc\xe2\x82\xac"},
             {"n", -3},
             {"f", 0.1}};
  save_file(dir / "odd.safetensors", c);

  const std::string bytes = testing::read_bytes(dir / "odd.safetensors");
  ASSERT_GE(bytes.size(), 8u);
  std::uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = length << 8 | static_cast<unsigned char>(bytes[i]);
  ASSERT_LE(8 + length, bytes.size());
  std::string header = bytes.substr(8, length);
  header.erase(header.find_last_not_of(' ') + 1);  // the padding
  const nlohmann::ordered_json parsed = nlohmann::ordered_json::parse(header);
  EXPECT_EQ(header, parsed.dump());
  const std::string meta = parsed.at("__metadata__").at("torchpoint").get<std::string>();
  EXPECT_EQ(meta, nlohmann::ordered_json::parse(meta).dump());

  Container back = load_file(dir / "odd.safetensors");
  ASSERT_EQ(back.tensors.size(), names.size());
  for (std::size_t i = 0; i < names.size(); ++i) {
    EXPECT_EQ(back.tensors[i].first, names[i]);
    EXPECT_TRUE(testing::bitwise_equal(back.tensors[i].second, c.tensors[i].second));
  }
  EXPECT_EQ(back.state, c.state);
}

// From 1,024 tensors the header is built on a second thread while the first chunks of data
// fill, and those wait for it to learn where the data starts. The file must be what one thread
// writes: names and values in the caller's order, the header nlohmann's text, and a name that
// cannot be written stops the save before any file is left.
TEST(Golden, ManyTensorsWrittenWhileTheirHeaderIsBuiltReadBackExactly) {
  TempDir dir;
  Container c;
  // 1,500 tensors, 8-byte and 4-byte and 1-byte elements interleaved (so they are reordered for
  // the data), 36 MiB in all: several 8 MiB chunks fill before the header can be ready.
  for (int i = 0; i < 1500; ++i) {
    const at::ScalarType type = i % 3 == 0 ? at::kDouble : i % 3 == 1 ? at::kFloat : at::kByte;
    const std::int64_t elements = i % 50 == 0 ? 300000 : 1000 + i;
    c.tensors.emplace_back(fmt::format("layer.{}.w{}", i, i % 7 == 0 ? "\"q\"" : ""),
                           make_tensor(type, {elements}, i));
  }
  c.state = {{"step", 9}};
  save_file(dir / "many.safetensors", c);

  const std::string bytes = testing::read_bytes(dir / "many.safetensors");
  std::uint64_t length = 0;
  for (int i = 7; i >= 0; --i) length = length << 8 | static_cast<unsigned char>(bytes[i]);
  ASSERT_LE(8 + length, bytes.size());
  std::string header = bytes.substr(8, length);
  header.erase(header.find_last_not_of(' ') + 1);
  EXPECT_EQ(header, nlohmann::ordered_json::parse(header).dump());

  Container back = load_file(dir / "many.safetensors");
  ASSERT_EQ(back.tensors.size(), c.tensors.size());
  for (std::size_t i = 0; i < c.tensors.size(); ++i) {
    ASSERT_EQ(back.tensors[i].first, c.tensors[i].first);
    ASSERT_TRUE(testing::bitwise_equal(back.tensors[i].second, c.tensors[i].second)) << i;
  }
  EXPECT_EQ(back.state, c.state);
  EXPECT_TRUE(verify(dir / "many.safetensors").ok());

  c.tensors[1400].first = "bad\xff\xfe";
  expect_error([&] { save_file(dir / "bad.safetensors", c); }, ErrorCode::InvalidArgument,
               {"not valid UTF-8"});
  EXPECT_EQ(testing::list_sorted(dir.path()), std::vector<std::string>{"many.safetensors"});
}

TEST(Golden, TodaysWriterStillProducesTheVersion1Bytes) {
  // While the format version is 1.0 and the library 0.1.0, a save is byte-identical to the golden.
  if (std::string(TORCHPOINT_TEST_VERSION) != "0.1.0") GTEST_SKIP() << "library version changed";
  TempDir dir;
  save_file(dir / "w.safetensors", {{{"w", at::tensor({1.0f, 2.0f})}}, {{"step", 7}}});
  EXPECT_EQ(testing::read_bytes(dir / "w.safetensors"),
            testing::read_bytes(golden("w.safetensors")));
}

}  // namespace
}  // namespace torchpoint

namespace torchpoint {
namespace {

TEST(Reader, ReadsOneTensorWithoutTheOthers) {
  testing::TempDir dir;
  std::string path = dir / "r.safetensors";
  at::Tensor a = testing::make_tensor(at::kFloat, {100}, 1);
  at::Tensor b = testing::make_tensor(at::kDouble, {50}, 2);
  save_file(path, {{{"a", a}, {"b", b}}, {{"k", 1}}});
  std::uint64_t start = data_start_of(path);
  // Damage b (the first in data order: float64 sorts before float32): a still reads.
  testing::flip_bit(path, start + 3, 1);
  TensorFileReader reader(path);
  EXPECT_EQ(reader.names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(reader.state(), Json({{"k", 1}}));
  EXPECT_TRUE(testing::bitwise_equal(reader.read("a"), a));
  try {
    reader.read("b");
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.code(), ErrorCode::Corruption);
    EXPECT_NE(std::string(e.what()).find("'b'"), std::string::npos);
  }
  EXPECT_THROW(reader.read("c"), Error);
}

}  // namespace
}  // namespace torchpoint

namespace torchpoint {
namespace {

// Every kind of file torchpoint writes, opened by the real safetensors library (the venv's):
// every dtype that both it and this LibTorch know, 0-d, empty and non-contiguous tensors, a
// file large enough for the O_DIRECT path, JSON state, and a directory checkpoint.
TEST(PythonJudges, SafetensorsReadsEveryFileBitIdentically) {
  TempDir dir;
  NamedTensors every;
  std::uint64_t seed = 1;
  for (const char* name : {"BOOL", "U8", "I8", "I16", "I32", "I64", "F16", "BF16", "F32", "F64",
                           "U16", "U32", "U64", "F8_E4M3", "F8_E5M2"}) {
    bool unsupported = false;
    auto info = dtype_from_name(name, &unsupported);
    if (!info) continue;  // a dtype this LibTorch lacks (1.13: U16..F8_E5M2)
    // Random bytes: every bit pattern, float8 NaNs included.
    every.emplace_back(fmt::format("t.{}", name), make_tensor(info->type, {3, 5}, seed));
    ++seed;
  }
  if (compat::scalar_type_for("U16")) {
    EXPECT_EQ(every.size(), 15u);
  }
  every.emplace_back("scalar", at::scalar_tensor(2.5, at::kDouble));
  every.emplace_back("empty", at::zeros({0, 4}, at::kFloat));
  every.emplace_back("transposed", testing::make_tensor(at::kFloat, {4, 6}, 99).t());
  save_file(dir / "every.safetensors", {every, {{"epoch", 3}, {"name", "judged"}}});
  save_file(dir / "big.safetensors", {{{"w", testing::make_tensor(at::kFloat, {3 << 18}, 7)},
                                       {"b", testing::make_tensor(at::kBFloat16, {1000}, 8)}}});
  save_file(dir / "state_only.safetensors", {{}, {{"step", 12}}});
  save_directory(dir / "checkpoint_0",
                 {{"model", {{{"fc.weight", testing::make_tensor(at::kFloat, {8, 4}, 3)}}, {}}},
                  {"optimizer",
                   {{{"state.0.0.exp_avg", testing::make_tensor(at::kFloat, {8, 4}, 4)}},
                    {{"type", "Adam"}}}}},
                 {.step = 5});
  testing::expect_safetensors_reads(
      {dir / "every.safetensors", dir / "big.safetensors", dir / "state_only.safetensors",
       dir / "checkpoint_0/model.safetensors", dir / "checkpoint_0/optimizer.safetensors"},
      dir.path());
}

// The newer dtypes in a file written by LibTorch 2.13 (committed under
// tests/data/golden_libtorch2; TORCHPOINT_WRITE_GOLDEN=1 rewrites it there): a LibTorch that
// has them loads it bit for bit and round-trips it; one that lacks them (1.13) refuses it with
// Unsupported, naming the tensor and its dtype.
TEST(NewerDtypes, FileFromLibTorch2LoadsBitExactOrIsRefusedByName) {
  const char* src = std::getenv("TORCHPOINT_SOURCE_DIR");
  ASSERT_NE(src, nullptr) << "TORCHPOINT_SOURCE_DIR is set by CTest";
  const std::string golden =
      std::string(src) + "/tests/data/golden_libtorch2/newer_dtypes.safetensors";
  const char* names[] = {"U16", "U32", "U64", "F8_E4M3", "F8_E5M2"};
  if (!compat::scalar_type_for("U16")) {
    Error e = expect_error([&] { load_file(golden); }, ErrorCode::Unsupported,
                           {"has dtype", "LibTorch 1.13"});
    bool named = false;
    for (const char* name : names) {
      named |= std::string(e.what()).find(fmt::format("'x.{}' has dtype {}", name, name)) !=
               std::string::npos;
    }
    EXPECT_TRUE(named) << e.what();
    return;
  }
  NamedTensors expected;
  std::uint64_t seed = 20;
  for (const char* name : names) {
    expected.emplace_back(fmt::format("x.{}", name),
                          make_tensor(*compat::scalar_type_for(name), {2, 7}, seed++));
  }
  if (std::getenv("TORCHPOINT_WRITE_GOLDEN") != nullptr) save_file(golden, {expected, {}});
  Container back = load_file(golden);
  ASSERT_EQ(back.tensors.size(), expected.size());
  TempDir dir;
  save_file(dir / "again.safetensors", back);
  Container again = load_file(dir / "again.safetensors");
  for (std::size_t i = 0; i < expected.size(); ++i) {
    EXPECT_EQ(back.tensors[i].first, expected[i].first);
    EXPECT_TRUE(testing::bitwise_equal(back.tensors[i].second, expected[i].second))
        << expected[i].first;
    EXPECT_TRUE(testing::bitwise_equal(again.tensors[i].second, expected[i].second))
        << expected[i].first;
  }
}

}  // namespace
}  // namespace torchpoint

namespace torchpoint {
namespace {

// A FIFO where a checkpoint file or manifest belongs is refused at once, by every reader
// (before, each of these blocked forever in open()).
TEST(SpecialFiles, AFifoInPlaceOfACheckpointFileIsRefusedAtOnce) {
  TempDir dir;
  const std::string fifo = dir / "state.ckpt";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0644), 0);
  expect_error([&] { load_file(fifo); }, ErrorCode::InvalidArgument,
               {fifo, "is a FIFO", "regular files"});
  VerifyReport report = verify(fifo);
  ASSERT_EQ(report.problems.size(), 1u);
  EXPECT_NE(report.problems[0].find("is a FIFO"), std::string::npos) << report.problems[0];
  EXPECT_FALSE(report.proven_corrupt()) << "a FIFO proves nothing about a checkpoint";
  expect_error([&] { TensorFileReader reader(fifo); }, ErrorCode::InvalidArgument, {"FIFO"});

  const std::string checkpoint = dir / "checkpoint_0";
  save_directory(checkpoint, {{"model", {{{"w", at::ones({2})}}, {}}}});
  for (const char* name : {"manifest.json", "model.safetensors"}) {
    SCOPED_TRACE(name);
    const std::string path = checkpoint + "/" + name;
    const std::string kept = testing::read_bytes(path);
    ASSERT_EQ(::unlink(path.c_str()), 0);
    ASSERT_EQ(::mkfifo(path.c_str(), 0644), 0);
    expect_error([&] { load_directory(checkpoint); }, ErrorCode::InvalidArgument,
                 {path, "is a FIFO"});
    EXPECT_FALSE(verify(checkpoint).ok());
    ASSERT_EQ(::unlink(path.c_str()), 0);
    testing::write_bytes(path, kept);
  }
  EXPECT_TRUE(verify(checkpoint).ok()) << "control: the restored files verify";
}

// A .lock that is a symbolic link is refused: locking must not create or touch its target,
// which may lie outside the project.
TEST(SpecialFiles, ALockThatIsASymlinkIsRefusedAndItsTargetNotCreated) {
  TempDir dir;
  TempDir elsewhere;
  const std::string target = elsewhere / "victim";
  ASSERT_EQ(::symlink(target.c_str(), (dir / ".lock").c_str()), 0);
  expect_error(
      [&] {
        save_directory(dir / "checkpoint_0", {{"model", {{{"w", at::ones({2})}}, {}}}});
      },
      ErrorCode::InvalidArgument, {".lock", "symbolic link"});
  EXPECT_FALSE(Env::posix().stat(target).exists) << "the link's target was created";
  EXPECT_FALSE(Env::posix().stat(dir / "checkpoint_0").exists);
  // Control: with the link gone, the same save works.
  ASSERT_EQ(::unlink((dir / ".lock").c_str()), 0);
  save_directory(dir / "checkpoint_0", {{"model", {{{"w", at::ones({2})}}, {}}}});
  EXPECT_TRUE(verify(dir / "checkpoint_0").ok());
}

}  // namespace
}  // namespace torchpoint

namespace torchpoint {
namespace {

// A link inside a checkpoint is refused, not followed (before, a component linked to a valid
// file elsewhere verified as valid, and one linked to a private file was read).
TEST(SpecialFiles, LinksInsideACheckpointAreRefused) {
  TempDir dir;
  const std::string checkpoint = dir / "checkpoint_0";
  save_directory(checkpoint, {{"model", {{{"w", at::ones({2})}}, {}}}});
  for (const char* name : {"model.safetensors", "manifest.json"}) {
    SCOPED_TRACE(name);
    const std::string path = checkpoint + "/" + name;
    const std::string moved = dir / (std::string("real-") + name);
    ASSERT_EQ(::rename(path.c_str(), moved.c_str()), 0);
    ASSERT_EQ(::symlink(moved.c_str(), path.c_str()), 0);  // to the very same, valid bytes
    expect_error([&] { load_directory(checkpoint); }, ErrorCode::InvalidArgument,
                 {path, "symbolic link", "not followed"});
    VerifyReport report = verify(checkpoint);
    EXPECT_FALSE(report.ok());
    EXPECT_FALSE(report.proven_corrupt());
    ASSERT_EQ(::unlink(path.c_str()), 0);
    ASSERT_EQ(::rename(moved.c_str(), path.c_str()), 0);
  }
  EXPECT_TRUE(verify(checkpoint).ok()) << "control: the files moved back verify";
}

// What a reader says about a file that is not a checkpoint never quotes its bytes.
TEST(BadInput, MessagesNeverQuoteTheFilesBytes) {
  TempDir dir;
  const std::string secret = "token=hunter2-SECRET";
  const std::string text = dir / "private.txt";
  testing::write_bytes(text, "root:x:0:0:" + secret + "\n");
  // Header bytes: a length of 30 then JSON garbage holding the secret.
  const std::string json = dir / "garbage.safetensors";
  std::string bytes(8, '\0');
  bytes[0] = 30;
  bytes += "{\"a\": " + secret + "}     ";
  testing::write_bytes(json, bytes);
  for (const std::string& path : {text, json}) {
    SCOPED_TRACE(path);
    Error e = expect_error([&] { load_file(path); }, ErrorCode::Corruption);
    EXPECT_EQ(std::string(e.what()).find("hunter2"), std::string::npos) << e.what();
    for (const std::string& problem : verify(path).problems) {
      EXPECT_EQ(problem.find("hunter2"), std::string::npos) << problem;
    }
  }
  // A safetensors file of another writer has its JSON parsed without a checksum first: the
  // parser's error must not be quoted (it used to print the bytes it last read).
  Error e = expect_error([&] { load_safetensors(json); }, ErrorCode::Corruption,
                         {"not valid JSON", "syntax error at byte"});
  EXPECT_EQ(std::string(e.what()).find("hunter2"), std::string::npos) << e.what();
}

}  // namespace
}  // namespace torchpoint
