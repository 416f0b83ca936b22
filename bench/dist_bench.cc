// torchpoint_dist_bench: times Accelerator::save_state and load_state of the benchmark's state S2
// (a transformer-like model and its Adam state) on as many processes as it is started on: alone,
// it is one process; under torchrun, every process runs it and they save and load together. The
// main process writes the model and optimizer once, every process its own RNG file, so a save
// on two processes should cost about what it costs on one. bench/dist.sh runs it both ways and
// prints the ratio. It is a measurement, not a test: nothing is asserted.
//
//   torchpoint_dist_bench --dir PATH [--reps N] [--hot] [--quick] [--json] [--independent]
//
// Every timed operation starts after a barrier and ends when the slowest process returns (the
// time reported is the maximum over the processes). Loads are cold: the checkpoint's pages are
// dropped from the page cache first. PATH must be the same directory for every process; the
// benchmark empties it. With --independent (under torchrun), every process saves and loads a
// checkpoint of its own, alone, in PATH/rank_<r>, timed between the same barriers: what so many
// processes doing the same work at once cost the machine, with no coordination.
#include <fcntl.h>
#include <sys/resource.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <system_error>
#include <vector>

#include "s2_model.h"
#include "torchpoint/accelerator.h"
#include "torchpoint/process_group.h"
#include "torchpoint/tensor_file.h"

namespace {

namespace fs = std::filesystem;
namespace tp = torchpoint;
using Clock = std::chrono::steady_clock;

struct Options {
  std::string dir;
  int reps = 5;
  bool quick = false;
  bool json = false;
  bool hot = false;          // loads from the page cache, not the disk
  bool independent = false;  // each process saves and loads alone, at the same time
  int zero_stage = 0;        // Accelerator::set_zero_stage
  std::string load_from;     // only cold loads of this checkpoint (saved by another run)
};

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
      return argv[++i];
    };
    if (arg == "--dir") {
      o.dir = value();
    } else if (arg == "--reps") {
      o.reps = std::stoi(value());
      if (o.reps < 1) throw std::invalid_argument("--reps must be at least 1");
    } else if (arg == "--quick") {
      o.quick = true;
    } else if (arg == "--independent") {
      o.independent = true;
    } else if (arg == "--hot") {
      o.hot = true;
    } else if (arg == "--json") {
      o.json = true;
    } else if (arg == "--zero-stage") {
      o.zero_stage = std::stoi(value());
    } else if (arg == "--load-from") {
      o.load_from = value();
    } else {
      throw std::invalid_argument("unknown argument '" + arg + "'");
    }
  }
  if (o.dir.empty()) throw std::invalid_argument("--dir PATH is required");
  return o;
}

// Drops the pages of every file under `dir` from the page cache, so the next load reads the disk.
void evict(const fs::path& dir) {
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    int fd = ::open(entry.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0)
      throw std::system_error(errno, std::generic_category(), "open " + entry.path().string());
    int rc = ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
    if (rc != 0) {
      throw std::system_error(rc, std::generic_category(),
                              "posix_fadvise " + entry.path().string());
    }
  }
}

std::uint64_t directory_bytes(const fs::path& dir) {
  std::uint64_t total = 0;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    if (entry.is_regular_file()) total += entry.file_size();
  }
  return total;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Runs `op` on every process between a barrier and its return; the slowest process's seconds.
template <typename F>
double timed(tp::ProcessGroup* group, F&& op) {
  if (group) group->barrier("the start of a timed operation");
  const auto start = Clock::now();
  op();
  double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (group) {
    for (const at::Tensor& t : group->allgather(torch::tensor({seconds}, torch::kFloat64))) {
      seconds = std::max(seconds, t.item<double>());
    }
  }
  return seconds;
}

