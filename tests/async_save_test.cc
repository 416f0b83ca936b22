// Asynchronous saves: the snapshot is what gets written whatever the loop does afterwards, the
// staging memory is reused, one save at a time, every error reaches someone exactly once, and
// the Accelerator's save_state_async() writes the same checkpoint as save_state().
#include "torchpoint/async_save.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <thread>

#include "format/staging_gate.h"
#include "testing/fault_env.h"
#include "testing/test_util.h"
#include "torchpoint/accelerator.h"

namespace torchpoint {
namespace {

using testing::expect_error;
using testing::FaultEnv;
using testing::Op;
using testing::TempDir;

// Holds the background writer at its first file-system call until release().
struct Gate {
  explicit Gate(FaultEnv& env) {
    env.set_before_op([this](Op, const std::string&) {
      std::unique_lock<std::mutex> lock(mutex);
      reached = true;
      cv.notify_all();
      cv.wait(lock, [&] { return open; });
    });
  }
  void wait_reached() {
    std::unique_lock<std::mutex> lock(mutex);
    cv.wait(lock, [&] { return reached; });
  }
  void release() {
    std::lock_guard<std::mutex> lock(mutex);
    open = true;
    cv.notify_all();
  }
  std::mutex mutex;
  std::condition_variable cv;
  bool reached = false, open = false;
};

TEST(AsyncSave, WritesTheSnapshotNotWhatTheLoopChangedAfterwards) {
  TempDir dir;
  FaultEnv env;
  Gate gate(env);
  AsyncCheckpointer saver(env);
  at::Tensor w = torch::arange(1000, torch::kFloat32).reshape({10, 100});
  at::Tensor strided = torch::arange(12, torch::kInt64).reshape({3, 4}).t();  // not contiguous
  const at::Tensor w_before = w.clone(), strided_before = strided.clone();
  SaveHandle handle = saver.save_file(
      dir / "a.ckpt", {{{"w", w}, {"s", strided}, {"empty", torch::empty({0, 3})}}, {{"step", 3}}});
  EXPECT_EQ(handle.path(), dir / "a.ckpt");
  gate.wait_reached();  // the writer is running, and waits
  EXPECT_FALSE(handle.done());
  EXPECT_TRUE(saver.in_flight());
  w.add_(1);  // the loop trains on
  strided.mul_(-1);
  gate.release();
  handle.wait();
  EXPECT_TRUE(handle.done());
  Container got = load_file(dir / "a.ckpt");
  ASSERT_EQ(got.tensors.size(), 3u);
  EXPECT_EQ(got.tensors[2].second.sizes(), (std::vector<std::int64_t>{0, 3}));
  EXPECT_TRUE(testing::bitwise_equal(got.tensors[0].second, w_before));
  EXPECT_TRUE(testing::bitwise_equal(got.tensors[1].second, strided_before));
  EXPECT_EQ(got.state["step"], 3);
  saver.wait();
  EXPECT_FALSE(saver.in_flight());
}

// The writer of an asynchronous save reads a tensor's staging bytes only once the snapshot has
// copied them, and gives up when the snapshot fails.
TEST(AsyncSave, TheWriterWaitsForTheSnapshotAndStopsWhenItFails) {
  std::vector<std::uint8_t> buffer(4096);
  detail::StagingGate gate(buffer.data(), buffer.size());
  gate.wait_for(&gate, 8);  // memory outside the buffer: at once
  std::atomic<bool> through{false};
  std::thread writer([&] {
    gate.wait_for(buffer.data() + 1000, 1000);
    through = true;
  });
  gate.publish(1500);
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(through) << "bytes up to 2000 are not all copied yet";
  gate.publish(2000);
  writer.join();
  EXPECT_TRUE(through);
  gate.wait_for(buffer.data(), 2000);  // already there

  std::thread failing([&] {
    expect_error([&] { gate.wait_for(buffer.data() + 3000, 10); }, ErrorCode::InvalidArgument,
                 {"snapshot", "failed"});
  });
  gate.abandon();
  failing.join();
}

// A sharded component is written by several threads at once (and compared with link_from by
// two more): every one of them waits at the snapshot's gate, not only the save's own thread.
// The state is large enough (256 MiB in 32 shards) that the other threads reach their shards
// long before the copy does: without the gate they wrote the staging buffer's zeros.
TEST(AsyncSave, EveryThreadOfAShardedSaveWaitsForTheSnapshot) {
  TempDir dir;
  AsyncCheckpointer saver;
  torch::manual_seed(3);
  NamedTensors tensors;
  for (int i = 0; i < 32; ++i) {
    tensors.emplace_back(fmt::format("layer{}.weight", i), torch::randn({2048, 1024}));
  }
  SaveDirectoryOptions options;
  options.shard_size = 8u << 20;
  auto check = [&](const std::string& path) {
    DirectoryCheckpoint got = load_directory(path);
    ASSERT_EQ(got.components.size(), 1u);
    const NamedTensors& saved = got.components[0].contents.tensors;
    ASSERT_EQ(saved.size(), tensors.size());
    for (std::size_t i = 0; i < saved.size(); ++i) {
      EXPECT_TRUE(testing::bitwise_equal(saved[i].second, tensors[i].second)) << saved[i].first;
    }
  };
  saver.save_directory(dir / "a", {{"model", {tensors, Json::object()}}}, {}, options).wait();
  check(dir / "a");
  // The same tensors again, incremental: the comparers hash the staged copies, and every shard
  // proves unchanged (a hash of bytes not yet copied would differ, and the shard be rewritten).
  options.link_from = dir / "a";
  saver.save_directory(dir / "b", {{"model", {tensors, Json::object()}}}, {}, options).wait();
  check(dir / "b");
  int linked = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir / "b")) {
    if (entry.path().extension() == ".safetensors" && entry.hard_link_count() == 2) ++linked;
  }
  EXPECT_EQ(linked, 32);
}

