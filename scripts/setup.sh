#!/usr/bin/env bash
# Installs what torchpoint needs on Debian 12 (only the packages that are missing) and the
# project venv (.venv: the pinned torch 2.13 wheel, safetensors, numpy), then configures and
# builds it in ./build. Safe to run again: it only redoes what changed.
#
# LibTorch: by default the C++ libraries of the venv's torch wheel (LibTorch 2.13). To build
# against another LibTorch (a pytorch.org zip, a source build), set Torch_DIR to the folder
# holding TorchConfig.cmake, or CMAKE_PREFIX_PATH to the LibTorch folder, before running.
# Compiler flags: -O2 -g1 -DNDEBUG; TORCHPOINT_CXX_FLAGS="-O2 -g -DNDEBUG" for full debug info.
# Compiler: clang++ (Debian's clang 14), or the one CXX names (CXX=g++ scripts/setup.sh; g++ 12
# builds it too). clang++ makes the precompiled header carry LibTorch's template instantiations,
# which g++ redoes in every translation unit: the same build from scratch took 305 s with clang++
# and 539 s with g++, one after the other (a 40-line test child: 3.6 s against 13 s).
# Unity build (CMake batches each target's sources into a few translation units): on by default,
# a build from scratch took a quarter less time (748 s, not 1016 s, with g++);
# TORCHPOINT_UNITY_BUILD=OFF when editing one file at a time, which then recompiles alone.
# Usage: scripts/setup.sh [cmake --build targets...]
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  clang g++ cmake ninja-build ccache python3 python3-venv
  nlohmann-json3-dev libxxhash-dev libsimdjson-dev libfmt-dev libcli11-dev libcairo2-dev pkgconf libboost-dev
  libgloo-dev
  googletest libgtest-dev libbenchmark-dev
)
scripts/ensure_packages.sh setup "${packages[@]}"
python=$(scripts/venv.sh)

# Debian's cmake: the one first on PATH may be a newer one from pip.
cmake=/usr/bin/cmake
torch_args=()
if [[ -n ${Torch_DIR:-} ]]; then
  torch_args=("-DTorch_DIR=$Torch_DIR")
elif [[ -z ${CMAKE_PREFIX_PATH:-} ]]; then
  torch_args=("-DTorch_DIR=$("$python" -c 'import torch.utils; print(torch.utils.cmake_prefix_path)')/Torch")
fi
# -g1 (line tables and function names: enough for perf and for a backtrace) instead of -g:
# LibTorch's templates make full debug info a third of each compile, and the build is most of CI.
# A tree configured with another compiler starts over: CMake would drop the cache itself, and with
# it every setting below (it then found Debian's LibTorch 1.13 and made no unity build).
cxx=$(command -v "${CXX:-clang++}")
if [[ -f build/CMakeCache.txt ]] && ! grep -qx "CMAKE_CXX_COMPILER:[A-Z]*=$cxx" build/CMakeCache.txt; then
  echo "setup: build/ was configured with another compiler; configuring it again for $cxx" >&2
  rm -rf build/CMakeCache.txt build/CMakeFiles
fi
"$cmake" -S . -B build -G Ninja "-DCMAKE_CXX_COMPILER=$cxx" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=${TORCHPOINT_CXX_FLAGS:--O2 -g1 -DNDEBUG}" \
  "-DCMAKE_UNITY_BUILD=${TORCHPOINT_UNITY_BUILD:-ON}" \
  "-DTORCHPOINT_PYTHON=$python" "${torch_args[@]}"
"$cmake" --build build ${1:+--target "$@"}
