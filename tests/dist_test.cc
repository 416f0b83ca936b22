// Several processes, for real: dist_child (the seed's Accelerate loop) started by the venv's
// torchrun over loopback, killed with SIGKILL and restarted by torchrun, made to fail a write on
// one rank, made to hang, and resumed on another number of processes. Plus the sampler's
// sharding and the process context's environment parsing, which need no processes.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "testing/test_util.h"
#include "tests/child_log.h"
#include "torchpoint/checkpoint_dir.h"
#include "torchpoint/data_position.h"
#include "torchpoint/process_group.h"
#include "torchpoint/tensor_file.h"

namespace tp = torchpoint;
namespace tt = torchpoint::testing;

namespace {

// One process's log, split by kind; steps keep every line of every attempt.
struct RankLog {
  std::vector<std::pair<long, std::string>> steps;          // (step, parameter digest)
  std::vector<std::pair<long, std::vector<long>>> samples;  // (epoch, sample indices)
  std::map<std::string, std::vector<std::string>> other;
};

RankLog read_log(const std::string& path) {
  RankLog out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream words(line);
    std::string kind, rest;
    words >> kind;
    if (kind == "step") {
      long step;
      std::string digest;
      words >> step >> digest;
      out.steps.emplace_back(step, digest);
    } else if (kind == "samples") {
      long epoch;
      std::string list;
      words >> epoch >> list;
      std::vector<long> indices;
      std::stringstream items(list);
      for (std::string item; std::getline(items, item, ',');) indices.push_back(std::stol(item));
      out.samples.emplace_back(epoch, indices);
    } else {
      std::getline(words >> std::ws, rest);
      out.other[kind].push_back(rest);
    }
  }
  return out;
}

struct ChildRun {
  int status = -1;
  std::string output;
  std::vector<RankLog> logs;
};

// Runs dist_child on `processes` processes under torchrun (or directly, for 0), with the log
// prefix `log` in `dir`.
ChildRun run_child(const std::string& dir, const std::string& log, int processes,
                   const std::string& plan, int batch = 16, int max_restarts = 1,
                   const std::string& extra_env = "") {
  std::string out = dir + "/" + log + ".out";
  std::string command =
      processes == 0 ? fmt::format("{} {} {}/project {}/{} {} {}", extra_env, DIST_CHILD, dir, dir,
                                   log, plan, batch)
                     : fmt::format(
                           "{} {} -m torch.distributed.run --standalone --nproc-per-node {} "
                           "--max-restarts {} --monitor-interval 0.1 --no-python {} {}/project "
                           "{}/{} {} {}",
                           extra_env, tt::python(), processes, max_restarts, DIST_CHILD, dir, dir,
                           log, plan, batch);
  ChildRun run;
  run.status = std::system((command + " > " + out + " 2>&1").c_str());
  run.output = tt::read_bytes(out);
  for (int r = 0; r < std::max(processes, 1); ++r) {
    run.logs.push_back(read_log(fmt::format("{}/{}.{}", dir, log, r)));
  }
  return run;
}

std::map<long, std::string> last_digest_by_step(const RankLog& log) {
  std::map<long, std::string> out;
  for (const auto& [step, digest] : log.steps) out[step] = digest;
  return out;
}

std::vector<std::string> committed(const std::string& dir) {
  std::vector<std::string> out;
  std::string checkpoints = dir + "/project/checkpoints";
  for (const std::string& name : tt::list_sorted(checkpoints)) {
    // Not the lock, nor the temporary directory of a save that never committed.
    if (name != ".lock" && name.find(".tmp-") == std::string::npos) out.push_back(name);
  }
  return out;
}

// The processes of a W-process run on 16 samples each saw, step by step, the samples of the one
// process run on 16 * W: checks that and returns nothing.
void expect_same_global_batches(const ChildRun& many, const ChildRun& one) {
  const RankLog& single = one.logs[0];
  ASSERT_FALSE(single.samples.empty());
  for (std::size_t step = 0; step < single.samples.size(); ++step) {
    std::vector<long> together;
    for (const RankLog& rank : many.logs) {
      ASSERT_LT(step, rank.samples.size());
      EXPECT_EQ(rank.samples[step].first, single.samples[step].first);
      together.insert(together.end(), rank.samples[step].second.begin(),
                      rank.samples[step].second.end());
    }
    EXPECT_EQ(together, single.samples[step].second) << "step " << step + 1;
  }
}

void expect_close_models(const std::string& a_path, const std::string& b_path, double tolerance) {
  tp::StateDict a = tp::StateDict::from_container(tp::load_file(a_path));
  tp::StateDict b = tp::StateDict::from_container(tp::load_file(b_path));
  ASSERT_EQ(a.keys(), b.keys());
  for (const std::string& key : a.keys()) {
    double diff = (a.tensor(key) - b.tensor(key)).abs().max().item<double>();
    EXPECT_LE(diff, tolerance) << key;
  }
}

// A TCP port nothing listens on at `address` now (the kernel's choice).
int free_port(const std::string& address) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  ::inet_pton(AF_INET, address.c_str(), &a.sin_addr);
  a.sin_port = 0;
  socklen_t size = sizeof a;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &size) != 0) {
    ADD_FAILURE() << "no free port on " << address << ": " << std::strerror(errno);
  }
  ::close(fd);
  return ntohs(a.sin_port);
}

// Runs dist_child as two "nodes": two torchrun agents on 127.0.0.2 and 127.0.0.3 (the
// rendezvous, c10d's, on the first), `per_node` processes each, each agent allowed
// `max_restarts` restarts. Both agents' output goes to LOG.agent0.out and LOG.agent1.out; the
// status is the first non-zero one of the two.
// With `own_disks`, each node's project is a directory of its own, DIR/node<N>/project (no
// process is given the other node's).
ChildRun run_two_nodes(const std::string& dir, const std::string& log, const std::string& plan,
                       int per_node = 1, int max_restarts = 3, const std::string& extra_env = "",
                       bool own_disks = false) {
  const int port = free_port("127.0.0.2");
  std::filesystem::create_directories(dir);
  std::string script;
  for (int node = 0; node < 2; ++node) {
    const std::string address = node == 0 ? "127.0.0.2" : "127.0.0.3";
    script += fmt::format(
        "( GLOO_SOCKET_IFNAME=lo {} {} -m torch.distributed.run --nnodes 2 --nproc-per-node {} "
        "--rdzv-backend c10d --rdzv-endpoint 127.0.0.2:{} --rdzv-id tp{} --rdzv-conf "
        "is_host={} --local-addr {} --max-restarts {} --monitor-interval 0.1 --no-python {} "
        "{}/project {}/{} {} 16 > {}/{}.agent{}.out 2>&1; echo $? > {}/{}.agent{}.rc ) & ",
        extra_env, tt::python(), per_node, port, port, node == 0 ? "true" : "false", address,
        max_restarts, DIST_CHILD, own_disks ? fmt::format("{}/node{}", dir, node) : dir, dir,
        log, plan, dir, log, node, dir, log, node);
  }
  script += "wait";
  ChildRun run;
  const int status = std::system(script.c_str());
  run.status = status;
  for (int node = 0; node < 2; ++node) {
    run.output += tt::read_bytes(fmt::format("{}/{}.agent{}.out", dir, log, node));
    std::string rc = tt::read_bytes(fmt::format("{}/{}.agent{}.rc", dir, log, node));
    if (run.status == 0 && std::atoi(rc.c_str()) != 0) run.status = std::atoi(rc.c_str());
  }
  for (int r = 0; r < 2 * per_node; ++r) {
    run.logs.push_back(read_log(fmt::format("{}/{}.{}", dir, log, r)));
  }
  return run;
}

}  // namespace

TEST(ShardedSampler, ProcessesSplitEveryGlobalBatchAndTheLastOneEvenly) {
  // 10 samples, 3 processes of 2: global batches of 6, then 4 left: 2 each, the missing 2
  // taken from the start of the epoch's order.
  std::vector<tp::ResumableSampler> samplers;
  for (int r = 0; r < 3; ++r) {
    samplers.emplace_back(10, /*shuffle=*/true, /*seed=*/3);
    samplers.back().shard(r, 3);
    samplers.back().reset();
  }
  std::vector<std::size_t> order = samplers[0].order_of(0);
  std::vector<std::size_t> first, second;
  for (int r = 0; r < 3; ++r) {
    auto a = samplers[r].next(2);
    auto b = samplers[r].next(2);
    ASSERT_TRUE(a && b);
    EXPECT_EQ(a->size(), 2u);
    EXPECT_EQ(b->size(), 2u);
    first.insert(first.end(), a->begin(), a->end());
    second.insert(second.end(), b->begin(), b->end());
    EXPECT_FALSE(samplers[r].next(2));
  }
  EXPECT_EQ(first, std::vector<std::size_t>(order.begin(), order.begin() + 6));
  EXPECT_EQ(second,
            (std::vector<std::size_t>{order[6], order[7], order[8], order[9], order[0], order[1]}));
  // The position is global: one batch of 2 on each of 3 processes is 6 samples.
  samplers[1].consume(2);
  EXPECT_EQ(samplers[1].samples_consumed(), 6u);
  EXPECT_THROW(samplers[0].shard(3, 3), tp::Error);
}

TEST(ShardedSampler, APositionSavedByFourProcessesContinuesOnTwo) {
  tp::ResumableSampler four(16, true, 9), two(16, true, 9);
  four.shard(1, 4);
  four.reset();
  four.next(2);
  four.consume(2);  // one step of 4 processes of 2: 8 samples
  two.shard(0, 2);
  two.load_state_dict(four.state_dict());
  two.reset();
  auto batch = two.next(2);
  ASSERT_TRUE(batch);
  std::vector<std::size_t> order = two.order_of(0);
  EXPECT_EQ(*batch, (std::vector<std::size_t>{order[8], order[9]}));
}

