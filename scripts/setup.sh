#!/usr/bin/env bash
# Installs what torchpoint needs on Debian 12 (only the packages that are missing), then
# configures and builds it in ./build. Safe to run again: it only redoes what changed.
# Usage: scripts/setup.sh [cmake --build targets...]
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  g++ cmake ninja-build ccache python3 python3-torch
  libtorch-dev nlohmann-json3-dev libxxhash-dev libfmt-dev libcli11-dev
  googletest libgtest-dev libbenchmark-dev
)
scripts/ensure_packages.sh setup "${packages[@]}"

if [[ ! -f build/build.ninja ]]; then
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo
fi
cmake --build build ${1:+--target "$@"}
