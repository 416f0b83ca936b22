#!/usr/bin/env bash
# Sets up, builds the demo and runs it: the main job of this repository.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh torchpoint_demo
rm -rf build/demo-run
mkdir -p build/demo-run
./build/examples/torchpoint_demo build/demo-run