TEST(ProcessGroupOptions, ReadsTorchrunsEnvironmentAndRefusesNonsense) {
  ::unsetenv("WORLD_SIZE");
  EXPECT_FALSE(tp::ProcessGroupOptions::from_environment());
  ::setenv("WORLD_SIZE", "4", 1);
  ::setenv("RANK", "2", 1);
  ::setenv("LOCAL_RANK", "0", 1);
  ::setenv("LOCAL_WORLD_SIZE", "2", 1);
  ::setenv("MASTER_ADDR", "10.0.0.7", 1);
  ::setenv("MASTER_PORT", "29611", 1);
  ::setenv("TORCHELASTIC_RESTART_COUNT", "3", 1);
  ::setenv("TORCHELASTIC_USE_AGENT_STORE", "True", 1);
  auto o = tp::ProcessGroupOptions::from_environment();
  ASSERT_TRUE(o);
  EXPECT_EQ(o->world_size(), 4);
  EXPECT_EQ(o->rank(), 2);
  EXPECT_EQ(o->local_world_size(), 2);
  EXPECT_EQ(o->master_addr(), "10.0.0.7");
  EXPECT_EQ(o->master_port(), 29611);
  EXPECT_EQ(o->restart_count(), 3);
  EXPECT_TRUE(o->use_agent_store());
  ::setenv("RANK", "4", 1);
  tt::expect_error([] { tp::ProcessGroupOptions::from_environment(); },
                   tp::ErrorCode::InvalidArgument, {"RANK=4", "[0, 3]"});
  ::setenv("RANK", "1", 1);
  ::setenv("MASTER_PORT", "http", 1);
  tt::expect_error([] { tp::ProcessGroupOptions::from_environment(); },
                   tp::ErrorCode::InvalidArgument, {"MASTER_PORT=http"});
  for (const char* v :
       {"WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_USE_AGENT_STORE"}) {
    ::unsetenv(v);
  }
}

// A rendezvous store nobody serves: the error names the address and what to check, and carries
// none of c10d's C++ backtrace ("frame #0: c10::Error::Error...").
TEST(ProcessGroupOptions, AStoreThatCannotBeReachedIsNamedWithoutABacktrace) {
  // A loopback port that was free a moment ago and that nothing listens on now.
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof address), 0);
  socklen_t length = sizeof address;
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length), 0);
  const int port = ntohs(address.sin_port);
  ::close(fd);
  tp::Error e = tt::expect_error(
      [&] {
        tp::ProcessGroup::create(tp::ProcessGroupOptions()
                                     .rank(1)
                                     .world_size(2)
                                     .master_port(port)
                                     .timeout(std::chrono::milliseconds(1500)));
      },
      tp::ErrorCode::IOError,
      {"rank 1: cannot reach the rendezvous store at 127.0.0.1:" + std::to_string(port),
       "MASTER_ADDR and MASTER_PORT"});
  const std::string message = e.what();
  EXPECT_EQ(message.find("frame #"), std::string::npos) << message;
  EXPECT_EQ(message.find("c10::Error::Error"), std::string::npos) << message;
  EXPECT_LT(std::count(message.begin(), message.end(), '\n'), 3) << message;
}

// Parameters equal on every rank after every step; equal to the one-process run on the same
// global batches within 1e-6 (float32, summed in another order: measured at most a few 1e-8).
TEST(DistributedAccelerator, TwoAndFourProcessesStayIdenticalAndMatchOneProcess) {
  tt::TempDir dir;
  for (int world : {2, 4}) {
    std::string sub = dir.path() + "/w" + std::to_string(world);
    std::string one_sub = sub + "-one";
    std::filesystem::create_directories(sub);
    std::filesystem::create_directories(one_sub);
    ChildRun many = run_child(sub, "log", world, "none");
    ASSERT_EQ(many.status, 0) << many.output;
    ChildRun one = run_child(one_sub, "log", 0, "none", 16 * world);
    ASSERT_EQ(one.status, 0) << one.output;
    ASSERT_EQ(many.logs[0].steps.size(), 192u / (16 * world) * 3);
    for (int r = 1; r < world; ++r) {
      EXPECT_EQ(many.logs[r].steps, many.logs[0].steps) << "rank " << r;
    }
    expect_same_global_batches(many, one);
    expect_close_models(sub + "/log.model.safetensors", one_sub + "/log.model.safetensors", 1e-6);
    // One checkpoint directory, with every rank's RNG file, that the library verifies.
    // Saves every 4 steps, total_limit 3.
    std::vector<std::string> names = committed(sub);
    ASSERT_EQ(names.size(), std::min<std::size_t>(3, many.logs[0].steps.size() / 4));
    for (const std::string& name : names) {
      std::string path = sub + "/project/checkpoints/" + name;
      EXPECT_TRUE(tp::verify(path).ok()) << path;
      for (int r = 0; r < world; ++r) {
        EXPECT_TRUE(
            std::filesystem::exists(fmt::format("{}/random_states_{}.safetensors", path, r)));
        // Every process's save hook ran and its file was committed (and verified) with the rest.
        EXPECT_TRUE(std::filesystem::exists(fmt::format("{}/hook_rank{}.txt", path, r)));
      }
    }
  }
}

// The tensors of one file of the last committed checkpoint of DIR's project.
tp::Container last_checkpoint_file(const std::string& dir, const std::string& file) {
  std::vector<std::string> names = committed(dir);
  EXPECT_FALSE(names.empty()) << dir;
  if (names.empty()) return {};
  return tp::load_file(dir + "/project/checkpoints/" + names.back() + "/" + file);
}

// Component NAME of the last committed checkpoint of DIR's project as load_directory() gives
// it: a ZeRO-sharded optimizer whole, as one process would have saved it.
tp::Container last_checkpoint_component(const std::string& dir, const std::string& name) {
  std::vector<std::string> names = committed(dir);
  EXPECT_FALSE(names.empty()) << dir;
  if (names.empty()) return {};
  for (const tp::Component& c :
       tp::load_directory(dir + "/project/checkpoints/" + names.back()).components) {
    if (c.name == name) return c.contents;
  }
  ADD_FAILURE() << dir << " has no component " << name;
  return {};
}

void expect_equal_files(const tp::Container& a, const tp::Container& b, const std::string& what) {
  ASSERT_EQ(a.tensors.size(), b.tensors.size()) << what;
  for (std::size_t i = 0; i < a.tensors.size(); ++i) {
    EXPECT_EQ(a.tensors[i].first, b.tensors[i].first) << what;
    EXPECT_TRUE(torch::equal(a.tensors[i].second, b.tensors[i].second))
        << what << ": " << a.tensors[i].first << " differs";
  }
}

// A copy of checkpoint NAME of FROM's project as the only checkpoint of TO's.
void seed_project(const std::string& from, const std::string& name, const std::string& to) {
  std::filesystem::create_directories(to + "/project/checkpoints");
  std::filesystem::copy(from + "/project/checkpoints/" + name,
                        to + "/project/checkpoints/" + name,
                        std::filesystem::copy_options::recursive);
}