// Keeps only the newest checkpoint, so the disk holds one state between timed saves.
void remove_older_checkpoints(const fs::path& checkpoints, const std::string& newest) {
  for (const auto& entry : fs::directory_iterator(checkpoints)) {
    if (entry.path() != fs::path(newest)) fs::remove_all(entry.path());
  }
}

// The values of every process, in rank order (one value when alone).
std::vector<std::uint64_t> per_rank(tp::ProcessGroup* group, std::uint64_t mine) {
  if (group == nullptr) return {mine};
  std::vector<std::uint64_t> out;
  for (const at::Tensor& t :
       group->allgather(torch::tensor({static_cast<std::int64_t>(mine)}, torch::kInt64))) {
    out.push_back(static_cast<std::uint64_t>(t.item<std::int64_t>()));
  }
  return out;
}

// The CPU time this process has used (every thread, user and system), in microseconds.
std::uint64_t cpu_microseconds() {
  rusage usage{};
  ::getrusage(RUSAGE_SELF, &usage);
  auto us = [](const timeval& t) {
    return static_cast<std::uint64_t>(t.tv_sec) * 1000000 + static_cast<std::uint64_t>(t.tv_usec);
  };
  return us(usage.ru_utime) + us(usage.ru_stime);
}

// Element-wise maximum over the repetitions of each rank's value.
void keep_max(std::vector<std::uint64_t>& into, const std::vector<std::uint64_t>& values) {
  if (into.empty()) into.assign(values.size(), 0);
  for (std::size_t i = 0; i < values.size(); ++i) into[i] = std::max(into[i], values[i]);
}

