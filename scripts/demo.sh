#!/usr/bin/env bash
# Sets up, builds the examples and runs them: the main job of this repository.
#   1. torchpoint_demo: save a trained model and its Adam state, load into fresh objects,
#      continue bit for bit; what happens to a corrupt file and an existing checkpoint.
#   2. accelerate_example: the checkpointing example of Accelerate's guide (seed 000).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh torchpoint_demo accelerate_example
rm -rf build/demo-run
mkdir -p build/demo-run
echo "== torchpoint_demo"
./build/examples/torchpoint_demo build/demo-run
echo
echo "== accelerate_example (Accelerate's checkpointing guide, in C++)"
./build/examples/accelerate_example build/demo-run
