// Fine-tuning with the Accelerator: a frozen backbone is written once and shared by hard links
// between the automatic checkpoints, retention deletes old ones without breaking the rest, and
// a run resumed from any of them continues exactly as the uninterrupted one.
#include <sys/stat.h>
#include <torch/torch.h>

#include <filesystem>
#include <string>
#include <vector>

#include "testing/test_util.h"
#include "torchpoint/accelerator.h"
#include "torchpoint/checkpoint_dir.h"

namespace torchpoint {
namespace {

using testing::TempDir;

// Linear 256 -> 1024 (1 MiB weight) and 1024 -> 1024 (4 MiB), frozen; a trainable 1024 -> 4.
torch::nn::Sequential make_model() {
  torch::manual_seed(5);
  torch::nn::Sequential model(torch::nn::Linear(256, 1024), torch::nn::ReLU(),
                              torch::nn::Linear(1024, 1024), torch::nn::Linear(1024, 4));
  for (std::size_t i : {0, 2}) {
    for (at::Tensor& p : model[i]->parameters()) p.requires_grad_(false);
  }
  return model;
}

std::vector<at::Tensor> trainable(torch::nn::Sequential& model) {
  std::vector<at::Tensor> out;
  for (at::Tensor& p : model->parameters()) {
    if (p.requires_grad()) out.push_back(p);
  }
  return out;
}

struct Job {
  explicit Job(const std::string& project, bool incremental = true)
      : acc(ProjectConfiguration()
                .project_dir(project)
                .automatic_checkpoint_naming(true)
                .total_limit(2)
                .shard_size(std::uint64_t{1} << 20)
                .incremental(incremental)),
        model(make_model()),
        optimizer(trainable(model), torch::optim::AdamOptions(1e-3)) {
    acc.prepare(model, optimizer);
  }
  void step(int i) {
    torch::manual_seed(1000 + i);
    at::Tensor x = torch::randn({8, 256});
    optimizer.zero_grad();
    at::Tensor loss = model->forward(x).pow(2).mean();
    acc.backward(loss);
    optimizer.step();
  }
  Accelerator acc;
  torch::nn::Sequential model;
  torch::optim::Adam optimizer;
};

ino_t inode(const std::string& path) {
  struct ::stat st;
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return st.st_ino;
}

std::vector<std::string> shards_of(const std::string& checkpoint) {
  std::vector<std::string> out;
  for (const std::string& name : testing::list_sorted(checkpoint)) {
    if (name.starts_with("model-")) out.push_back(name);
  }
  return out;
}

TEST(AcceleratorIncremental, AFrozenBackboneIsWrittenOnceAndSharedByTheCheckpoints) {
  TempDir dir;
  Job job(dir / "run");
  std::vector<std::string> saved;
  for (int i = 0; i < 6; ++i) {
    job.step(i);
    if (i % 2 == 1) saved.push_back(job.acc.save_state());
  }
  // total_limit(2) deleted checkpoint_0, whose frozen shards checkpoint_1 and _2 still hold.
  EXPECT_FALSE(std::filesystem::exists(saved[0]));
  std::vector<std::string> shards = shards_of(saved[2]);
  // Frozen 0.weight | 0.bias | 2.weight (alone: over the limit) | 2.bias; then the head.
  ASSERT_EQ(shards.size(), 5u);
  EXPECT_EQ(shards_of(saved[1]), shards);
  for (std::size_t k = 0; k < 4; ++k) {
    EXPECT_EQ(inode(saved[1] + "/" + shards[k]), inode(saved[2] + "/" + shards[k])) << shards[k];
  }
  EXPECT_NE(inode(saved[1] + "/" + shards[4]), inode(saved[2] + "/" + shards[4]));
  for (const std::string& path : {saved[1], saved[2]}) EXPECT_TRUE(verify(path).ok()) << path;

  // A frozen weight changed in place (no optimizer would, but user code may): written anew.
  {
    torch::NoGradGuard no_grad;
    job.model[0]->as<torch::nn::Linear>()->weight.mul_(0.5);
  }
  std::string changed = job.acc.save_state();
  std::vector<std::string> now = shards_of(changed);
  EXPECT_NE(inode(saved[2] + "/" + now[0]), inode(changed + "/" + now[0]));
  EXPECT_EQ(inode(saved[2] + "/" + now[2]), inode(changed + "/" + now[2]));
  at::Tensor expected = job.model[0]->as<torch::nn::Linear>()->weight.detach().clone();

  // Resumed in a new Accelerator: the halved weight, and the same next steps.
  Job resumed(dir / "run");
  resumed.acc.load_state();
  EXPECT_TRUE(
      testing::bitwise_equal(resumed.model[0]->as<torch::nn::Linear>()->weight, expected));
  for (int i = 6; i < 8; ++i) {
    job.step(i);
    resumed.step(i);
  }
  std::vector<at::Tensor> a = job.model->parameters(), b = resumed.model->parameters();
  ASSERT_EQ(a.size(), b.size());
  for (std::size_t i = 0; i < a.size(); ++i) EXPECT_TRUE(testing::bitwise_equal(a[i], b[i])) << i;
  // Its first save links from the checkpoint it loaded.
  std::string next = resumed.acc.save_state();
  EXPECT_EQ(inode(changed + "/" + now[0]), inode(next + "/" + now[0]));
}

TEST(AcceleratorIncremental, WithIncrementalOffEveryShardIsWritten) {
  TempDir dir;
  Job job(dir / "run", /*incremental=*/false);
  job.step(0);
  std::string first = job.acc.save_state();
  job.step(1);
  std::string second = job.acc.save_state();
  std::vector<std::string> shards = shards_of(second);
  ASSERT_EQ(shards.size(), 5u);
  for (const std::string& shard : shards) {
    EXPECT_NE(inode(first + "/" + shard), inode(second + "/" + shard)) << shard;
  }
}

}  // namespace
}  // namespace torchpoint
