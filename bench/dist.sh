#!/usr/bin/env bash
# The multi-process benchmark: save_state and load_state of S2 on 1 process and on N processes
# under torchrun (default 2), alternating, ROUNDS times each; prints the JSON lines of every run
# and the ratio of the medians (N processes / 1 process).
#   bench/dist.sh [--processes N] [--rounds R] [--reps K] [--dir PATH] [--build DIR] [--quick]
# Needs a build (scripts/setup.sh torchpoint_dist_bench, in ./build by default) and the venv
# (scripts/venv.sh). Also runs N processes that each save and load a checkpoint of their own at
# the same time ("independent": what the machine charges for N processes doing that work at once,
# with no coordination), and prints memcpy of the checkpoint's bytes in every process at once: how
# the machine's memory serves several processes.
set -euo pipefail
cd "$(dirname "$0")/.."
processes=2 rounds=3 reps=3 dir=build/dist-bench build=build quick=()
while [ $# -gt 0 ]; do
  case "$1" in
    --processes) processes=$2; shift 2 ;;
    --rounds) rounds=$2; shift 2 ;;
    --reps) reps=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --quick) quick=(--quick); shift ;;
    *) echo "bench/dist.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
bench=$build/bench/torchpoint_dist_bench
python=$(scripts/venv.sh)
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for round in $(seq "$rounds"); do
  "$bench" --dir "$dir" --reps "$reps" --json "${quick[@]}" | tee -a "$out"
  "$python" -m torch.distributed.run --standalone --nproc-per-node "$processes" \
    --monitor-interval 0.1 --no-python "$bench" --dir "$dir" --reps "$reps" --json "${quick[@]}" \
    2> >(grep -v '^\*\|OMP_NUM_THREADS' >&2) | tee -a "$out"
  # What the machine charges for that many processes doing the same work at once, alone.
  "$python" -m torch.distributed.run --standalone --nproc-per-node "$processes" \
    --monitor-interval 0.1 --no-python "$bench" --dir "$dir" --reps "$reps" --json "${quick[@]}" \
    --independent 2> >(grep -v '^\*\|OMP_NUM_THREADS' >&2) | tee -a "$out"
done
rm -rf "$dir"
"$python" - "$out" "$processes" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
n = int(sys.argv[2])
def med(op, processes, system):
    return statistics.median(r["seconds"] for r in rows if r["op"] == op and
                             r["processes"] == processes and r["system"] in system)
for op in ("accelerator_save", "accelerator_load", "memcpy"):
    one = med(op, 1, ("torchpoint", "memcpy"))
    many = med(op, n, ("torchpoint", "memcpy"))
    line = f"S2 {op}: 1 process {one:.3f} s, {n} processes {many:.3f} s, ratio {many / one:.2f}"
    if op != "memcpy":
        alone = med(op, n, ("independent",))
        line += f"; {n} processes each alone {alone:.3f} s ({alone / one:.2f})"
    print(line)
PY
