// Checkpoints of Python's Hugging Face Accelerate: continue a Python run in C++, and back.
//
// Reading: Accelerator::load_state(dir) accepts a directory written by Python's
// accelerator.save_state() (see there). Writing: export_accelerate_checkpoint() turns a
// torchpoint checkpoint into a directory that Python's accelerator.load_state(dir) restores.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "torchpoint/env.h"
#include "torchpoint/error.h"

namespace torchpoint {

// Whether `dir` holds a checkpoint written by Python Accelerate's save_state: it has no
// torchpoint manifest and has random_states_0.pkl, which save_state always writes (and
// torchpoint never does: an uncommitted torchpoint checkpoint is not taken for one). Never
// throws for a missing directory (false).
bool is_accelerate_checkpoint(const std::string& dir, Env& env = Env::posix());

// What export_accelerate_checkpoint wrote.
struct AccelerateExport {
  std::vector<std::string> files;  // file names written, in order
  // What Accelerate has no place for (a data loader position, a registered C++ random engine,
  // a component of another name) and was not exported, or fills from elsewhere (Python's
  // random and NumPy states), one sentence each.
  std::vector<std::string> notes;
};

// Writes the torchpoint checkpoint `checkpoint_dir` (verified first, as load_state does) into
// the new directory `output_dir` in Accelerate's layout: model.safetensors, optimizer.bin,
// scheduler.bin, scaler.pt, custom_checkpoint_<i>.pkl and random_states_<rank>.pkl, every pickle within
// what torch.load(weights_only=True) accepts (plus the NumPy globals Accelerate allows for its
// RNG file). Python's accelerator.load_state(output_dir) then restores the model, optimizer
// (Adam, AdamW, SGD, RMSprop, Adagrad), scheduler (torchpoint's, which mirror PyTorch's, and
// torch::optim::StepLR; OneCycleLR's values go into the optimizer's param groups, where torch
// keeps them; the README's interop section has the mapping), the
// GradScaler, the custom objects' state dicts, the step and torch's CPU generator exactly. Python's random and
// NumPy generators, which a C++ run does not have, get MT19937 states seeded with the low 32
// bits of torch's seed.
//
// Every file is written, fsynced and then the directory renamed into place, so `output_dir`
// either holds the whole export or does not exist. Throws InvalidArgument when `output_dir`
// exists, Unsupported naming a component Accelerate cannot hold (an LBFGS optimizer, a
// torch::optim::StepLR saved before its options were recorded), and the errors of
// load_directory for the
// checkpoint.
//
// Example:
//   torchpoint::export_accelerate_checkpoint("runs/a/checkpoints/checkpoint_3", "to_python");
//   // Python: accelerator.load_state("to_python")
AccelerateExport export_accelerate_checkpoint(const std::string& checkpoint_dir,
                                              const std::string& output_dir,
                                              Env& env = Env::posix());

// One file of an Accelerate checkpoint, as `torchpoint show` lists it.
struct AccelerateFileView {
  std::string name;  // "optimizer.bin"
  // "model", "optimizer", "scheduler", "scaler", "custom", "random_states", "sampler",
  // "data loader" or "other"
  std::string kind;
  std::uint64_t size = 0;
  // What it holds, in one line: "AdamW, 1 param group, state for 4 parameters".
  std::string summary;
  // Every value, as (key path, description): "state.0.exp_avg" -> "float32 [8, 4]",
  // "param_groups.0.lr" -> "0.0025", "random_state.1" -> "625 ints" (long lists of numbers in
  // one line); at most 500, then one line saying how many more.
  std::vector<std::pair<std::string, std::string>> values;
  // Why the file could not be read whole (empty when it was), with the error's code.
  std::string problem;
  ErrorCode problem_code = ErrorCode::Corruption;
};

struct AccelerateView {
  std::string path;
  std::vector<AccelerateFileView> files;  // in name order
  std::int64_t step = -1;                 // from random_states_0.pkl; -1 when unknown
};

// Reads every file of the Accelerate checkpoint `dir` and checks what can be checked without
// Python: each safetensors file's structure (offsets, shapes, dtypes), each torch.save zip's
// records and their CRC-32s, and that each pickle uses only plain data (no Python global beyond
// tensors, NumPy arrays and the containers; none is ever called). A file that fails is kept
// with its `problem`, and the others are still read. Throws NotFound when `dir` is not an
// Accelerate checkpoint (is_accelerate_checkpoint).
AccelerateView inspect_accelerate_checkpoint(const std::string& dir, Env& env = Env::posix());

}  // namespace torchpoint