// ZeRO stages 1 and 2 (AdamW, two param groups, amsgrad in one, a GradScaler that sees an inf
// every 7th step, gradients clipped by value) on 2 processes: every step's parameters and the
// checkpoints' model and unsharded optimizer state are bit for bit those of plain data
// parallel, whose reductions are the same sums (a + b). Each process holds about half the
// optimizer state. Checkpoints of a sharded run load on any layout: stage 2's and plain's
// step-8 checkpoints resumed on 1 process end bit-identical, stage 1's resumed on 4 processes
// at stage 2 equals plain's resumed on 4 plain; a stage-2 run killed after a step or inside a
// save and restarted by torchrun ends as plain's. clip_grad_norm_ at stage 2 sums the squares per
// part, in another order than over whole tensors: within 1e-6 of plain.
TEST(DistributedAccelerator, ZeroStagesStepAsPlainDataParallelAndTheirCheckpointsLoadAnywhere) {
  tt::TempDir dir;
  const std::string d = dir.path();
  std::map<std::string, ChildRun> runs;
  for (const auto& [name, env] : std::vector<std::pair<std::string, std::string>>{
           {"plain", "TORCHPOINT_TEST_ZERO=0 TORCHPOINT_TEST_CLIP=value"},
           // z1's shards cut each piece's state into chunks of 16 elements (z2's into the
           // default's, larger than any piece here), so loads below read parts of pieces.
           {"z1", "TORCHPOINT_TEST_ZERO=1 TORCHPOINT_TEST_CLIP=value "
                  "TORCHPOINT_ZERO_CHUNK_ELEMENTS=16"},
           {"z2", "TORCHPOINT_TEST_ZERO=2 TORCHPOINT_TEST_CLIP=value"},
           {"plain_norm", "TORCHPOINT_TEST_ZERO=0 TORCHPOINT_TEST_CLIP=norm"},
           {"z2_norm", "TORCHPOINT_TEST_ZERO=2 TORCHPOINT_TEST_CLIP=norm"}}) {
    std::filesystem::create_directories(d + "/" + name);
    runs[name] = run_child(d + "/" + name, "log", 2, "none", 16, 1, env);
    ASSERT_EQ(runs[name].status, 0) << name << "\n" << runs[name].output;
  }
  const auto& plain = runs["plain"].logs;
  ASSERT_EQ(plain[0].steps.size(), 18u);
  for (const char* name : {"z1", "z2"}) {
    for (int r = 0; r < 2; ++r) EXPECT_EQ(runs[name].logs[r].steps, plain[0].steps) << name;
    // The whole optimizer state, reassembled from the processes' shards, is plain's, down to
    // the order of its keys.
    const tp::Container joined = last_checkpoint_component(d + "/" + name, "optimizer");
    const tp::Container plains = last_checkpoint_component(d + "/plain", "optimizer");
    expect_equal_files(joined, plains, name);
    EXPECT_EQ(joined.state, plains.state) << name;
    expect_equal_files(last_checkpoint_component(d + "/" + name, "model"),
                       last_checkpoint_file(d + "/plain", "model.safetensors"), name);
    // The model, the same on both processes, was written by both (the save hooks, which see
    // the models on every process, left them): split into shards, with their index, that each
    // wrote about half of, where plain's main process writes it whole. What the processes
    // wrote together is the checkpoint, manifest and hook files aside.
    const std::string last = d + "/" + name + "/project/checkpoints/" + committed(d + "/" + name).back();
    long model_shards = 0, files_bytes = 0;
    for (const auto& entry : std::filesystem::directory_iterator(last)) {
      const std::string file = entry.path().filename().string();
      if (file.rfind("model-", 0) == 0) ++model_shards;
      // The save hooks' own files are theirs, not the save's.
      if (file != "manifest.json" && file.rfind("hook_", 0) != 0) {
        files_bytes += static_cast<long>(entry.file_size());
      }
    }
    EXPECT_GE(model_shards, 2) << name;
    EXPECT_TRUE(std::filesystem::exists(last + "/model.safetensors.index.json")) << name;
    EXPECT_FALSE(std::filesystem::exists(last + "/model.safetensors")) << name;
    const auto& saved = runs[name].logs;
    const long save_number = static_cast<long>(saved[0].other.at("save_bytes").size());
    long written_sum = 0;
    for (int r = 0; r < 2; ++r) {
      const std::string line = saved[r].other.at("save_bytes").back();
      const long written = std::stol(line.substr(line.find(' ') + 1));
      EXPECT_LE(written, files_bytes * 60 / 100) << name << " rank " << r << " of " << files_bytes;
      written_sum += written;
      std::printf("%s: save %ld: rank %d wrote %ld of the checkpoint's %ld bytes\n", name,
                  save_number, r, written, files_bytes);
    }
    EXPECT_EQ(written_sum, files_bytes) << name;
    // Each process wrote its own part: the optimizer's own file holds no state tensor, and
    // the shards' tensors split plain's bytes between them, about half each.
    EXPECT_TRUE(last_checkpoint_file(d + "/" + name, "optimizer.safetensors").tensors.empty())
        << name;
    auto tensor_bytes = [](const tp::Container& c) {
      long bytes = 0;
      for (const auto& [key, t] : c.tensors) bytes += static_cast<long>(t.nbytes());
      return bytes;
    };
    const long plain_bytes = tensor_bytes(plains);
    long shard_sum = 0;
    for (int r = 0; r < 2; ++r) {
      const long bytes =
          tensor_bytes(last_checkpoint_file(d + "/" + name, fmt::format("optimizer_zero_{}.safetensors", r)));
      EXPECT_LE(bytes, plain_bytes * 55 / 100) << name << " rank " << r;
      shard_sum += bytes;
      std::printf("%s: rank %d wrote %ld bytes of optimizer state of the unsharded %ld\n", name,
                  r, bytes, plain_bytes);
    }
    EXPECT_EQ(shard_sum, plain_bytes) << name;
    // About half the unsharded state on each process, together all of it: the split is even
    // in parameter elements, and the amsgrad group keeps three tensors per element, the other
    // two.
    const long whole = std::stol(plain[0].other.at("optimizer_bytes").at(0));
    long sum = 0;
    for (int r = 0; r < 2; ++r) {
      const long mine = std::stol(runs[name].logs[r].other.at("optimizer_bytes").at(0));
      EXPECT_LE(mine, whole * 55 / 100) << name << " rank " << r;
      sum += mine;
    }
    EXPECT_EQ(sum, whole) << name;
  }
  EXPECT_EQ(runs["z2_norm"].logs[1].steps, runs["z2_norm"].logs[0].steps);

  // On 4 processes, with gradient accumulation (half of each batch under no_sync()), value
  // clipping and the scaler's inf every 7th step: stages 1 and 2 step as plain does, bit for
  // bit, on every process.
  std::map<std::string, ChildRun> four;
  for (const auto& [name, stage] : std::vector<std::pair<std::string, int>>{
           {"plain", 0}, {"z1", 1}, {"z2", 2}}) {
    const std::string sub = d + "/four_" + name;
    std::filesystem::create_directories(sub);
    four[name] = run_child(sub, "log", 4, "none", 8, 1,
                           fmt::format("TORCHPOINT_TEST_ZERO={} TORCHPOINT_TEST_CLIP=value "
                                       "TORCHPOINT_TEST_ACCUMULATE=1",
                                       stage));
    ASSERT_EQ(four[name].status, 0) << "four_" << name << "\n" << four[name].output;
  }
  ASSERT_EQ(four["plain"].logs[0].steps.size(), plain[0].steps.size());
  for (const char* name : {"z1", "z2"}) {
    for (int r = 0; r < 4; ++r) {
      EXPECT_EQ(four[name].logs[r].steps, four["plain"].logs[0].steps) << name << " rank " << r;
    }
  }

  // The CLI on a sharded checkpoint: its optimizer's digest is plain's; `consolidate` writes
  // one file of the same state; a missing shard is named by `verify`.
  auto cli = [&](const std::string& args) {
    const std::string out = d + "/cli.out";
    int status = std::system(fmt::format("{} {} > {} 2>&1", TORCHPOINT_CLI, args, out).c_str());
    return std::pair{status, tt::read_bytes(out)};
  };
  const std::string z2_last = d + "/z2/project/checkpoints/" + committed(d + "/z2").back();
  const std::string plain_last =
      d + "/plain/project/checkpoints/" + committed(d + "/plain").back();
  auto digest = [&](const std::string& args) {
    auto [status, out] = cli("digest " + args);
    EXPECT_EQ(status, 0) << out;
    return out.substr(0, out.find(' '));
  };
  EXPECT_EQ(digest("--component optimizer " + z2_last),
            digest("--component optimizer " + plain_last));
  auto [joined, joined_out] = cli(fmt::format("consolidate {} {}/z2_whole", z2_last, d));
  EXPECT_EQ(joined, 0) << joined_out;
  EXPECT_EQ(digest(z2_last), digest(d + "/z2_whole"));
  EXPECT_EQ(cli("verify " + d + "/z2_whole").first, 0);
  EXPECT_FALSE(std::filesystem::exists(d + "/z2_whole/optimizer_zero_0.safetensors"));
  expect_equal_files(tp::load_file(d + "/z2_whole/optimizer.safetensors"),
                     last_checkpoint_component(d + "/plain", "optimizer"), "consolidated");
  std::filesystem::copy(z2_last, d + "/z2_missing", std::filesystem::copy_options::recursive);
  std::filesystem::remove(d + "/z2_missing/optimizer_zero_1.safetensors");
  auto [missing, missing_out] = cli("verify " + d + "/z2_missing");
  EXPECT_NE(missing, 0) << missing_out;
  EXPECT_NE(missing_out.find("optimizer_zero_1.safetensors"), std::string::npos) << missing_out;

  // Kills of stage-2 runs, after steps and inside saves: KilledAtSeededRandomMoments... below.
  expect_close_models(d + "/z2_norm/log.model.safetensors",
                      d + "/plain_norm/log.model.safetensors", 1e-6);

  // Resharding: the step-8 checkpoint (checkpoint_1) resumed elsewhere.
  auto resume = [&](const std::string& from, const std::string& to, int processes, int batch,
                    int stage) {
    seed_project(d + "/" + from, "checkpoint_1", d + "/" + to);
    ChildRun run = run_child(d + "/" + to, "log", processes, "none", batch, 1,
                             fmt::format("TORCHPOINT_TEST_ZERO={} TORCHPOINT_TEST_CLIP=value",
                                         stage));
    EXPECT_EQ(run.status, 0) << to << "\n" << run.output;
    EXPECT_FALSE(run.logs[0].other["resumed"].empty()) << to;
    return run;
  };
  ChildRun z2_on_one = resume("z2", "z2_on_one", 0, 32, 0);
  ChildRun plain_on_one = resume("plain", "plain_on_one", 0, 32, 0);
  ASSERT_FALSE(plain_on_one.logs[0].steps.empty());
  EXPECT_EQ(z2_on_one.logs[0].steps, plain_on_one.logs[0].steps);
  expect_equal_files(tp::load_file(d + "/z2_on_one/log.model.safetensors"),
                     tp::load_file(d + "/plain_on_one/log.model.safetensors"), "on one process");
  ChildRun z1_on_four = resume("z1", "z1_on_four", 4, 8, 2);
  long all_files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(d + "/z1/project/checkpoints/checkpoint_1")) {
    if (entry.path().filename() != "manifest.json") all_files += static_cast<long>(entry.file_size());
  }
  ChildRun plain_on_four = resume("plain", "plain_on_four", 4, 8, 0);
  ASSERT_FALSE(plain_on_four.logs[0].steps.empty());
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(z1_on_four.logs[r].steps, plain_on_four.logs[0].steps) << "rank " << r;
    // Each of the four read only the chunks of the shards meeting its quarter, so even rank 1,
    // whose quarter crosses from one shard into the other, reads less than everything. The
    // files of the checkpoint, manifest aside, are what a process that read everything would
    // have read.
    const long mine = std::stol(z1_on_four.logs[r].other.at("bytes_read").at(0));
    EXPECT_LT(mine, all_files) << "rank " << r;
    std::printf("resumed on 4 at stage 2: rank %d read %ld of the checkpoint's %ld bytes\n", r,
                mine, all_files);
  }
  expect_equal_files(last_checkpoint_component(d + "/z1_on_four", "optimizer"),
                     last_checkpoint_component(d + "/plain_on_four", "optimizer"),
                     "on four processes");

  // A damaged shard in the newest checkpoint: every rank passes over it alike and resumes from
  // the one before.
  std::filesystem::create_directories(d + "/damaged/project/checkpoints");
  for (const std::string& name : committed(d + "/z2")) {
    std::filesystem::copy(d + "/z2/project/checkpoints/" + name,
                          d + "/damaged/project/checkpoints/" + name,
                          std::filesystem::copy_options::recursive);
  }
  const std::vector<std::string> damaged_names = committed(d + "/damaged");
  ASSERT_GE(damaged_names.size(), 2u);
  {
    const std::string shard = d + "/damaged/project/checkpoints/" + damaged_names.back() +
                              "/optimizer_zero_1.safetensors";
    std::fstream f(shard, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-3, std::ios::end);
    char c = 0;
    f.read(&c, 1);
    f.seekp(-3, std::ios::end);
    c = static_cast<char>(c ^ 0x5a);
    f.write(&c, 1);
  }
  ChildRun damaged = run_child(d + "/damaged", "log", 2, "none", 16, 1,
                               "TORCHPOINT_TEST_ZERO=2 TORCHPOINT_TEST_CLIP=value");
  EXPECT_EQ(damaged.status, 0) << damaged.output;
  for (int r = 0; r < 2; ++r) {
    ASSERT_FALSE(damaged.logs[r].other["resumed"].empty()) << "rank " << r;
    EXPECT_NE(damaged.logs[r].other["resumed"][0].find(damaged_names[damaged_names.size() - 2]),
              std::string::npos)
        << "rank " << r << ": " << damaged.logs[r].other["resumed"][0];
  }
}

