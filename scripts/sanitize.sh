#!/usr/bin/env bash
# The second CI leg: LibTorch 1.13 (Debian's libtorch-dev) with clang, AddressSanitizer and
# UndefinedBehaviorSanitizer, in ./build-san. One build tree serves both purposes: it proves
# that torchpoint still builds and passes against LibTorch 1.13 (library, CLI, the storage,
# state, Accelerator and Learner tests, the find_package consumer) and runs that code
# sanitized. Then it replays the committed fuzz inputs (tests/data/fuzz/<target>/) and fuzzes
# each parser for FUZZ_SECONDS (default 30) seconds. Any sanitizer report, crash, leak or
# failed test fails the script. Safe to run again. With --build-only it stops once built; with
# --packages-only once its Debian packages are installed (.ci/run does that while the first leg
# builds, so that the download and unpacking need not wait for the first leg's end).
# Usage: scripts/sanitize.sh [--build-only|--packages-only]   FUZZ_SECONDS=600 scripts/sanitize.sh
set -euo pipefail
cd "$(dirname "$0")/.."
fuzz_seconds=${FUZZ_SECONDS:-30}
build_only=false
packages_only=false
case ${1:-} in
  "") ;;
  --build-only) build_only=true ;;
  --packages-only) packages_only=true ;;
  *) echo "usage: scripts/sanitize.sh [--build-only|--packages-only]" >&2; exit 2 ;;
esac

# clang 14 is Debian 12's; libFuzzer and the sanitizer runtimes come in libclang-rt-14-dev and
# llvm-symbolizer (readable reports) in llvm-14.
packages=(
  clang libclang-rt-14-dev llvm-14 cmake ninja-build python3 python3-venv
  libtorch-dev nlohmann-json3-dev libxxhash-dev libsimdjson-dev libfmt-dev libcli11-dev libcairo2-dev pkgconf libboost-dev
  libgloo-dev
  googletest libgtest-dev
)
scripts/ensure_packages.sh sanitize --no-install-recommends "${packages[@]}"
if $packages_only; then
  exit 0
fi
# The tests' judges (torch 2.13, safetensors) run from the project venv whatever LibTorch the
# C++ side uses: files written under 1.13 are read by the Python of today.
python=$(scripts/venv.sh)

# -O1 keeps the sanitizers' slowdown small (at -O0 the fault tests take 4x longer and the
# fuzzers run 5x fewer inputs); line tables are enough for symbolized reports.
if [[ ! -f build-san/build.ninja ]]; then
  /usr/bin/cmake -S . -B build-san -G Ninja -DCMAKE_CXX_COMPILER=clang++ \
    -DCMAKE_BUILD_TYPE=RelWithDebInfo "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O1 -gline-tables-only" \
    "-DCMAKE_UNITY_BUILD=${TORCHPOINT_UNITY_BUILD:-ON}" \
    -DTorch_DIR=/usr/lib/x86_64-linux-gnu/cmake/Torch "-DTORCHPOINT_PYTHON=$python" \
    -DTORCHPOINT_SANITIZE=ON -DTORCHPOINT_BUILD_FUZZ=ON \
    -DTORCHPOINT_BUILD_BENCH=OFF -DTORCHPOINT_BUILD_EXAMPLES=OFF
fi

# The tests of every layer (crash_test also builds its child) and the CLI.
tests=(storage_test fault_test crash_test state_test interop_test retention_test accelerator_test
  learner_test)
fuzzers=(container_fuzz manifest_fuzz filename_fuzz torch_zip_fuzz)
/usr/bin/cmake --build build-san --target "${tests[@]}" "${fuzzers[@]}" torchpoint_cli dist_child
if $build_only; then
  exit 0
fi

# LibTorch is not instrumented: the only leak reported inside it is suppressed (see the file).
export ASAN_OPTIONS=strict_string_checks=1:check_initialization_order=1
export UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
export LSAN_OPTIONS=suppressions=$PWD/scripts/lsan.supp:print_suppressions=0
export ASAN_SYMBOLIZER_PATH=/usr/lib/llvm-14/bin/llvm-symbolizer
export TORCHPOINT_SOURCE_DIR=$PWD
logs=build-san/logs
rm -rf "$logs" && mkdir -p "$logs"