TEST(AsyncSave, StagingIsAllocatedOnceAndReused) {
  TempDir dir;
  AsyncCheckpointer saver;
  std::vector<at::Tensor> tensors;
  NamedTensors named;
  std::size_t bytes = 0;
  for (int i = 0; i < 5; ++i) {
    tensors.push_back(torch::randn({100 + i}));
    named.emplace_back("t" + std::to_string(i), tensors.back());
    bytes += tensors.back().nbytes();
  }
  saver.save_directory(dir / "c/checkpoint_0", {{"model", {named, {}}}}, {});
  const std::size_t staged = saver.staging_bytes();
  EXPECT_GE(staged, bytes);
  EXPECT_LE(staged, bytes + 2 * 4096) << "the state, its last block and the alignment";
  for (int i = 1; i < 4; ++i) {
    for (auto& t : tensors) t.add_(1);
    saver.save_directory(dir / ("c/checkpoint_" + std::to_string(i)), {{"model", {named, {}}}},
                         {.step = i});
    EXPECT_EQ(saver.staging_bytes(), staged) << "reused, not reallocated";
  }
  saver.wait();
  DirectoryCheckpoint last = load_directory(dir / "c/checkpoint_3");
  EXPECT_EQ(last.info.step, 3);
  for (std::size_t i = 0; i < tensors.size(); ++i) {
    EXPECT_TRUE(testing::bitwise_equal(last.components[0].contents.tensors[i].second, tensors[i]));
  }
}

TEST(AsyncSave, AnErrorIsThrownOnceByWhicheverAsksFirst) {
  TempDir dir;
  FaultEnv env;
  AsyncCheckpointer saver(env);
  const Container state{{{"w", torch::ones({64})}}, {}};
  saver.save_file(dir / "state.ckpt", state).wait();  // committed

  // Received by the handle: wait() of the checkpointer is then quiet.
  env.fail_nth({Op::Write}, 1, ENOSPC);
  SaveHandle failed = saver.save_file(dir / "state.ckpt", {{{"w", torch::zeros({64})}}, {}});
  expect_error([&] { failed.wait(); }, ErrorCode::IOError, {"state.ckpt", "disk is full"});
  failed.wait();  // once only
  saver.wait();
  EXPECT_TRUE(
      testing::bitwise_equal(load_file(dir / "state.ckpt").tensors[0].second, torch::ones({64})))
      << "the committed file is kept";

  // Not received by anyone: the next save throws it and does not start.
  env.fail_nth({Op::Write}, 1, EIO);
  saver.save_file(dir / "state.ckpt", {{{"w", torch::zeros({64})}}, {}});
  expect_error([&] { saver.save_file(dir / "other.ckpt", state); }, ErrorCode::IOError,
               {"state.ckpt"});
  EXPECT_FALSE(std::filesystem::exists(dir / "other.ckpt")) << "the save that threw never started";
  saver.save_file(dir / "other.ckpt", state).wait();
  EXPECT_TRUE(std::filesystem::exists(dir / "other.ckpt"));

  // Received by wait().
  env.fail_nth({Op::Sync}, 1, EIO);
  saver.save_file(dir / "third.ckpt", state);
  expect_error([&] { saver.wait(); }, ErrorCode::IOError, {"third.ckpt"});
  saver.wait();
  EXPECT_FALSE(std::filesystem::exists(dir / "third.ckpt"));
}

