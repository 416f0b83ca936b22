#!/usr/bin/env bash
# Sets up, builds the examples and runs them: the main job of this repository.
#   1. torchpoint_demo: save a trained model and its Adam state, load into fresh objects,
#      continue bit for bit; what happens to a corrupt file and an existing checkpoint.
#   2. accelerate_example: the checkpointing example of Accelerate's guide (seed 000).
#   3. luz_example: the model-snapshot guide of luz (seed 004): auto_resume after an
#      interrupt, model_checkpoint, load_checkpoint, resume_from_checkpoint, callback state;
#      writes the plot of the records to build/demo-run/luz/auto_resume.png (and .svg) and
#      TensorBoard event files to build/demo-run/luz/logs.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh torchpoint_demo accelerate_example luz_example
rm -rf build/demo-run
mkdir -p build/demo-run
echo "== torchpoint_demo"
./build/examples/torchpoint_demo build/demo-run
echo
echo "== accelerate_example (Accelerate's checkpointing guide, in C++)"
./build/examples/accelerate_example build/demo-run
echo
echo "== luz_example (luz's guide to saving model snapshots, in C++)"
./build/examples/luz_example build/demo-run
