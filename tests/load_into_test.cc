// load_file_into(): a container file read into tensors that already exist. Every failure of a
// check leaves them as they were; a success fills them bit for bit, in place.
#include <fcntl.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <thread>

#include "format/container.h"
#include "format/fresh_read.h"
#include "format/json_depth.h"
#include "testing/fault_env.h"
#include "testing/test_util.h"
#include "torchpoint/error.h"
#include "torchpoint/optimizer_state.h"
#include "torchpoint/tensor_file.h"

namespace torchpoint {
namespace {

using testing::bitwise_equal;
using testing::expect_error;
using testing::make_tensor;
using testing::TempDir;

// Small tensors of every dtype and shape (gathered through one buffer), a 12 MiB one (read
// straight into its memory, the file large enough for two threads) and 3,000 4-byte ones.
Container varied_container() {
  Container c;
  std::uint64_t seed = 1;
  for (c10::ScalarType dtype : {at::kBool, at::kByte, at::kShort, at::kInt, at::kLong, at::kHalf,
                                at::kBFloat16, at::kFloat, at::kDouble}) {
    for (std::vector<std::int64_t> shape :
         std::vector<std::vector<std::int64_t>>{{}, {0}, {0, 3}, {7}, {3, 5}, {2, 3, 4}}) {
      c.tensors.emplace_back(fmt::format("{}.{}", c10::toString(dtype), seed),
                             make_tensor(dtype, shape, seed));
      ++seed;
    }
  }
  c.tensors.emplace_back("big", make_tensor(at::kFloat, {3, 1024, 1024}, seed++));
  for (int i = 0; i < 3000; ++i) {
    c.tensors.emplace_back(fmt::format("small.{}", i), make_tensor(at::kInt, {1}, seed++));
  }
  c.tensors.emplace_back("last", make_tensor(at::kDouble, {40000}, seed++));  // 312 KiB
  c.state = {{"epoch", 4}, {"note", "in place"}};
  return c;
}

// Tensors shaped like `c`'s, filled with `value`.
NamedTensors targets_like(const Container& c, double value = 0) {
  NamedTensors out;
  for (const auto& [name, t] : c.tensors) out.emplace_back(name, at::full_like(t, value));
  return out;
}

NamedTensors clone_all(const NamedTensors& tensors) {
  NamedTensors out;
  for (const auto& [name, t] : tensors) out.emplace_back(name, t.clone());
  return out;
}

// The two ways of loading into existing tensors: "fresh" (the default where memory allows: one
// read into new memory, which the tensors adopt or are copied from) and "frugal" (two reads,
// nothing of the file's size allocated). Sets TORCHPOINT_LOAD_MEMORY while it lives.
class LoadMemory {
 public:
  explicit LoadMemory(bool frugal) {
    if (frugal) {
      ::setenv("TORCHPOINT_LOAD_MEMORY", "frugal", 1);
    } else {
      ::unsetenv("TORCHPOINT_LOAD_MEMORY");
    }
  }
  ~LoadMemory() { ::unsetenv("TORCHPOINT_LOAD_MEMORY"); }
};

void expect_unchanged(const NamedTensors& now, const NamedTensors& before) {
  ASSERT_EQ(now.size(), before.size());
  for (std::size_t i = 0; i < now.size(); ++i) {
    ASSERT_TRUE(bitwise_equal(now[i].second, before[i].second))
        << now[i].first << " changed although the load failed";
  }
}

TEST(LoadInto, FillsExistingTensorsInPlaceBitForBit) {
  TempDir dir;
  Container c = varied_container();
  save_file(dir / "c.safetensors", c);
  for (bool frugal : {false, true}) {
    SCOPED_TRACE(frugal ? "frugal" : "fresh");
    LoadMemory mode(frugal);
    NamedTensors into = targets_like(c, 1);
    std::vector<const void*> memory;
    std::vector<const c10::StorageImpl*> storages;
    std::vector<std::uint32_t> versions;
    for (const auto& [name, t] : into) {
      memory.push_back(t.data_ptr());
      storages.push_back(t.storage().unsafeGetStorageImpl());
      versions.push_back(t._version());
    }
    // In another order than the file's: matched by name.
    std::reverse(into.begin(), into.end());
    std::reverse(memory.begin(), memory.end());
    std::reverse(storages.begin(), storages.end());
    std::reverse(versions.begin(), versions.end());
    Json state = load_file_into(dir / "c.safetensors", into);
    EXPECT_EQ(state, c.state);
    for (std::size_t i = 0; i < into.size(); ++i) {
      const auto& [name, t] = into[i];
      const at::Tensor& saved = c.tensors[c.tensors.size() - 1 - i].second;
      ASSERT_EQ(name, c.tensors[c.tensors.size() - 1 - i].first);
      EXPECT_TRUE(bitwise_equal(t, saved)) << name;
      EXPECT_EQ(t.storage().unsafeGetStorageImpl(), storages[i]) << name << " was replaced";
      if (frugal || t.nbytes() < kAdoptFrom) {
        EXPECT_EQ(t.data_ptr(), memory[i]) << name << ": its memory was replaced";
      } else {
        // The storage took the verified memory instead of a copy of it.
        EXPECT_NE(t.data_ptr(), memory[i]) << name << " was copied, not adopted";
      }
      if (t.numel() > 0 || frugal) {
        EXPECT_GT(t._version(), versions[i]) << name << ": its version counter was not bumped";
      }
    }
  }
}

// A tensor whose memory is not its storage's own to give up (a caller's buffer, a slice of a
// larger storage, a view) is copied into in place; one that owns its storage adopts the
// verified memory, and every view made of it before the load sees the new values.
TEST(LoadInto, AdoptsTheVerifiedMemoryOnlyWhereTheStorageIsTheTensorsOwn) {
  TempDir dir;
  const std::string path = dir / "m.safetensors";
  at::Tensor w = make_tensor(at::kFloat, {256, 1024}, 1);  // 1 MiB
  at::Tensor b = make_tensor(at::kFloat, {32 * 1024}, 2);
  at::Tensor s = make_tensor(at::kFloat, {32 * 1024}, 3);
  save_file(path, {{{"w", w}, {"b", b}, {"s", s}}});
  at::Tensor own = at::zeros({256, 1024});
  at::Tensor row = own[3];  // a view, made before the load
  std::vector<float> buffer(32 * 1024, -1.0f);
  at::Tensor blob = at::from_blob(buffer.data(), {32 * 1024});
  at::Tensor big = at::full({3 * 32 * 1024}, 9.0f);
  at::Tensor slice = big.narrow(0, 32 * 1024, 32 * 1024);
  const void* own_before = own.data_ptr();
  NamedTensors into = {{"w", own}, {"b", blob}, {"s", slice}};
  load_file_into(path, into);
  EXPECT_TRUE(bitwise_equal(own, w));
  EXPECT_NE(own.data_ptr(), own_before) << "copied, not adopted";
  EXPECT_TRUE(bitwise_equal(row, w[3])) << "a view made before the load sees old values";
  EXPECT_EQ(blob.data_ptr(), buffer.data());
  EXPECT_TRUE(bitwise_equal(blob, b));
  EXPECT_EQ(std::memcmp(buffer.data(), b.data_ptr(), b.nbytes()), 0);
  EXPECT_TRUE(bitwise_equal(slice, s));
  EXPECT_TRUE(big.narrow(0, 0, 32 * 1024).eq(9.0f).all().item<bool>()) << "the slice's neighbours";
  EXPECT_TRUE(big.narrow(0, 64 * 1024, 32 * 1024).eq(9.0f).all().item<bool>())
      << "the slice's neighbours";
  // Memory adopted once is adopted again by the next load, and lives on after it.
  const void* adopted = own.data_ptr();
  save_file(path, {{{"w", w.neg()}, {"b", b}, {"s", s}}});
  load_file_into(path, into);
  EXPECT_NE(own.data_ptr(), adopted);
  EXPECT_TRUE(bitwise_equal(own, w.neg()));
  EXPECT_TRUE(bitwise_equal(row, w[3].neg()));
  at::Tensor kept = own.clone();
  into.clear();
  row = at::Tensor();
  EXPECT_TRUE(bitwise_equal(own, kept));
}

// Whether some mapping of this process holds `address` (/proc/self/maps).
bool mapped(const void* address) {
  std::ifstream maps("/proc/self/maps");
  const auto a = reinterpret_cast<std::uintptr_t>(address);
  std::uintptr_t begin = 0, end = 0;
  char dash = 0;
  std::string rest;
  while (maps >> std::hex >> begin >> dash >> end && std::getline(maps, rest)) {
    if (a >= begin && a < end) return true;
  }
  return false;
}

// A load that replaces much memory (here 24 MiB, the first load's own mapping) gives it back
// on a thread of its own after returning: the mapping goes soon after, the values stay.
TEST(LoadInto, TheMemoryALargeLoadReplacedIsGivenBack) {
  TempDir dir;
  const std::string path = dir / "m.safetensors";
  at::Tensor w = make_tensor(at::kFloat, {6, 1024, 1024}, 1);  // 24 MiB
  save_file(path, {{{"w", w}}});
  at::Tensor own = at::zeros_like(w);
  NamedTensors into = {{"w", own}};
  load_file_into(path, into);
  const void* first = own.data_ptr();  // inside the first load's mapping, which it holds alone
  ASSERT_TRUE(mapped(first));
  save_file(path, {{{"w", w.neg()}}});
  load_file_into(path, into);
  ASSERT_NE(own.data_ptr(), first);
  EXPECT_TRUE(bitwise_equal(own, w.neg()));
  bool gone = false;
  for (int i = 0; i < 1000 && !gone; ++i) {  // up to 10 s
    gone = !mapped(first);
    if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(gone) << "the first load's memory was never given back";
  EXPECT_TRUE(bitwise_equal(own, w.neg()));
}

// load_file() reads the file once; its large tensors keep pieces of that one allocation, yet
// each lives on its own: freed, grown or written alone, and untouched by the file afterwards.
TEST(LoadFile, LargeTensorsShareOneReadYetEachLivesAlone) {
  TempDir dir;
  const std::string path = dir / "m.safetensors";
  at::Tensor a = make_tensor(at::kFloat, {64, 1024}, 1);  // 256 KiB
  at::Tensor b = make_tensor(at::kDouble, {32, 1024}, 2);
  at::Tensor small = make_tensor(at::kInt, {5}, 3);
  save_file(path, {{{"a", a}, {"b", b}, {"small", small}}});
  Container loaded = load_file(path);
  testing::write_bytes(path, "overwritten");
  ASSERT_EQ(loaded.tensors.size(), 3u);
  at::Tensor la = loaded.tensors[0].second, lb = loaded.tensors[1].second;
  EXPECT_TRUE(bitwise_equal(la, a));
  EXPECT_TRUE(bitwise_equal(lb, b));
  EXPECT_TRUE(bitwise_equal(loaded.tensors[2].second, small));
  loaded.tensors.clear();
  lb.add_(1);
  EXPECT_TRUE(bitwise_equal(la, a)) << "a write to one tensor reached another";
  lb.resize_({64, 1024});  // grows into new memory
  EXPECT_TRUE(bitwise_equal(lb.narrow(0, 0, 32), b + 1));
  la = at::Tensor();
  EXPECT_TRUE(bitwise_equal(lb.narrow(0, 0, 32), b + 1));
}

// A file that is not in the page cache is read past it (O_DIRECT) and verified all the same.
TEST(LoadInto, AColdFileIsReadPastThePageCacheAndVerified) {
  TempDir dir;
  Container c = varied_container();
  const std::string path = dir / "c.safetensors";
  save_file(path, c);
  auto drop_cache = [&] {
    int fd = ::open(path.c_str(), O_RDONLY);
    ASSERT_GE(fd, 0);
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  };
  auto cached = [&] {
    auto file = Env::posix().open(path, OpenMode::Read);
    return file->cached_fraction(0, file->size());
  };
  drop_cache();
  if (cached() > 0.1) GTEST_SKIP() << "this file system keeps the file cached";
  int probe = ::open(path.c_str(), O_RDONLY | O_DIRECT);
  if (probe < 0) GTEST_SKIP() << "this file system has no O_DIRECT";
  ::close(probe);
  NamedTensors into = targets_like(c, 4);
  load_file_into(path, into);
  for (std::size_t i = 0; i < into.size(); ++i) {
    ASSERT_TRUE(bitwise_equal(into[i].second, c.tensors[i].second)) << into[i].first;
  }
  EXPECT_LT(cached(), 0.5) << "the load went through the page cache";
  // A damaged byte in the middle of the big tensor, read cold: refused, nothing changed.
  const std::uint64_t size = testing::file_size(path);
  testing::flip_bit(path, size / 2, 1);
  drop_cache();
  NamedTensors fresh = targets_like(c, 6);
  NamedTensors before = clone_all(fresh);
  expect_error([&] { load_file_into(path, fresh); }, ErrorCode::Corruption,
               {path, "tensor 'big' fails its checksum", "nothing was loaded"});
  expect_unchanged(fresh, before);
}

TEST(LoadInto, FillsAModelsParametersSoItsOptimizerSeesThem) {
  TempDir dir;
  torch::manual_seed(3);
  torch::nn::Linear saved_model(64, 32), model(64, 32);
  NamedTensors saved, params;
  for (const auto& p : saved_model->named_parameters()) saved.emplace_back(p.key(), p.value());
  for (const auto& p : model->named_parameters()) params.emplace_back(p.key(), p.value());
  save_file(dir / "m.safetensors", {saved});
  torch::optim::SGD sgd(model->parameters(), 0.1);
  load_file_into(dir / "m.safetensors", params);
  EXPECT_TRUE(bitwise_equal(model->weight, saved_model->weight));
  EXPECT_TRUE(bitwise_equal(model->bias, saved_model->bias));
  EXPECT_TRUE(model->weight.requires_grad());
  // The optimizer holds the same tensors, so it steps from the loaded values.
  EXPECT_EQ(sgd.param_groups()[0].params()[0].data_ptr(), model->weight.data_ptr());
}

// An optimizer restored from a loaded state takes the moments load_file read into memory of
// their own (the parameter's dtype) instead of copying them; small ones, and a mapped file's,
// are copied. Either way it steps on exactly as an optimizer given copies of the same state.
TEST(LoadFile, AnOptimizerTakesTheLoadedStateItCanInsteadOfACopy) {
  TempDir dir;
  torch::manual_seed(5);
  torch::nn::Linear saved_model(256, 256);  // weight 256 KiB, adopted; bias 1 KiB, copied
  torch::optim::Adam saved_adam(saved_model->parameters(), 0.01);
  auto step = [](torch::nn::Linear& m, torch::optim::Optimizer& opt, int seed) {
    torch::manual_seed(seed);
    opt.zero_grad();
    m->forward(torch::randn({8, 256})).square().sum().backward();
    opt.step();
  };
  step(saved_model, saved_adam, 1);
  const std::string path = dir / "adam.safetensors";
  save_file(path, optimizer_state_dict(saved_adam).to_container());
  // The saved run as it was at the save, and its optimizer state as plain copies.
  auto restored = [&](const StateDict& state) {
    torch::nn::Linear m(256, 256);
    torch::NoGradGuard no_grad;
    m->weight.copy_(saved_model->weight);
    m->bias.copy_(saved_model->bias);
    auto opt = std::make_shared<torch::optim::Adam>(m->parameters(), 0.01);
    load_optimizer_state_dict(*opt, state);
    return std::pair(m, opt);
  };
  StateDict copies = optimizer_state_dict(saved_adam).clone();
  for (bool mapped : {false, true}) {
    SCOPED_TRACE(mapped ? "load_file_mapped" : "load_file");
    StateDict loaded =
        StateDict::from_container(mapped ? load_file_mapped(path) : load_file(path));
    auto [model, adam] = restored(loaded);
    auto [ref, ref_adam] = restored(copies);
    StateDict now = optimizer_state_dict(*adam), want = optimizer_state_dict(*ref_adam);
    for (const char* key : {"state.0.0.exp_avg", "state.0.0.exp_avg_sq", "state.0.1.exp_avg"}) {
      EXPECT_TRUE(bitwise_equal(now.tensor(key), want.tensor(key))) << key;
      EXPECT_NE(want.tensor(key).data_ptr(), copies.tensor(key).data_ptr()) << key;
    }
    const bool weight_taken =
        now.tensor("state.0.0.exp_avg").data_ptr() == loaded.tensor("state.0.0.exp_avg").data_ptr();
    EXPECT_EQ(weight_taken, !mapped);
    EXPECT_NE(now.tensor("state.0.1.exp_avg").data_ptr(),
              loaded.tensor("state.0.1.exp_avg").data_ptr());
    loaded = StateDict();  // the optimizer's state outlives the loaded dict
    step(model, *adam, 2);
    step(ref, *ref_adam, 2);
    EXPECT_TRUE(bitwise_equal(model->weight, ref->weight));
    EXPECT_TRUE(bitwise_equal(optimizer_state_dict(*adam).tensor("state.0.0.exp_avg_sq"),
                              optimizer_state_dict(*ref_adam).tensor("state.0.0.exp_avg_sq")));
  }
}

TEST(LoadInto, FillsNonContiguousTargetsThroughACopy) {
  TempDir dir;
  at::Tensor w = make_tensor(at::kFloat, {6, 8}, 1);
  save_file(dir / "w.safetensors", {{{"w", w}}});
  at::Tensor base = at::zeros({8, 6});
  NamedTensors into = {{"w", base.t()}};  // a transposed view: not contiguous
  load_file_into(dir / "w.safetensors", into);
  EXPECT_TRUE(into[0].second.equal(w));
  EXPECT_TRUE(base.t().equal(w)) << "the view's base was not written";
}

TEST(LoadInto, CorruptDataAnywhereChangesNothing) {
  TempDir dir;
  Container c = varied_container();
  const std::string path = dir / "c.safetensors";
  save_file(path, c);
  const std::string good = testing::read_bytes(path);
  const std::uint64_t size = good.size();
  // A byte of the first data, of the big tensor's middle, of the small ones, and the last.
  std::uint64_t data_start = 0;
  for (int i = 7; i >= 0; --i) data_start = (data_start << 8) | static_cast<std::uint8_t>(good[i]);
  data_start += 8;
  for (std::uint64_t offset : {data_start, data_start + (size - data_start) / 3,
                               size - 320 * 1024 - 100, size - 1}) {
    SCOPED_TRACE(offset);
    testing::write_bytes(path, good);
    testing::flip_bit(path, offset, 3);
    NamedTensors into = targets_like(c, 7);
    NamedTensors before = clone_all(into);
    expect_error([&] { load_file_into(path, into); }, ErrorCode::Corruption,
                 {path, "fails its checksum", "nothing was loaded"});
    expect_unchanged(into, before);
  }
}

TEST(LoadInto, ATruncatedOrDamagedFileChangesNothing) {
  TempDir dir;
  Container c = varied_container();
  const std::string path = dir / "c.safetensors";
  save_file(path, c);
  const std::string good = testing::read_bytes(path);
  NamedTensors into = targets_like(c, 2);
  NamedTensors before = clone_all(into);
  testing::truncate_to(path, good.size() - 5);
  expect_error([&] { load_file_into(path, into); }, ErrorCode::Corruption, {path, "truncated"});
  expect_unchanged(into, before);
  testing::write_bytes(path, good);
  testing::flip_bit(path, 20, 0);  // in the header
  expect_error([&] { load_file_into(path, into); }, ErrorCode::Corruption, {path, "header"});
  expect_unchanged(into, before);
  expect_error([&] { load_file_into(dir / "absent.safetensors", into); }, ErrorCode::NotFound);
  expect_unchanged(into, before);
}

TEST(LoadInto, EveryMismatchIsNamedAndNothingChanges) {
  TempDir dir;
  save_file(dir / "m.safetensors", {{{"a", at::ones({2, 3})},
                                     {"b", at::ones({4}, at::kInt)},
                                     {"c", at::ones({5})},
                                     {"d", at::ones({1})}}});
  NamedTensors into = {{"a", at::zeros({3, 2})},            // shape differs
                       {"b", at::zeros({4}, at::kLong)},    // dtype differs
                       {"c", at::zeros({5})},               // fits
                       {"e", at::zeros({1})}};              // not in the file; "d" not here
  NamedTensors before = clone_all(into);
  expect_error([&] { load_file_into(dir / "m.safetensors", into); }, ErrorCode::Incompatible,
               {"nothing was loaded", "size mismatch for 'a': file [2, 3], tensor [3, 2]",
                "dtype mismatch for 'b': file Int, tensor Long",
                "'d' is in the file but not among the tensors to fill", "'e' is not in the file"});
  expect_unchanged(into, before);
  NamedTensors twice = {{"c", at::zeros({5})}, {"c", at::zeros({5})}};
  expect_error([&] { load_file_into(dir / "m.safetensors", twice); }, ErrorCode::InvalidArgument,
               {"'c' is named twice"});
  // Every name of the file in its own order, then one of them again: each matches where it
  // stands, and the name given twice is still refused.
  NamedTensors in_order_then_again = {{"a", at::zeros({2, 3})},      {"b", at::zeros({4}, at::kInt)},
                                      {"c", at::zeros({5})},         {"d", at::zeros({1})},
                                      {"b", at::zeros({4}, at::kInt)}};
  NamedTensors before_again = clone_all(in_order_then_again);
  expect_error([&] { load_file_into(dir / "m.safetensors", in_order_then_again); },
               ErrorCode::InvalidArgument, {"'b' is named twice"});
  expect_unchanged(in_order_then_again, before_again);
}

// The bound on nesting every reader applies before parsing JSON: brackets count only outside
// strings, and an escaped quote does not end a string.
TEST(JsonDepth, CountsBracketsOutsideStringsOnly) {
  auto nested = [](int depth) { return std::string(depth, '[') + std::string(depth, ']'); };
  EXPECT_TRUE(json_depth_within(nested(kMaxJsonDepth)));
  EXPECT_FALSE(json_depth_within(nested(kMaxJsonDepth + 1)));
  EXPECT_TRUE(json_depth_within(R"({"a":[{"b":[]}]})", 4));
  EXPECT_FALSE(json_depth_within(R"({"a":[{"b":[]}]})", 3));
  // Brackets in strings, escaped quotes and backslashes in them.
  EXPECT_TRUE(json_depth_within(R"(["[[[[", "\"[[[", "\\", "{{"])", 1));
  EXPECT_FALSE(json_depth_within(R"(["\\"[[])", 2));  // the string ends after \\: [[ count
  EXPECT_TRUE(json_depth_within(R"(["\"[[]"])", 1));   // \" does not end it: [[ are inside
  // A string left open, a backslash at the very end, closers without openers.
  EXPECT_TRUE(json_depth_within(R"(["[[[)", 1));
  EXPECT_TRUE(json_depth_within(R"(["\)", 1));
  EXPECT_TRUE(json_depth_within("]]]}}[", 1));
  EXPECT_FALSE(json_depth_within("]][[", 1));
  EXPECT_TRUE(json_depth_within(""));
}

// Fails each read of a load in turn (both passes, both threads): a failure before the copy
// began changes nothing, and one during the copy says that the tensors may hold part of it.
TEST(LoadInto, EveryReadFailingInTurnChangesNothingOrSaysSo) {
  TempDir dir;
  Container c = varied_container();
  const std::string path = dir / "c.safetensors";
  save_file(path, c);
  testing::FaultEnv env;
  for (bool frugal : {false, true}) {
    SCOPED_TRACE(frugal ? "frugal" : "fresh");
    LoadMemory mode(frugal);
    int failed_before_copy = 0, failed_during_copy = 0;
    for (std::uint64_t n = 1;; ++n) {
      SCOPED_TRACE(n);
      ASSERT_LT(n, 500u) << "the load never succeeded";
      NamedTensors into = targets_like(c, 5);
      NamedTensors before = clone_all(into);
      env.clear_faults();
      env.fail_nth({testing::Op::Read, testing::Op::Open}, n, EIO);
      try {
        load_file_into(path, into, env);
      } catch (const Error& e) {
        EXPECT_EQ(e.code(), ErrorCode::IOError) << e.what();
        if (std::string(e.what()).find("may hold part of it") != std::string::npos) {
          ++failed_during_copy;
        } else {
          expect_unchanged(into, before);
          ++failed_before_copy;
        }
        continue;
      }
      for (std::size_t i = 0; i < into.size(); ++i) {
        ASSERT_TRUE(bitwise_equal(into[i].second, c.tensors[i].second)) << into[i].first;
      }
      break;
    }
    env.clear_faults();
    if (frugal) {
      EXPECT_GT(failed_before_copy, 10);  // the header, the second file and 12+ chunks
      EXPECT_GT(failed_during_copy, 1);   // at least one read of each half
    } else {
      EXPECT_GE(failed_before_copy, 3);  // the open, the header, the data
      EXPECT_EQ(failed_during_copy, 0);  // one read, all before anything changes
    }
  }
}

// The second read is checked against the first: a file changed in between (another process
// writing into it) is an error that says the tensors may hold part of it, never a silent load.
TEST(LoadInto, AFileChangedBetweenTheTwoReadsIsCaught) {
  TempDir dir;
  LoadMemory mode(/*frugal=*/true);
  Container c = varied_container();
  const std::string path = dir / "c.safetensors";
  save_file(path, c);
  const std::uint64_t size = testing::file_size(path);
  for (std::uint64_t offset : {size / 2, size - 1}) {  // in the big tensor; in the last one
    SCOPED_TRACE(offset);
    save_file(path, c);
    NamedTensors into = targets_like(c);
    FileFill fill(Env::posix(), path, into);
    ASSERT_TRUE(fill.fits());
    testing::flip_bit(path, offset, 5);
    expect_error([&] { fill.copy(); }, ErrorCode::Corruption,
                 {path, "differ from what was verified", "may hold part of it"});
  }
}

// With the one read, what was verified is what the tensors get: the file changing afterwards
// changes nothing.
TEST(LoadInto, AFileChangedAfterTheOneReadDoesNotReachTheTensors) {
  TempDir dir;
  LoadMemory mode(/*frugal=*/false);
  Container c = varied_container();
  const std::string path = dir / "c.safetensors";
  save_file(path, c);
  NamedTensors into = targets_like(c);
  FileFill fill(Env::posix(), path, into);
  ASSERT_TRUE(fill.fits());
  testing::flip_bit(path, testing::file_size(path) / 2, 5);
  fill.copy();
  for (std::size_t i = 0; i < into.size(); ++i) {
    ASSERT_TRUE(bitwise_equal(into[i].second, c.tensors[i].second)) << into[i].first;
  }
}

}  // namespace
}  // namespace torchpoint
