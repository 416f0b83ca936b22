#!/usr/bin/env bash
# Sets up, builds everything and runs the whole test suite with CTest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
/usr/bin/ctest --test-dir build --output-on-failure --timeout 900 -j "$(nproc)"
