// Must NOT compile: preparing a LibTorch LR scheduler other than torch::optim::StepLR, whose
// own state torchpoint cannot read (checked by the CTest `libtorch_scheduler_compile_error`).
#include <torch/torch.h>

#include "torchpoint/accelerator.h"

struct HalvingScheduler : torch::optim::LRScheduler {
  using torch::optim::LRScheduler::LRScheduler;
  std::vector<double> get_lrs() override { return {0.5}; }
};

int main() {
  torchpoint::Accelerator accelerator;
  torch::nn::Linear model(2, 1);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  HalvingScheduler scheduler(optimizer);
  accelerator.prepare(scheduler);
  return 0;
}