// The reshard matrix: a checkpoint saved on 1, 2 and 4 processes, each without sharding and at
// ZeRO stages 1 and 2 (AdamW, two param groups, amsgrad in one, after 4 steps of which the
// GradScaler skipped one), loaded onto every one of those nine layouts and saved again at once:
// the model, the whole optimizer state, the scheduler, the scaler and the registered counters
// come out bit for bit as they went in, every time. Each sharded process reads only the shards
// meeting its range, and of a chunked one only the chunks meeting it.
TEST(DistributedAccelerator, ZeroCheckpointsReshardOntoEveryLayout) {
  tt::TempDir dir;
  const std::string d = dir.path();
  const std::vector<std::pair<int, int>> layouts = {{1, 0}, {1, 1}, {1, 2}, {2, 0}, {2, 1},
                                                    {2, 2}, {4, 0}, {4, 1}, {4, 2}};
  auto name_of = [](std::pair<int, int> l) { return fmt::format("w{}_s{}", l.first, l.second); };
  auto processes = [](int world) { return world == 1 ? 0 : world; };
  std::string sources;
  for (const auto& layout : layouts) {
    const std::string sub = d + "/" + name_of(layout);
    std::filesystem::create_directories(sub);
    // Stage 1 cuts the pieces' state into chunks of 24 elements, so that loads of those
    // checkpoints read parts of pieces; stage 2 keeps the default (pieces whole here).
    ChildRun run = run_child(sub, "log", processes(layout.first), "stop:step:4",
                             32 / layout.first, 1,
                             fmt::format("TORCHPOINT_TEST_ZERO={} TORCHPOINT_TEST_CLIP=value{}",
                                         layout.second,
                                         layout.second == 1 ? " TORCHPOINT_ZERO_CHUNK_ELEMENTS=24"
                                                            : ""));
    ASSERT_EQ(run.status, 0) << name_of(layout) << "\n" << run.output;
    ASSERT_EQ(committed(sub).size(), 1u) << name_of(layout);
    sources += (sources.empty() ? "" : ",") + sub + "/project/checkpoints/" + committed(sub)[0];
  }
  auto components = [](const std::string& path) {
    std::map<std::string, tp::Container> out;
    for (tp::Component& c : tp::load_directory(path).components) {
      if (c.name == "model" || c.name == "optimizer" || c.name == "scheduler" ||
          c.name == "scaler" || c.name == "custom_checkpoint_0") {
        out[c.name] = std::move(c.contents);
      }
    }
    EXPECT_EQ(out.size(), 5u) << path;
    return out;
  };
  std::vector<std::map<std::string, tp::Container>> saved;
  for (const auto& layout : layouts) {
    const std::string sub = d + "/" + name_of(layout);
    saved.push_back(components(sub + "/project/checkpoints/" + committed(sub)[0]));
  }
  std::string table = "bytes read per rank (most of any rank), source -> target:\n";
  for (const auto& target : layouts) {
    const std::string sub = d + "/to_" + name_of(target);
    std::filesystem::create_directories(sub);
    ChildRun run = run_child(
        sub, "log", processes(target.first), "none", 32 / target.first, 1,
        fmt::format("TORCHPOINT_TEST_ZERO={} TORCHPOINT_TEST_RESHARD={}", target.second, sources));
    ASSERT_EQ(run.status, 0) << name_of(target) << "\n" << run.output;
    for (std::size_t k = 0; k < layouts.size(); ++k) {
      const std::string what = name_of(layouts[k]) + " -> " + name_of(target);
      auto again = components(fmt::format("{}/project/resaved_{}", sub, k));
      for (const auto& [name, contents] : saved[k]) {
        expect_equal_files(again[name], contents, what + " " + name);
        EXPECT_EQ(again[name].state, contents.state) << what << " " << name;
      }
      long most = 0;
      for (const RankLog& log : run.logs) {
        ASSERT_GT(log.other.count("reshard_read"), 0u) << what;
        const std::string& line = log.other.at("reshard_read").at(k);
        most = std::max(most, std::stol(line.substr(line.find(' ') + 1)));
      }
      table += fmt::format("  {}: {}\n", what, most);
    }
  }
  std::printf("%s", table.c_str());
}

// Gradient accumulation as Accelerate users write it: backward() of the first half of every batch
// under no_sync() (no collective), then of the second half (one averaging). Ends where the plain
// run on the same global batches ends, and enters exactly as many collectives as it.
TEST(DistributedAccelerator, NoSyncAccumulatesLocallyAndAveragesOnce) {
  tt::TempDir dir;
  for (const char* sub : {"/plain", "/accumulate", "/one"}) {
    std::filesystem::create_directories(dir.path() + sub);
  }
  ChildRun plain = run_child(dir.path() + "/plain", "log", 2, "none");
  ASSERT_EQ(plain.status, 0) << plain.output;
  ChildRun accumulated = run_child(dir.path() + "/accumulate", "log", 2, "none", 16, 1,
                                   "TORCHPOINT_TEST_ACCUMULATE=1");
  ASSERT_EQ(accumulated.status, 0) << accumulated.output;
  ChildRun one = run_child(dir.path() + "/one", "log", 0, "none", 32);
  ASSERT_EQ(one.status, 0) << one.output;

  EXPECT_EQ(accumulated.logs[1].steps, accumulated.logs[0].steps);
  ASSERT_EQ(accumulated.logs[0].steps.size(), plain.logs[0].steps.size());
  ASSERT_EQ(plain.logs[0].other["collectives"].size(), 1u);
  EXPECT_EQ(accumulated.logs[0].other["collectives"], plain.logs[0].other["collectives"]);
  expect_close_models(dir.path() + "/accumulate/log.model.safetensors",
                      dir.path() + "/plain/log.model.safetensors", 1e-6);
  expect_close_models(dir.path() + "/accumulate/log.model.safetensors",
                      dir.path() + "/one/log.model.safetensors", 1e-6);
}