TEST(AsyncSave, TheDestructorWaitsAndReportsAnErrorNobodyReceived) {
  TempDir dir;
  FaultEnv env;
  ::testing::internal::CaptureStderr();
  {
    AsyncCheckpointer saver(env);
    env.fail_nth({Op::Write}, 1, ENOSPC);
    saver.save_file(dir / "lost.ckpt", {{{"w", torch::ones({8})}}, {}});
  }
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("background save of " + (dir / "lost.ckpt")), std::string::npos) << err;
  EXPECT_NE(err.find("nothing waited for it"), std::string::npos) << err;
  {
    AsyncCheckpointer saver;
    saver.save_file(dir / "kept.ckpt", {{{"w", torch::ones({8})}}, {}});
  }
  EXPECT_TRUE(std::filesystem::exists(dir / "kept.ckpt")) << "the destructor waited for the commit";
}

// A model trained under an Accelerator: an asynchronous save is the same checkpoint as a
// synchronous one of the same moment, whatever the loop does while it is written, and
// total_limit is applied after its commit.
TEST(AsyncSave, AcceleratorSaveStateAsyncEqualsSaveState) {
  TempDir dir;
  FaultEnv env;
  torch::manual_seed(0);
  torch::nn::Linear model(8, 4);
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-2));
  Accelerator acc(
      ProjectConfiguration().project_dir(dir / "p").automatic_checkpoint_naming(true).total_limit(
          2),
      env);
  acc.prepare(model, optimizer);
  auto x = torch::randn({16, 8}), y = torch::randn({16, 4});
  auto train = [&] {
    optimizer.zero_grad();
    acc.backward(torch::mse_loss(model->forward(x), y));
    optimizer.step();
  };
  std::vector<std::string> paths;
  for (int i = 0; i < 4; ++i) {
    train();
    acc.save_state(dir / ("sync_" + std::to_string(i)));
    std::atomic<bool> held{true};
    env.set_before_op([&](Op, const std::string&) {
      while (held) std::this_thread::yield();
    });
    SaveHandle h = acc.save_state_async();
    paths.push_back(h.path());
    train();  // changes every parameter while the save is held
    held = false;
    h.wait();
    env.set_before_op({});
    DirectoryCheckpoint sync = load_directory(dir / ("sync_" + std::to_string(i)));
    DirectoryCheckpoint async = load_directory(h.path());
    ASSERT_EQ(sync.components.size(), async.components.size());
    for (std::size_t c = 0; c < sync.components.size(); ++c) {
      const NamedTensors& a = sync.components[c].contents.tensors;
      const NamedTensors& b = async.components[c].contents.tensors;
      ASSERT_EQ(a.size(), b.size()) << sync.components[c].name;
      for (std::size_t t = 0; t < a.size(); ++t) {
        EXPECT_EQ(a[t].first, b[t].first);
        EXPECT_TRUE(testing::bitwise_equal(a[t].second, b[t].second))
            << sync.components[c].name << " " << a[t].first;
      }
    }
    EXPECT_EQ(sync.info.step, async.info.step);
  }
  EXPECT_EQ(paths.back(), dir / "p/checkpoints/checkpoint_3");
  EXPECT_EQ(testing::list_sorted(dir / "p/checkpoints"),
            (std::vector<std::string>{".lock", "checkpoint_2", "checkpoint_3"}));

  // An error of a background save reaches the next save_state(), and nothing is committed.
  env.fail_nth({Op::Rename}, 1, EIO);
  acc.save_state_async();
  expect_error([&] { acc.save_state(); }, ErrorCode::IOError, {"checkpoint_4"});
  EXPECT_EQ(testing::list_sorted(dir / "p/checkpoints"),
            (std::vector<std::string>{".lock", "checkpoint_2", "checkpoint_3"}));
  acc.load_state();
  EXPECT_EQ(acc.save_state(), dir / "p/checkpoints/checkpoint_4");
}

}  // namespace
}  // namespace torchpoint