int run(const Options& o) {
  // The processes timed together: torchrun's (null when alone). With --independent, each of them
  // saves and loads alone, through an Accelerator of its own in a directory of its own.
  std::shared_ptr<tp::ProcessGroup> group = tp::ProcessGroup::from_environment();
  const int rank = group ? group->rank() : 0;
  const int processes = group ? group->size() : 1;
  const std::string dir = o.independent ? fmt::format("{}/rank_{}", o.dir, rank) : o.dir;
  tp::Accelerator accelerator(
      tp::ProjectConfiguration().project_dir(dir).automatic_checkpoint_naming(true),
      tp::Env::posix(), o.independent ? nullptr : group);
  const bool owner = accelerator.is_main_process();  // empties, prunes and evicts `dir`
  if (owner && o.load_from.empty()) fs::remove_all(fs::path(dir) / "checkpoints");
  if (group) group->barrier("the benchmark's start");

  torch::manual_seed(0);
  tp::bench::S2Model s2 = tp::bench::make_s2_model(o.quick);
  accelerator.set_zero_stage(o.zero_stage);
  auto [model, optimizer] = accelerator.prepare(s2.model, *s2.adam);
  (void)model;
  if (o.zero_stage != 0) {
    // ZeRO keeps its own state, which make_s2_model's steps did not reach: three steps of
    // random gradients (the same on every process) through the Accelerator, as training takes.
    for (int step = 0; step < 3; ++step) {
      optimizer.zero_grad();
      at::Tensor loss = torch::zeros({});
      for (const at::Tensor& p : s2.model->parameters()) {
        loss = loss + (p * torch::randn_like(p)).sum();
      }
      accelerator.backward(loss);
      optimizer.step();
    }
  }
  tp::ProcessGroup* timing = o.independent ? nullptr : group.get();
  auto store_requests = [&] { return group ? group->store_requests() : std::uint64_t{0}; };

  std::vector<double> save_seconds, load_seconds, auto_seconds, verify_first_seconds;
  std::vector<std::uint64_t> written, read, save_messages, load_messages;
  std::vector<std::vector<double>> load_cpu;  // by rank, each repetition's CPU seconds
  std::string newest = o.load_from;
  int saved_processes = 0;
  if (o.load_from.empty()) {
    // One untimed save first: the first write of a process pays for faulting in its buffers.
    newest = accelerator.save_state();
  }
  for (int rep = 0; rep < o.reps; ++rep) {
    if (o.load_from.empty()) {
      if (owner) remove_older_checkpoints(fs::path(dir) / "checkpoints", newest);
      const std::uint64_t before = store_requests();
      save_seconds.push_back(timed(group.get(), [&] { newest = accelerator.save_state(); }));
      keep_max(save_messages, per_rank(timing, store_requests() - before));
      keep_max(written, per_rank(timing, accelerator.last_save_bytes_written()));
      if (owner) remove_older_checkpoints(fs::path(dir) / "checkpoints", newest);
    }
    if (owner && !o.hot) evict(newest);
    tp::LoadStateReport report;
    const std::uint64_t before = store_requests();
    const std::uint64_t cpu_before = cpu_microseconds();
    load_seconds.push_back(timed(group.get(), [&] { report = accelerator.load_state(newest); }));
    const std::vector<std::uint64_t> cpu = per_rank(timing, cpu_microseconds() - cpu_before);
    load_cpu.resize(cpu.size());
    for (std::size_t r = 0; r < cpu.size(); ++r) load_cpu[r].push_back(1e-6 * cpu[r]);
    keep_max(load_messages, per_rank(timing, store_requests() - before));
    keep_max(read, per_rank(timing, report.bytes_read));
    saved_processes = report.saved_world_size;
    if (o.load_from.empty()) {
      // load_state() with the automatic choice, as a resume calls it; on one process also what
      // that cost while the choice verified the newest checkpoint before reading it again.
      if (owner && !o.hot) evict(newest);
      auto_seconds.push_back(timed(group.get(), [&] { accelerator.load_state(); }));
      if (processes == 1) {
        if (owner && !o.hot) evict(newest);
        verify_first_seconds.push_back(timed(group.get(), [&] {
          if (!tp::verify(newest).ok()) throw std::runtime_error(newest + " does not verify");
          accelerator.load_state(newest);
        }));
      }
    }
  }
  // The machine's share of the work: every process copies as many bytes as the checkpoint holds,
  // at the same time, between the same barriers; on one process this is the copy a load must at
  // least make, and how it grows with the processes is what the memory allows them together.
  std::vector<double> memcpy_seconds;
  if (o.load_from.empty()) {
    const std::size_t n = static_cast<std::size_t>(directory_bytes(newest));
    std::vector<std::uint8_t> from(n, 1), to(n, 0);  // both faulted in before timing
    for (int rep = 0; rep < o.reps; ++rep) {
      memcpy_seconds.push_back(timed(group.get(), [&] { std::memcpy(to.data(), from.data(), n); }));
      if (to[n / 2] != 1) throw std::logic_error("memcpy copied nothing");
    }
  }
  // The floor of a load on this many processes: each reads every file of the checkpoint, cold,
  // into memory of its own, at the same time (the page cache reads the disk once for all of
  // them; each process still copies every byte). Nothing verified, nothing restored.
  std::vector<double> pread_seconds;
  if (o.load_from.empty() && !o.independent) {
    std::vector<std::pair<std::string, std::vector<std::uint8_t>>> files;
    for (const auto& entry : fs::recursive_directory_iterator(newest)) {
      if (!entry.is_regular_file()) continue;
      files.emplace_back(entry.path().string(), std::vector<std::uint8_t>(entry.file_size(), 0));
    }
    for (int rep = 0; rep < o.reps; ++rep) {
      if (owner && !o.hot) evict(newest);
      pread_seconds.push_back(timed(group.get(), [&] {
        for (auto& [path, buffer] : files) {
          int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
          if (fd < 0) throw std::system_error(errno, std::generic_category(), "open " + path);
          for (std::size_t done = 0; done < buffer.size();) {
            ssize_t n = ::pread(fd, buffer.data() + done, buffer.size() - done,
                                static_cast<off_t>(done));
            if (n < 0 && errno == EINTR) continue;
            if (n <= 0) throw std::system_error(errno, std::generic_category(), "pread " + path);
            done += static_cast<std::size_t>(n);
          }
          ::close(fd);
        }
      }));
    }
  }
  if (rank != 0) return 0;

  const std::uint64_t bytes = directory_bytes(newest);
  const std::string system = o.independent ? "independent" : "torchpoint";
  if (o.json) {
    auto line = [&](const std::string& op, const std::vector<double>& seconds) {
      nlohmann::json out = {{"state", "S2"},
                            {"op", op},
                            {"system", op == "memcpy" || op == "pread" ? op : system},
                            {"processes", processes},
                            {"stage", o.zero_stage},
                            {"seconds", median(seconds)},
                            {"bytes", bytes},
                            {"reps", o.reps},
                            {"cache", o.hot ? "hot" : "cold"}};
      if (op == "accelerator_save") {
        out["bytes_written_per_rank"] = written;
        out["store_messages"] = save_messages;
      } else if (op == "accelerator_load") {
        out["bytes_read_per_rank"] = read;
        // The CPU time of each process's load (median): what the processes of one machine ask
        // of its cores together, the floor of a load that is not waiting for the disk.
        std::vector<double> cpu;
        for (const std::vector<double>& rank_cpu : load_cpu) cpu.push_back(median(rank_cpu));
        out["cpu_seconds_per_rank"] = cpu;
        out["store_messages"] = load_messages;
        out["saved_processes"] = saved_processes;
      }
      std::printf("%s\n", out.dump().c_str());
    };
    if (!save_seconds.empty()) line("accelerator_save", save_seconds);
    line("accelerator_load", load_seconds);
    if (!auto_seconds.empty()) line("accelerator_load_automatic", auto_seconds);
    if (!verify_first_seconds.empty()) line("verify_then_load", verify_first_seconds);
    if (!memcpy_seconds.empty()) line("memcpy", memcpy_seconds);
    if (!pread_seconds.empty()) line("pread", pread_seconds);
  } else {
    fmt::print("S2: {}\n", s2.description);
    fmt::print("{} process(es){}, ZeRO stage {}, {} reps, checkpoint of {:.1f} MiB\n", processes,
               o.independent ? " each saving and loading alone" : "", o.zero_stage, o.reps,
               static_cast<double>(bytes) / (1024.0 * 1024.0));
    if (!save_seconds.empty()) {
      fmt::print("save_state  median {:.3f} s ({:.0f} MB/s), bytes written per rank {}\n",
                 median(save_seconds), static_cast<double>(bytes) / median(save_seconds) / 1e6,
                 fmt::join(written, " "));
    }
    fmt::print("load_state  median {:.3f} s ({}, {:.0f} MB/s), bytes read per rank {}\n",
               median(load_seconds), o.hot ? "hot" : "cold",
               static_cast<double>(bytes) / median(load_seconds) / 1e6, fmt::join(read, " "));
    if (!auto_seconds.empty()) {
      fmt::print("load_state() median {:.3f} s (the automatic choice of the newest checkpoint)\n",
                 median(auto_seconds));
    }
    if (!verify_first_seconds.empty()) {
      fmt::print("verify, load median {:.3f} s (verify() of the newest first, then load_state)\n",
                 median(verify_first_seconds));
    }
    if (!memcpy_seconds.empty()) {
      fmt::print("memcpy      median {:.3f} s (the same bytes, in every process at once)\n",
                 median(memcpy_seconds));
    }
    if (!pread_seconds.empty()) {
      fmt::print("pread       median {:.3f} s (every file, cold, in every process at once)\n",
                 median(pread_seconds));
    }
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torchpoint_dist_bench: %s\n", e.what());
    std::fprintf(stderr,
                 "usage: torchpoint_dist_bench --dir PATH [--reps N] [--hot] [--quick] [--json] "
                 "[--independent] [--zero-stage S] [--load-from CHECKPOINT]\n");
    return 1;
  }
}