// SIGKILL of one process at 14 seeded random moments (after a step, or before a file-system call
// inside a save, on either rank), 12 of them in a run at ZeRO stage 2 (where every rank writes
// its shard of the optimizer state and part of the model; 4 of those runs save in the
// background with save_state_async, 2 killed inside a background save) and 2 in plain data
// parallel;
// torchrun restarts the pair; each run ends bit-identical to the uninterrupted run of its kind,
// and `torchpoint verify` accepts every committed checkpoint (none lacks a rank's file).
TEST(DistributedAccelerator, KilledAtSeededRandomMomentsResumesBitIdentically) {
  tt::TempDir dir;
  struct Kind {
    std::string env;
    ChildRun reference;
    std::map<long, std::string> steps;
    std::vector<std::vector<long>> ops;  // file-system calls of each save on each rank
  };
  std::map<std::string, Kind> kinds;
  kinds["plain"].env = "";
  kinds["zero2"].env = "TORCHPOINT_TEST_ZERO=2 TORCHPOINT_TEST_CLIP=value";
  // The same run with every save in the background (save_state_async), waited for at the next.
  kinds["zero2async"].env = kinds["zero2"].env + " TORCHPOINT_TEST_ASYNC=1";
  for (auto& [name, kind] : kinds) {
    std::filesystem::create_directories(dir.path() + "/" + name);
    kind.reference = run_child(dir.path() + "/" + name, "reference", 2, "none", 16, 1, kind.env);
    ASSERT_EQ(kind.reference.status, 0) << name << "\n" << kind.reference.output;
    kind.steps = last_digest_by_step(kind.reference.logs[0]);
    kind.ops.resize(2);
    for (int r = 0; r < 2; ++r) {
      for (const std::string& line : kind.reference.logs[r].other.at("save_ops")) {
        kind.ops[r].push_back(std::stol(line.substr(line.find(' ') + 1)));
      }
      ASSERT_EQ(kind.ops[r].size(), 4u) << name;
    }
  }
  // A background save commits what save_state() commits: the same steps and final state, and
  // every checkpoint the same logical state (torchpoint digest) and valid.
  const Kind &sync = kinds.at("zero2"), &async = kinds.at("zero2async");
  EXPECT_EQ(async.steps, sync.steps);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(async.reference.logs[r].other.at("final"), sync.reference.logs[r].other.at("final"));
  }
  const std::vector<std::string> kept = committed(dir.path() + "/zero2");
  ASSERT_EQ(kept.size(), 3u);
  EXPECT_EQ(committed(dir.path() + "/zero2async"), kept);
  auto cli = [&](const std::string& args) {
    const std::string out = dir.path() + "/cli.out";
    int status = std::system(fmt::format("{} {} > {} 2>&1", TORCHPOINT_CLI, args, out).c_str());
    return std::pair{status, tt::read_bytes(out)};
  };
  for (const std::string& name : kept) {
    auto [s1, d1] = cli(fmt::format("digest {}/zero2/project/checkpoints/{}", dir.path(), name));
    auto [s2, d2] =
        cli(fmt::format("digest {}/zero2async/project/checkpoints/{}", dir.path(), name));
    EXPECT_EQ(s1, 0) << d1;
    EXPECT_EQ(s2, 0) << d2;
    EXPECT_EQ(d2.substr(0, d2.find(' ')), d1.substr(0, d1.find(' '))) << name;
    auto [verified, said] =
        cli(fmt::format("verify {}/zero2async/project/checkpoints/{}", dir.path(), name));
    EXPECT_EQ(verified, 0) << said;
    EXPECT_TRUE(std::filesystem::exists(
        fmt::format("{}/zero2async/project/checkpoints/{}/hook_rank1.txt", dir.path(), name)));
  }

  std::mt19937 rng(20261201);
  int inside_saves = 0, zero_runs = 0, zero_inside_saves = 0, async_inside_saves = 0;
  for (int i = 0; i < 14; ++i) {
    const std::string name = i % 7 == 0 ? "plain" : i % 3 == 1 ? "zero2async" : "zero2";
    Kind& kind = kinds.at(name);
    const int rank = static_cast<int>(rng() % 2);
    std::string plan;
    if (i % 2 == 0) {
      plan = fmt::format("kill:{}:step:{}", rank, 1 + rng() % 17);
    } else {
      const long save = 1 + static_cast<long>(rng() % 4);
      const long op = 1 + static_cast<long>(rng() % kind.ops[rank][save - 1]);
      plan = fmt::format("kill:{}:save:{}:op:{}", rank, save, op);
      ++inside_saves;
      zero_inside_saves += name != "plain";
      async_inside_saves += name == "zero2async";
    }
    zero_runs += name != "plain";
    SCOPED_TRACE(name + " " + plan);
    std::string sub = dir.path() + "/" + std::to_string(i);
    std::filesystem::create_directories(sub);
    ChildRun run = run_child(sub, "log", 2, plan, 16, 1, kind.env);
    ASSERT_EQ(run.status, 0) << run.output;
    // Killed once, restarted once: rank 0 checked the checkpoints twice and found none torn.
    EXPECT_EQ(run.logs[0].other["checked"].size(), 2u);
    EXPECT_TRUE(run.logs[0].other["bad"].empty()) << run.logs[0].other["bad"][0];
    for (int r = 0; r < 2; ++r) {
      for (const auto& [step, digest] : run.logs[r].steps) {
        EXPECT_EQ(digest, kind.steps.at(step)) << "rank " << r << " step " << step;
      }
      EXPECT_EQ(last_digest_by_step(run.logs[r]), kind.steps);
      EXPECT_EQ(run.logs[r].other["final"], kind.reference.logs[r].other["final"])
          << "rank " << r;
    }
    for (const std::string& checkpoint : committed(sub)) {
      std::string path = sub + "/project/checkpoints/" + checkpoint;
      std::string out = sub + "/verify.out";
      int status =
          std::system(fmt::format("{} verify {} > {} 2>&1", TORCHPOINT_CLI, path, out).c_str());
      EXPECT_EQ(status, 0) << tt::read_bytes(out);
    }
  }
  EXPECT_EQ(inside_saves, 7);
  EXPECT_EQ(zero_runs, 12);
  EXPECT_EQ(zero_inside_saves, 6);
  EXPECT_EQ(async_inside_saves, 2);
}

// A write that fails on one rank only (ENOSPC from the fault-injecting Env) makes save_state()
// throw on every rank, with nothing committed and no temporary left; the run goes on and its next
// saves work.
TEST(DistributedAccelerator, AWriteFailingOnOneRankCommitsNothing) {
  tt::TempDir dir;
  ChildRun reference = run_child(dir.path(), "reference", 2, "none");
  ASSERT_EQ(reference.status, 0) << reference.output;
  // The last run saves in the background: the failure reaches every rank's handle alike.
  for (int k : {1, 0, 3}) {
    const int failing = k % 2;
    const bool async = k == 3;
    SCOPED_TRACE(fmt::format("rank {} fails{}", failing, async ? ", in the background" : ""));
    std::string sub = dir.path() + "/fail" + std::to_string(k);
    std::filesystem::create_directories(sub);
    ChildRun run = run_child(sub, "log", 2, fmt::format("fail:{}:save:2", failing), 16, 0,
                             async ? "TORCHPOINT_TEST_ASYNC=1" : "");
    ASSERT_EQ(run.status, 0) << run.output;
    for (int r = 0; r < 2; ++r) {
      ASSERT_EQ(run.logs[r].other["save_failed"].size(), 1u) << "rank " << r;
      const std::string& message = run.logs[r].other["save_failed"][0];
      if (r == failing) {
        EXPECT_NE(message.find("No space left on device"), std::string::npos) << message;
      } else {
        EXPECT_NE(message.find(fmt::format("rank {}:", failing)), std::string::npos) << message;
        EXPECT_NE(message.find("nothing was committed"), std::string::npos) << message;
      }
      // Training is not affected by a failed save.
      EXPECT_EQ(run.logs[r].other["final"], reference.logs[r].other["final"]);
    }
    // Saves at steps 4, 8 (failed, its number unused), 12 and 16; total_limit 3.
    EXPECT_EQ(committed(sub),
              (std::vector<std::string>{"checkpoint_0", "checkpoint_2", "checkpoint_3"}));
  }
}

// A damaged byte in a checkpoint two processes load: both refuse it, each naming the tensor, and
// neither goes on to use it (no process saves afterwards), whether the damage is at the start or
// at the end of the model's data; chosen automatically, both pass it over for the one before. Each process hashes every byte it reads: an experiment that
// split the hashing between the processes of a node was not faster (README, "Multi-process
// loads"), and would have made one process trust bytes it read but another checked.
TEST(DistributedAccelerator, ADamagedByteMakesEveryProcessRefuseTheLoadOrPassItOver) {
  tt::TempDir dir;
  ChildRun first = run_child(dir.path(), "first", 2, "stop:step:8", 16, 0);
  ASSERT_EQ(first.status, 0) << first.output;
  const std::string saved = dir.path() + "/project/checkpoints/checkpoint_1";
  ASSERT_TRUE(std::filesystem::exists(saved + "/model.safetensors"));
  // The model file's data is 0.weight, 0.bias, 2.weight, 2.bias, in that order.
  for (const auto& [at_end, tensor] : std::vector<std::pair<bool, std::string>>{
           {false, "0.weight"}, {true, "2.bias"}}) {
    SCOPED_TRACE(tensor);
    const std::string copy = fmt::format("{}/damaged{}", dir.path(), at_end);
    std::filesystem::copy(saved, copy, std::filesystem::copy_options::recursive);
    const std::string file = copy + "/model.safetensors";
    const std::string bytes = tt::read_bytes(file);
    std::uint64_t header = 0;
    for (int i = 7; i >= 0; --i) header = header << 8 | static_cast<unsigned char>(bytes[i]);
    tt::flip_bit(file, at_end ? bytes.size() - 1 : 8 + header, 2);
    const std::string sub = fmt::format("{}/load{}", dir.path(), at_end);
    std::filesystem::create_directories(sub);
    ChildRun load = run_child(sub, "log", 2, "none", 16, 0, "TORCHPOINT_TEST_RESHARD=" + copy);
    EXPECT_NE(load.status, 0) << load.output;
    for (int r = 0; r < 2; ++r) {
      ASSERT_EQ(load.logs[r].other["error"].size(), 1u) << "rank " << r << load.output;
      const std::string& message = load.logs[r].other["error"][0];
      EXPECT_NE(message.find(fmt::format("tensor '{}' fails its checksum", tensor)),
                std::string::npos)
          << message;
      EXPECT_TRUE(load.logs[r].other["reshard_read"].empty()) << "rank " << r;
    }
    EXPECT_FALSE(std::filesystem::exists(sub + "/project/resaved_0"));
  }
  // The automatic choice reads the newest checkpoint without a verify first: damaged, every
  // process passes it over together and resumes from the one before. With a load hook the
  // checkpoint is verified first, on the main process; every process's report still lists
  // what was passed over (the copy of the run resumed that way).
  const std::string model = saved + "/model.safetensors";
  tt::flip_bit(model, tt::file_size(model) - 1, 4);
  const std::string hooked = dir.path() + "/hooked";
  std::filesystem::create_directories(hooked);
  std::filesystem::copy(dir.path() + "/project", hooked + "/project",
                        std::filesystem::copy_options::recursive);
  for (const bool hook : {false, true}) {
    SCOPED_TRACE(hook ? "with a load hook" : "without a load hook");
    ChildRun resume = run_child(hook ? hooked : dir.path(), "resume", 2, "none", 16, 0,
                                hook ? "" : "TORCHPOINT_TEST_NO_LOAD_HOOK=1");
    ASSERT_EQ(resume.status, 0) << resume.output;
    for (int r = 0; r < 2; ++r) {
      ASSERT_EQ(resume.logs[r].other["resumed"].size(), 1u) << "rank " << r;
      EXPECT_NE(resume.logs[r].other["resumed"][0].find("checkpoint_0"), std::string::npos)
          << resume.logs[r].other["resumed"][0];
      ASSERT_EQ(resume.logs[r].other["skipped"].size(), 1u) << "rank " << r;
      EXPECT_NE(resume.logs[r].other["skipped"][0].find("checkpoint_1"), std::string::npos)
          << resume.logs[r].other["skipped"][0];
    }
  }
}

