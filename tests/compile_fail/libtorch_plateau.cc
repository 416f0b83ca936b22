// Must NOT compile: preparing LibTorch's ReduceLROnPlateauScheduler, whose state is private
// (checked by the CTest `libtorch_plateau_compile_error`, with LibTorch 2.1 or later).
#include <torch/optim/schedulers/reduce_on_plateau_scheduler.h>
#include <torch/torch.h>

#include "torchpoint/accelerator.h"

int main() {
  torchpoint::Accelerator accelerator;
  torch::nn::Linear model(2, 1);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::ReduceLROnPlateauScheduler scheduler(optimizer);
  accelerator.prepare(scheduler);
  return 0;
}
