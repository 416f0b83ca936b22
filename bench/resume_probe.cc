// torchpoint_resume_probe: one cold load of a 256 MiB model (S1's 16 tensors of 16 MiB) in a
// process of its own, as a resume after a preemption does it: the process starts, builds its
// model (randn: memory it has touched), then loads. torchpoint_bench times many loads in one
// process, into memory that earlier cases recycled; here every load meets whatever memory a new
// process gets. bench/resume.sh runs the modes in turns and prints their medians.
//
//   torchpoint_resume_probe write DIR      the checkpoint and a raw copy of the same bytes
//   torchpoint_resume_probe MODE DIR [S]   one cold load, S seconds after dropping the files
//                                          from the page cache (default 0), MODE one of
//     into   torchpoint::load_file_into into the model (what load_state does)
//     load   torchpoint::load_file into new tensors
//     pread  a pread of the raw copy straight into the model's tensors, nothing verified
// Prints one JSON object: mode, seconds, cpu_seconds, minor_faults.
#include <fcntl.h>
#include <sys/resource.h>
#include <torch/torch.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>

#include "torchpoint/tensor_file.h"

namespace {

[[noreturn]] void fail(const std::string& what) {
  throw std::system_error(errno, std::generic_category(), what);
}

void drop_page_cache(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("open " + path);
  if (::fdatasync(fd) != 0) fail("fdatasync " + path);
  if (::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) != 0) fail("posix_fadvise " + path);
  ::close(fd);
}

struct Usage {
  double cpu = 0;
  long minor_faults = 0;
};

Usage usage() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  auto s = [](const timeval& t) { return static_cast<double>(t.tv_sec) + 1e-6 * t.tv_usec; };
  return {s(u.ru_utime) + s(u.ru_stime), u.ru_minflt};
}

int run(int argc, char** argv) {
  if (argc < 3) throw std::invalid_argument("usage: torchpoint_resume_probe MODE DIR [SECONDS]");
  const std::string mode = argv[1];
  const std::string dir = argv[2];
  const std::string file = dir + "/resume.safetensors";
  const std::string raw = dir + "/resume.raw";
  torch::manual_seed(0);
  torchpoint::NamedTensors model;
  for (int i = 0; i < 16; ++i) model.emplace_back("t" + std::to_string(i), torch::randn({4 << 20}));
  if (mode == "write") {
    torchpoint::save_file(file, torchpoint::Container{model});
    int fd = ::open(raw.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0) fail("open " + raw);
    for (const auto& [name, t] : model) {
      if (::write(fd, t.data_ptr(), t.nbytes()) != static_cast<ssize_t>(t.nbytes())) {
        fail("write " + raw);
      }
    }
    if (::fsync(fd) != 0) fail("fsync " + raw);
    ::close(fd);
    return 0;
  }
  if (mode != "into" && mode != "load" && mode != "pread") {
    throw std::invalid_argument("unknown mode '" + mode + "' (write, into, load or pread)");
  }
  drop_page_cache(file);
  drop_page_cache(raw);
  if (argc > 3) std::this_thread::sleep_for(std::chrono::duration<double>(std::atof(argv[3])));
  const Usage before = usage();
  const auto start = std::chrono::steady_clock::now();
  if (mode == "into") {
    torchpoint::load_file_into(file, model);
  } else if (mode == "load") {
    torchpoint::Container loaded = torchpoint::load_file(file);
    if (loaded.tensors.size() != model.size()) throw std::logic_error("load_file lost tensors");
  } else {
    int fd = ::open(raw.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) fail("open " + raw);
    off_t offset = 0;
    for (const auto& [name, t] : model) {
      auto* to = static_cast<char*>(t.data_ptr());
      for (std::size_t done = 0; done < t.nbytes();) {
        ssize_t n = ::pread(fd, to + done, t.nbytes() - done, offset + static_cast<off_t>(done));
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) fail("pread " + raw);
        done += static_cast<std::size_t>(n);
      }
      offset += static_cast<off_t>(t.nbytes());
    }
    ::close(fd);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const Usage after = usage();
  std::printf("{\"mode\":\"%s\",\"seconds\":%.4f,\"cpu_seconds\":%.4f,\"minor_faults\":%ld}\n",
              mode.c_str(), seconds, after.cpu - before.cpu,
              after.minor_faults - before.minor_faults);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torchpoint_resume_probe: %s\n", e.what());
    return 1;
  }
}