// Two torchrun agents ("nodes", one process each), and one worker killed: its agent restarts it
// and counts a restart, the other agent restarts its own for the membership change and does not,
// so TORCHELASTIC_RESTART_COUNT differs between the ranks. They must meet again all the same,
// whichever rank dies and wherever (mid-step, inside a save, inside the load of the restart),
// and end bit-identical to the one-agent run.
TEST(DistributedAccelerator, TwoAgentsMeetAgainWhicheverWorkerDies) {
  tt::TempDir dir;
  ChildRun reference = run_child(dir.path(), "reference", 2, "none");
  ASSERT_EQ(reference.status, 0) << reference.output;
  const std::map<long, std::string> steps = last_digest_by_step(reference.logs[0]);
  int counts_differed = 0;
  for (std::string plan :
       {"kill:1:step:6", "kill:0:save:2:op:3", "kill:1:save:3:op:5", "kill:0:load:4"}) {
    SCOPED_TRACE(plan);
    std::string sub = dir.path() + "/" + std::to_string(std::hash<std::string>()(plan));
    std::filesystem::create_directories(sub);
    ChildRun run = run_two_nodes(sub, "log", plan);
    ASSERT_EQ(run.status, 0) << run.output;
    const int starts = plan.find(":load:") != std::string::npos ? 3 : 2;
    EXPECT_EQ(run.logs[0].other["checked"].size(), static_cast<std::size_t>(starts));
    EXPECT_TRUE(run.logs[0].other["bad"].empty());
    for (int r = 0; r < 2; ++r) {
      for (const auto& [step, digest] : run.logs[r].steps) {
        EXPECT_EQ(digest, steps.at(step)) << "rank " << r << " step " << step;
      }
      EXPECT_EQ(last_digest_by_step(run.logs[r]), steps);
      EXPECT_EQ(run.logs[r].other["final"], reference.logs[r].other["final"]) << "rank " << r;
      EXPECT_EQ(run.logs[r].other["pid"].size(), static_cast<std::size_t>(starts));
      // Every process runs the load hooks, as Accelerate does (a load killed early may not have
      // reached them).
      EXPECT_GE(run.logs[r].other["load_hook"].size(), run.logs[r].other["resumed"].size());
      EXPECT_LE(run.logs[r].other["load_hook"].size(), static_cast<std::size_t>(starts - 1));
      EXPECT_EQ(run.logs[r].other["resumed"].size(), 1u);
    }
    // Did the agents give the two ranks different restart counts ("pid PID COUNT" lines)? That
    // is the case that broke when the ranks met under a name made of the count. It happens when
    // the surviving worker is waiting in the store (a save) rather than in a gloo collective,
    // which fails at once when its peer dies and has its own agent count a restart too.
    std::set<std::string> counts;
    for (int r = 0; r < 2; ++r) {
      const std::string& last = run.logs[r].other["pid"].back();
      counts.insert(last.substr(last.find(' ') + 1));
    }
    if (counts.size() == 2) ++counts_differed;
  }
  EXPECT_GE(counts_differed, 1) << "no case gave the ranks different restart counts";
}

// Accelerate's save_on_each_node, for nodes that do not share a disk: two nodes, each given a
// project directory of its own. Each node's copy of every checkpoint is complete for that node
// (model, optimizer, ... and its processes' RNG states) and verifies; no process touches the
// other node's directory; a rank killed inside a save resumes bit-identically from its node's
// copy. Then a node's newest copy damaged: both nodes fall back together to the newest
// checkpoint both hold valid, and the run still ends like the uninterrupted one.
TEST(DistributedAccelerator, SaveOnEachNodeKeepsEveryNodeOnItsOwnDisk) {
  tt::TempDir dir;
  ChildRun reference = run_child(dir.path(), "reference", 2, "none");
  ASSERT_EQ(reference.status, 0) << reference.output;
  const std::map<long, std::string> steps = last_digest_by_step(reference.logs[0]);
  const std::string each_node = "TORCHPOINT_TEST_EACH_NODE=1";
  auto expect_like_reference = [&](ChildRun& run) {
    for (int r = 0; r < 2; ++r) {
      for (const auto& [step, digest] : run.logs[r].steps) {
        EXPECT_EQ(digest, steps.at(step)) << "rank " << r << " step " << step;
      }
      EXPECT_EQ(run.logs[r].other["final"], reference.logs[r].other["final"]) << "rank " << r;
      EXPECT_TRUE(run.logs[r].other["foreign"].empty())
          << "rank " << r << " touched " << run.logs[r].other["foreign"][0];
    }
  };

  const std::string sub = dir.path() + "/killed";
  ChildRun run = run_two_nodes(sub, "log", "kill:1:save:2:op:3", 1, 3, each_node, true);
  ASSERT_EQ(run.status, 0) << run.output;
  expect_like_reference(run);
  EXPECT_EQ(run.logs[0].other["resumed"].size(), 1u);
  EXPECT_EQ(run.logs[1].other["resumed"].size(), 1u);
  std::vector<std::string> names = committed(sub + "/node0");
  EXPECT_EQ(names, committed(sub + "/node1"));
  ASSERT_EQ(names.size(), 3u);  // total_limit 3, applied on each node
  for (const std::string& name : names) {
    std::set<std::string> rng_files;
    for (int node = 0; node < 2; ++node) {
      const std::string path = fmt::format("{}/node{}/project/checkpoints/{}", sub, node, name);
      const std::string out = sub + "/verify.out";
      EXPECT_EQ(std::system(fmt::format("{} verify {} > {} 2>&1", TORCHPOINT_CLI, path, out).c_str()),
                0)
          << tt::read_bytes(out);
      EXPECT_TRUE(std::filesystem::exists(path + "/model.safetensors")) << path;
      EXPECT_TRUE(std::filesystem::exists(path + "/optimizer.safetensors")) << path;
      int here = 0;
      for (int r = 0; r < 2; ++r) {
        if (std::filesystem::exists(fmt::format("{}/random_states_{}.safetensors", path, r))) {
          rng_files.insert(std::to_string(r));
          ++here;
        }
      }
      EXPECT_EQ(here, 1) << path << ": one process per node, its RNG states only";
    }
    EXPECT_EQ(rng_files, (std::set<std::string>{"0", "1"})) << name;
  }

  // Node 1's newest copy damaged (one byte of its model): both fall back to the one before.
  const std::string fallback = dir.path() + "/fallback";
  ChildRun first = run_two_nodes(fallback, "first", "stop:step:12", 1, 0, each_node, true);
  ASSERT_EQ(first.status, 0) << first.output;
  ASSERT_EQ(committed(fallback + "/node1"),
            (std::vector<std::string>{"checkpoint_0", "checkpoint_1", "checkpoint_2"}));
  {
    const std::string model = fallback + "/node1/project/checkpoints/checkpoint_2/model.safetensors";
    std::fstream f(model, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(-1, std::ios::end);
    const char c = static_cast<char>(f.get() ^ 0x5a);
    f.seekp(-1, std::ios::end);
    f.put(c);
  }
  ChildRun second = run_two_nodes(fallback, "second", "none", 1, 0, each_node, true);
  ASSERT_EQ(second.status, 0) << second.output;
  for (int r = 0; r < 2; ++r) {
    ASSERT_EQ(second.logs[r].other["resumed"].size(), 1u) << second.output;
    EXPECT_NE(second.logs[r].other["resumed"][0].find("checkpoint_1 "), std::string::npos)
        << second.logs[r].other["resumed"][0];
    ASSERT_EQ(second.logs[r].other["skipped"].size(), 1u);
    EXPECT_NE(second.logs[r].other["skipped"][0].find("node 1"), std::string::npos)
        << second.logs[r].other["skipped"][0];
    EXPECT_EQ(second.logs[r].steps.front().first, 9) << "rank " << r;  // after checkpoint_1
  }
  expect_like_reference(second);
}

// The processes `pid` started (its children), from /proc.
std::vector<pid_t> children_of(pid_t pid) {
  std::vector<pid_t> out;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(entry.path() / "stat");
    std::string line;
    if (!std::getline(stat, line)) continue;
    // "pid (comm) state ppid ...": comm may hold spaces, so read after the last ')'.
    std::istringstream rest(line.substr(line.rfind(')') + 1));
    std::string state;
    pid_t parent = 0;
    rest >> state >> parent;
    if (parent == pid) out.push_back(static_cast<pid_t>(std::stol(name)));
  }
  return out;
}

