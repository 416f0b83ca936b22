// Must NOT compile: three misuses of the Accelerator, each in a function of its own, so that one
// compiler run reports all three (checked by the CTest `accelerator_compile_errors`, which
// expects each one's message; a run for each cost 25-35 s of CPU apiece in CI):
//   - preparing a LibTorch LR scheduler other than torch::optim::StepLR, whose own state
//     torchpoint cannot read;
//   - preparing LibTorch's ReduceLROnPlateauScheduler (LibTorch 2.1 and later), whose state is
//     private;
//   - register_for_checkpointing of an object without state_dict()/load_state_dict().
#include <torch/torch.h>

#include "torchpoint/accelerator.h"

#if __has_include(<torch/optim/schedulers/reduce_on_plateau_scheduler.h>)
#include <torch/optim/schedulers/reduce_on_plateau_scheduler.h>
#define TORCHPOINT_HAS_PLATEAU 1
#endif

struct HalvingScheduler : torch::optim::LRScheduler {
  using torch::optim::LRScheduler::LRScheduler;
  std::vector<double> get_lrs() override { return {0.5}; }
};

void prepare_a_libtorch_scheduler() {
  torchpoint::Accelerator accelerator;
  torch::nn::Linear model(2, 1);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  HalvingScheduler scheduler(optimizer);
  accelerator.prepare(scheduler);
}

#ifdef TORCHPOINT_HAS_PLATEAU
void prepare_libtorch_plateau() {
  torchpoint::Accelerator accelerator;
  torch::nn::Linear model(2, 1);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::ReduceLROnPlateauScheduler scheduler(optimizer);
  accelerator.prepare(scheduler);
}
#endif

struct NoState {
  int x = 0;
};

void register_an_object_without_state() {
  torchpoint::Accelerator accelerator;
  NoState object;
  accelerator.register_for_checkpointing(object);
}

int main() { return 0; }
