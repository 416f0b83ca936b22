// What the two README loops (accelerate_resume.cc, accelerator_loop.cc) share around the code
// the README shows: the data, the command line and the per-batch output their test compares.
#pragma once

#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <string>

namespace readme_loop {

// Sample i is the number i.
struct Numbers : torch::data::datasets::Dataset<Numbers> {
  torch::data::Example<> get(std::size_t i) override {
    auto v = torch::full({1}, static_cast<float>(i));
    return {v, v * 0.25};
  }
  c10::optional<std::size_t> size() const override { return 50; }
};

// PROGRAM PROJECT_DIR [--kill-after-step N]; kill_after is -1 without the option. Exits with
// status 2 and a usage line when PROJECT_DIR is missing.
struct Args {
  std::string project;
  long kill_after = -1;
};
inline Args parse_args(int argc, char** argv, const char* program) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s PROJECT_DIR [--kill-after-step N]\n", program);
    std::exit(2);
  }
  Args args{argv[1]};
  if (argc >= 4 && std::string(argv[2]) == "--kill-after-step")
    args.kill_after = std::atol(argv[3]);
  return args;
}

// "batch <step>: <sample numbers>", flushed: what the test compares across runs.
inline void print_batch(long step, const torch::Tensor& data) {
  std::printf("batch %ld:", step);
  for (std::int64_t i = 0; i < data.size(0); ++i) {
    std::printf(" %d", static_cast<int>(data[i][0].item<float>()));
  }
  std::printf("\n");
  std::fflush(stdout);
}

}  // namespace readme_loop