// Two nodes of two processes each (4 ranks), and node 1 killed whole once the run has committed
// two checkpoints: its torchrun agent and its workers, with SIGKILL, as a machine that loses
// power. Then node 1 is started again, as an operator (or a cluster manager) would: node 0's
// agent restarts its workers, the two agents meet in a new round, and the run ends bit-identical
// to the uninterrupted 4-process run.
TEST(DistributedAccelerator, AWholeNodeKilledAndStartedAgainEndsLikeTheUninterruptedRun) {
  tt::TempDir dir;
  ChildRun reference = run_child(dir.path(), "reference", 4, "none", 16, 0,
                                 "TORCHPOINT_TEST_EPOCHS=40");
  ASSERT_EQ(reference.status, 0) << reference.output;
  const std::map<long, std::string> steps = last_digest_by_step(reference.logs[0]);
  const std::string sub = dir.path() + "/nodes";
  std::filesystem::create_directories(sub);
  const int port = free_port("127.0.0.2");
  // TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with torchrun's shared store (torch 2.4 and later), an
  // agent that was rank 0 keeps its store and does not publish its address again in a later
  // round, and a freshly started agent waits for that address until the rendezvous times out.
  auto agent_command = [&](int node, int start) {
    return fmt::format(
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 GLOO_SOCKET_IFNAME=lo TORCHPOINT_TEST_EPOCHS=40 "
        "exec {} -m torch.distributed.run "
        "--nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint 127.0.0.2:{} "
        "--rdzv-id tp{} --rdzv-conf is_host={} --local-addr 127.0.0.{} --max-restarts 3 "
        "--monitor-interval 0.1 --no-python {} {}/project {}/log none 16 > {}/node{}.{}.out 2>&1",
        tt::python(), port, port, node == 0 ? "true" : "false", node + 2, DIST_CHILD, sub, sub, sub,
        node, start);
  };
  auto start_agent = [&](int node, int start) {
    pid_t pid = ::fork();
    if (pid == 0) {
      const std::string command = agent_command(node, start);
      ::execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    return pid;
  };
  pid_t node0 = start_agent(0, 0), node1 = start_agent(1, 0);
  ASSERT_GT(node0, 0);
  ASSERT_GT(node1, 0);
  // However the test ends, no agent or worker outlives it.
  struct Reaper {
    pid_t* agents[2];
    ~Reaper() {
      for (pid_t* agent : agents) {
        if (::kill(*agent, 0) != 0) continue;
        ::kill(*agent, SIGSTOP);
        for (pid_t w : children_of(*agent)) ::kill(w, SIGKILL);
        ::kill(*agent, SIGKILL);
        ::waitpid(*agent, nullptr, 0);
      }
    }
  } reaper{{&node0, &node1}};
  auto checkpoints = [&] {
    return std::filesystem::exists(sub + "/project/checkpoints") ? committed(sub).size() : 0;
  };
  // Until two checkpoints are committed.
  for (int wait = 0; wait < 1200 && checkpoints() < 2; ++wait) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_GE(checkpoints(), 2u) << tt::read_bytes(sub + "/node0.0.out");
  // The whole node at once: the agent stopped first so that it restarts nothing, its workers
  // (each in a session of its own) and then the agent killed.
  ASSERT_EQ(::kill(node1, SIGSTOP), 0);
  std::vector<pid_t> workers = children_of(node1);
  EXPECT_EQ(workers.size(), 2u);
  for (pid_t w : workers) ::kill(w, SIGKILL);
  ::kill(node1, SIGKILL);
  int status = 0;
  ::waitpid(node1, &status, 0);
  node1 = start_agent(1, 1);
  int status0 = 0, status1 = 0;
  ::waitpid(node0, &status0, 0);
  ::waitpid(node1, &status1, 0);
  const std::string output = tt::read_bytes(sub + "/node0.0.out") +
                             tt::read_bytes(sub + "/node1.0.out") +
                             tt::read_bytes(sub + "/node1.1.out");
  ASSERT_TRUE(WIFEXITED(status0) && WEXITSTATUS(status0) == 0) << output;
  ASSERT_TRUE(WIFEXITED(status1) && WEXITSTATUS(status1) == 0) << output;
  for (int r = 0; r < 4; ++r) {
    RankLog log = read_log(fmt::format("{}/log.{}", sub, r));
    EXPECT_EQ(log.other["pid"].size(), 2u) << "rank " << r;  // every rank started twice
    EXPECT_EQ(log.other["resumed"].size(), 1u) << "rank " << r;
    for (const auto& [step, digest] : log.steps) {
      EXPECT_EQ(digest, steps.at(step)) << "rank " << r << " step " << step;
    }
    EXPECT_EQ(last_digest_by_step(log), last_digest_by_step(reference.logs[r]));
    EXPECT_EQ(log.other["final"], reference.logs[r].other["final"]) << "rank " << r;
  }
  for (const std::string& name : committed(sub)) {
    EXPECT_TRUE(tp::verify(sub + "/project/checkpoints/" + name).ok()) << name;
  }
}

// SIGSTOP of one rank at seeded random moments of a long run (in a step, inside the gradient
// allreduce, between collectives, inside a save), and of either rank inside the load of a resumed
// run: every other rank fails within the group's timeout plus a little, naming the stopped rank,
// and no committed checkpoint is torn.
TEST(DistributedAccelerator, AStoppedRankIsNamedWhereverItStops) {
  tt::TempDir dir;
  std::mt19937 rng(20261205);
  // Four seeded moments of a long run; then cases 4 and 5: rank 0, then rank 1, stops itself
  // inside the load of a resumed run.
  for (int i = 0; i < 6; ++i) {
    const bool in_load = i >= 4;
    const int stopped = in_load ? i - 4 : static_cast<int>(rng() % 2), other = 1 - stopped;
    const int delay_ms = in_load ? 0 : static_cast<int>(rng() % 800);
    SCOPED_TRACE(in_load ? fmt::format("case {}: rank {} stopped inside load_state", i, stopped)
                         : fmt::format("case {}: rank {} stopped {} ms after its first step", i,
                                       stopped, delay_ms));
    std::string sub = dir.path() + "/" + std::to_string(i);
    std::filesystem::create_directories(sub);
    if (in_load) {  // a checkpoint to resume from
      ChildRun first = run_child(sub, "first", 2, "stop:step:8", 16, 0);
      ASSERT_EQ(first.status, 0) << first.output;
    }
    const std::string command = fmt::format(
        "TORCHPOINT_PROCESS_TIMEOUT=3 TORCHPOINT_TEST_EPOCHS=400 exec {} -m torch.distributed.run "
        "--standalone --nproc-per-node 2 --max-restarts 0 --monitor-interval 0.1 --no-python "
        "{} {}/project {}/log {} 16 > {}/log.out 2>&1",
        tt::python(), DIST_CHILD, sub, sub,
        in_load ? fmt::format("freeze:{}:load:3", stopped) : std::string("none"), sub);
    pid_t agent = ::fork();
    if (agent == 0) {
      ::execl("/bin/sh", "sh", "-c", command.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    ASSERT_GT(agent, 0);
    // Until the rank to stop has logged its first step (in a load: has stopped itself).
    auto is_stopped = [](pid_t pid) {
      std::ifstream stat(fmt::format("/proc/{}/stat", pid));
      std::string line;
      std::getline(stat, line);
      return line.size() > line.rfind(')') + 2 && line[line.rfind(')') + 2] == 'T';
    };
    pid_t target = 0;
    for (int wait = 0; wait < 600 && target == 0; ++wait) {
      RankLog log = read_log(fmt::format("{}/log.{}", sub, stopped));
      if (!log.other["pid"].empty() && (in_load ? is_stopped(std::stoi(log.other["pid"][0]))
                                                : !log.steps.empty())) {
        target = std::stoi(log.other["pid"][0]);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ASSERT_NE(target, 0) << tt::read_bytes(sub + "/log.out");
    if (!in_load) {
      std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
      ASSERT_EQ(::kill(target, SIGSTOP), 0);
    }
    const auto stopped_at = std::chrono::steady_clock::now();
    // The other rank gives up and logs why; then the stopped one is killed, as an operator would
    // (torchrun's SIGTERM does not reach a stopped process), and the agent ends.
    std::string error;
    double seconds = 0;
    while (error.empty() && seconds < 60) {
      RankLog log = read_log(fmt::format("{}/log.{}", sub, other));
      if (!log.other["error"].empty()) error = log.other["error"][0];
      seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - stopped_at).count();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    ::kill(target, SIGKILL);
    int status = 0;
    ::waitpid(agent, &status, 0);
    EXPECT_FALSE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    ASSERT_FALSE(error.empty()) << "rank " << other << " never failed\n"
                                << tt::read_bytes(sub + "/log.out");
    // Named after the reporting rank's own "rank N:" prefix.
    EXPECT_NE(error.find(fmt::format("rank {}", stopped), error.find(": ")), std::string::npos)
        << error;
    EXPECT_LE(seconds, 3 + 30) << error;
    std::printf("case %d: rank %d stopped; rank %d failed %.1f s later: %s\n", i, stopped, other,
                seconds, error.c_str());
    EXPECT_EQ(error.find("frame #"), std::string::npos) << error;
    for (const std::string& name : committed(sub)) {
      std::string path = sub + "/project/checkpoints/" + name;
      std::string out = sub + "/verify.out";
      int verified =
          std::system(fmt::format("{} verify {} > {} 2>&1", TORCHPOINT_CLI, path, out).c_str());
      EXPECT_EQ(verified, 0) << tt::read_bytes(out);
    }
  }
}

// 4 -> 2 and 2 -> 4 processes: the epoch in progress continues with every sample exactly once.
TEST(DistributedAccelerator, ResumesOnAnotherNumberOfProcessesWithoutRepeatingOrSkipping) {
  tt::TempDir dir;
  for (auto [before, after, stop] : {std::tuple{4, 2, 4}, std::tuple{2, 4, 8}}) {
    SCOPED_TRACE(fmt::format("{} -> {}", before, after));
    std::string sub = dir.path() + fmt::format("/{}to{}", before, after);
    std::filesystem::create_directories(sub);
    ChildRun first = run_child(sub, "first", before, fmt::format("stop:step:{}", stop), 16, 0);
    ASSERT_EQ(first.status, 0) << first.output;
    ChildRun second = run_child(sub, "second", after, "none", 16, 0);
    ASSERT_EQ(second.status, 0) << second.output;
    ASSERT_EQ(second.logs[0].other["resumed"].size(), 1u);
    EXPECT_NE(second.logs[0].other["resumed"][0].find(" " + std::to_string(before)),
              std::string::npos);
    EXPECT_NE(second.output.find(
                  fmt::format("saved by {} process(es) and is loaded by {}", before, after)),
              std::string::npos)
        << second.output;
    // Epoch 1 was cut: what both runs consumed of it is every sample once; epoch 2 too.
    std::map<long, std::multiset<long>> seen;
    for (const ChildRun* run : {&first, &second}) {
      for (const RankLog& log : run->logs) {
        for (const auto& [epoch, indices] : log.samples)
          seen[epoch].insert(indices.begin(), indices.end());
      }
    }
    for (long epoch : {0L, 1L, 2L}) {
      std::multiset<long> all;
      for (long i = 0; i < 192; ++i) all.insert(i);
      EXPECT_EQ(seen[epoch], all) << "epoch " << epoch;
    }
  }
}

// A rank that hangs (in a step, or before writing its part of a checkpoint) makes the others
// fail within the group's timeout (TORCHPOINT_PROCESS_TIMEOUT=3 s), naming it.
TEST(DistributedAccelerator, AHungRankMakesTheOthersFailInTimeNamingIt) {
  tt::TempDir dir;
  for (std::string plan : {"hang:1:step:3", "hang:1:save:2"}) {
    SCOPED_TRACE(plan);
    std::string sub = dir.path() + "/" + plan.substr(5, 4);
    std::filesystem::create_directories(sub);
    auto start = std::chrono::steady_clock::now();
    ChildRun run = run_child(sub, "log", 2, plan, 16, 0, "TORCHPOINT_PROCESS_TIMEOUT=3");
    double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_NE(run.status, 0);
    ASSERT_EQ(run.logs[0].other["error"].size(), 1u) << run.output;
    const std::string& message = run.logs[0].other["error"][0];
    EXPECT_NE(message.find("rank 1"), std::string::npos) << message;
    EXPECT_NE(message.find("3000 ms"), std::string::npos) << message;
    // The hung rank sleeps 600 s: the pair ended because rank 0 gave up on it.
    EXPECT_LT(seconds, 120) << message;
  }
}

// The CLI knows a checkpoint of several processes: `verify` refuses one whose manifest lacks a
// rank's RNG file (a valid manifest otherwise), `ls` and `show` give the number of processes.
TEST(DistributedCli, VerifyNamesAMissingRanksFileAndLsShowsTheProcesses) {
  tt::TempDir dir;
  tp::StateDict rng;
  rng.set("seed", static_cast<std::uint64_t>(3));
  tp::CheckpointInfo info;
  info.metadata = {{"accelerator", {{"world_size", 2}}}};
  std::string path = dir.path() + "/checkpoints/checkpoint_0";
  tp::save_directory(path,
                     {{"model", tp::Container{{{"w", at::ones({2})}}, tp::Json::object()}},
                      {"random_states_0", rng.to_container()}},
                     info);
  auto run = [&](const std::string& args) {
    std::string out = dir.path() + "/cli.out";
    int status = std::system(fmt::format("{} {} > {} 2>&1", TORCHPOINT_CLI, args, out).c_str());
    return std::pair{status, tt::read_bytes(out)};
  };
  auto [status, output] = run("verify " + path);
  EXPECT_NE(status, 0) << output;
  EXPECT_NE(output.find("written by 2 processes, but the manifest lists no random_states_1"),
            std::string::npos)
      << output;
  auto [ls_status, ls] = run("ls --json " + dir.path() + "/checkpoints");
  EXPECT_EQ(ls_status, 0) << ls;
  EXPECT_EQ(tp::Json::parse(ls)["checkpoints"][0]["processes"], 2) << ls;
  auto [show_status, show] = run("show " + path);
  EXPECT_EQ(show_status, 0) << show;
  EXPECT_NE(show.find("processes  2"), std::string::npos) << show;
  EXPECT_NE(show.find("random_states_0.safetensors, 248 bytes, rank 0"), std::string::npos) << show;
}

// The Learner under torchrun: learner_child (auto_resume every 10 steps and at epoch ends,
// model_checkpoint, early stopping, an LR scheduler, metrics and validation) on 2 processes,
// one of them SIGKILLed mid-epoch, at an epoch end before or after the save, or inside a save
// (twice with the callbacks saving in the background), and the pair restarted by torchrun: each run ends with the uninterrupted pair's final
// checkpoint (model, optimizer, counters, records), bit for bit, and every step's loss on both
// ranks is the uninterrupted run's.
TEST(DistributedLearner, KilledAndRestartedByTorchrunEndsLikeTheUninterruptedRun) {
  tt::TempDir dir;
  auto fit = [&](const std::string& sub, const std::string& kill, int max_restarts,
                 const std::string& saves = "sync") {
    std::string d = dir.path() + "/" + sub;
    std::filesystem::create_directories(d);
    std::string out = d + "/out";
    int status = std::system(
        fmt::format("{} -m torch.distributed.run --standalone --nproc-per-node 2 --max-restarts {} "
                    "--monitor-interval 0.1 --no-python {} {} {}/log {} {} > {} 2>&1",
                    tt::python(), max_restarts, LEARNER_CHILD, d, d, kill, saves, out)
            .c_str());
    EXPECT_EQ(status, 0) << tt::read_bytes(out);
    std::vector<tt::ChildLog> logs;
    for (int r = 0; r < 2; ++r) logs.push_back(tt::read_child_log(fmt::format("{}/log.{}", d, r)));
    return logs;
  };
  std::vector<tt::ChildLog> reference = fit("reference", "none", 0);
  ASSERT_EQ(reference[0].count("done"), 1u);
  ASSERT_EQ(reference[1].count("done"), 1u);
  const long ops = std::stol(reference[0].last("ops"));
  // The last two save in the background (auto_resume and model_checkpoint with async(true)):
  // the same files, so the same outcome.
  for (const std::string& run :
       {std::string("rank:1:batch:3:4"), std::string("rank:0:batch:2:7"),
        std::string("rank:0:after_save:2"), std::string("rank:1:before_save:4"),
        fmt::format("rank:0:op:{}", ops / 3), fmt::format("rank:0:op:{}", ops * 2 / 3),
        std::string("rank:1:batch:3:4 async"), fmt::format("rank:0:op:{} async", ops / 2)}) {
    SCOPED_TRACE(run);
    const std::string kill = run.substr(0, run.find(' '));
    const std::string saves = run.find(" async") != std::string::npos ? "async" : "sync";
    std::string sub = run;
    std::replace(sub.begin(), sub.end(), ':', '_');
    std::replace(sub.begin(), sub.end(), ' ', '_');
    std::vector<tt::ChildLog> logs = fit(sub, kill, 1, saves);
    EXPECT_EQ(logs[0].count("resumed"), 1u);
    for (int r = 0; r < 2; ++r) {
      EXPECT_EQ(logs[r].count("done"), 1u);
      for (const auto& [step, value] : logs[r].steps) {
        auto expected = reference[r].steps.find(step);
        ASSERT_NE(expected, reference[r].steps.end()) << "rank " << r << " step " << step;
        EXPECT_EQ(value, expected->second) << "rank " << r << " step " << step;
      }
    }
    std::string out = dir.path() + "/diff.out";
    int status =
        std::system(fmt::format("{} diff {}/reference/final.ckpt {}/{}/final.ckpt > {} 2>&1",
                                TORCHPOINT_CLI, dir.path(), dir.path(), sub, out)
                        .c_str());
    EXPECT_EQ(status, 0) << tt::read_bytes(out);
    // auto_resume removed its file when the fit completed.
    EXPECT_FALSE(std::filesystem::exists(dir.path() + "/" + sub + "/state.ckpt"));
  }
}

// A fit of 2 processes killed (no restart) after step 44, the middle of epoch 3 (16 steps of 2 x
// 32 samples per epoch of 1000), resumed from auto_resume's save at step 40 (512 samples of the
// epoch consumed) by 1 and by 3 processes: the epoch continues from sample 512 of its order, so
// one process trains ceil(488 / 32) = 16 more steps in it, three ceil(488 / 96) = 6, then whole
// epochs of 32 and 11 steps. The first step after the resume trains, on the process of rank 0,
// the samples rank 0 trained in the 2-process run's step 41, from the same model: the same loss.
TEST(DistributedLearner, ResumesOnAnotherNumberOfProcessesWhereTheEpochStood) {
  tt::TempDir dir;
  auto fit = [&](const std::string& log, int processes, const std::string& kill) {
    std::string out = dir.path() + "/" + log + ".out";
    std::string child =
        fmt::format("{} {} {}/{} {} sync", LEARNER_CHILD, dir.path(), dir.path(), log, kill);
    std::string command = processes == 1
                              ? child
                              : fmt::format(
                                    "{} -m torch.distributed.run --standalone --nproc-per-node {} "
                                    "--max-restarts 0 --monitor-interval 0.1 --no-python {}",
                                    tt::python(), processes, child);
    return std::system((command + " > " + out + " 2>&1").c_str());
  };
  ASSERT_NE(fit("pair", 2, "rank:1:batch:3:12"), 0);
  const std::string saved = dir.path() + "/saved.ckpt";
  std::filesystem::copy_file(dir.path() + "/state.ckpt", saved);
  tt::ChildLog pair = tt::read_child_log(dir.path() + "/pair.0");
  ASSERT_EQ(pair.steps.count(41), 1u);

  for (int processes : {1, 3}) {
    SCOPED_TRACE(fmt::format("{} process(es)", processes));
    std::filesystem::remove_all(dir.path() + "/ckpts");
    std::filesystem::copy_file(saved, dir.path() + "/state.ckpt",
                               std::filesystem::copy_options::overwrite_existing);
    const std::string log = fmt::format("on{}", processes);
    ASSERT_EQ(fit(log, processes, "none"), 0) << tt::read_bytes(dir.path() + "/" + log + ".out");
    const std::string rank0 = processes == 1 ? log : log + ".0";
    tt::ChildLog resumed = tt::read_child_log(dir.path() + "/" + rank0);
    EXPECT_EQ(resumed.count("resumed"), 1u);
    EXPECT_EQ(resumed.count("done"), 1u);
    const long per_epoch = processes == 1 ? 32 : 11, rest_of_epoch = processes == 1 ? 16 : 6;
    ASSERT_FALSE(resumed.steps.empty());
    EXPECT_EQ(resumed.steps.begin()->first, 41);
    EXPECT_EQ(resumed.steps.rbegin()->first, 40 + rest_of_epoch + 3 * per_epoch);
    EXPECT_EQ(resumed.steps.size(), static_cast<std::size_t>(rest_of_epoch + 3 * per_epoch));
    EXPECT_EQ(resumed.steps.find(41)->second, pair.steps.find(41)->second);
  }
}