# run_all SLOTS "name|command"...: runs the jobs, SLOTS at a time, in the order given, and
# reports every failure (its log's end) and each job's time. Each job's output goes to
# $logs/<name>.log.
run_all() {
  local slots=$1
  shift
  local -A running=() started=()
  local name cmd pid failed=0
  while (($# > 0 || ${#running[@]} > 0)); do
    while (($# > 0 && ${#running[@]} < slots)); do
      IFS='|' read -r name cmd <<<"$1"
      shift
      bash -c "$cmd" >"$logs/$name.log" 2>&1 &
      running[$!]=$name
      started[$!]=$SECONDS
    done
    if wait -n -p pid; then
      echo "sanitize: ${running[$pid]} passed in $((SECONDS - started[$pid])) s"
      unset "running[$pid]"
      continue
    fi
    name=${running[$pid]}
    unset "running[$pid]"
    echo "sanitize: $name FAILED; the end of $logs/$name.log:"
    tail -n 60 "$logs/$name.log"
    failed=1
  done
  return $failed
}

# The fault sweep runs once per errno kind in the normal suite; under the sanitizers one
# transient and one persistent errno cover the same code. A sanitized child takes over a
# second to start, so the crash test kills 20 children instead of 100. Flipping each header
# byte in turn (117 s sanitized) is left to the normal suite: the container fuzzer below runs
# the same parser on more inputs under the sanitizers; so is the round trip of 100,000 JSON keys
# (33 s sanitized), whose code the manifest fuzzer and the smaller key tests run. fault_test, the
# longest, runs in three parts. The jobs run three at a time, the longest (in the last runs)
# first, so that neither core waits for a batch's slowest job.
start=$SECONDS
run_all 3 \
  "fault_test_incremental|build-san/tests/fault_test --gtest_filter=Incremental.*" \
  "fault_test_power_cuts|build-san/tests/fault_test --gtest_filter=PowerCuts.*" \
  "crash_test|TORCHPOINT_CRASH_KILLS=20 build-san/tests/crash_test" \
  "fault_test|build-san/tests/fault_test --gtest_filter=-*errno28*:*errno122*:*errno27*:PowerCuts.*:Incremental.*" \
  "state_test|build-san/tests/state_test && build-san/tests/interop_test && build-san/tests/retention_test" \
  "consumer|/usr/bin/ctest --test-dir build-san -R consumer_find_package --output-on-failure" \
  "learner_test|build-san/tests/learner_test" \
  "accelerator_test|build-san/tests/accelerator_test" \
  "storage_test|build-san/tests/storage_test --gtest_filter=-Container.EveryHeaderByteFlipIsDetected:OrderedJson.HundredThousandKeysRoundTripInOrder" \
  "dist_pair|tests/run_pair.sh build-san/tests/dist_child build-san/pair"
echo "sanitize: tests passed under ASan+UBSan (${tests[*]}, 2 processes on c10d) in" \
  "$((SECONDS - start)) s"

# Each fuzzer first runs every committed input, then mutates for fuzz_seconds. New inputs go to
# build-san/fuzz-corpus, crashes to build-san/fuzz-artifacts. One allocation over 64 MiB
# (inputs are at most a few KiB) counts as a crash: sizes taken from the input unchecked.
mkdir -p build-san/fuzz-artifacts
jobs=()
for f in "${fuzzers[@]}"; do
  corpus=build-san/fuzz-corpus/${f%_fuzz}
  mkdir -p "$corpus"
  jobs+=("$f|build-san/fuzz/$f -max_total_time=$fuzz_seconds -timeout=10 -rss_limit_mb=2048 \
-malloc_limit_mb=64 -print_final_stats=1 -artifact_prefix=build-san/fuzz-artifacts/$f- \
$corpus tests/data/fuzz/${f%_fuzz}")
done
start=$SECONDS
if ! run_all "${#jobs[@]}" "${jobs[@]}"; then
  echo "sanitize: a fuzzer found a bug; its input is in build-san/fuzz-artifacts/. Once fixed," \
    "add the input to tests/data/fuzz/<target>/ as a regression."
  exit 1
fi
for f in "${fuzzers[@]}"; do
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$logs/$f.log")
  echo "sanitize: $f: $runs inputs in ${fuzz_seconds} s, no crash"
done
echo "sanitize: fuzzing took $((SECONDS - start)) s"
