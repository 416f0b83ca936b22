#!/usr/bin/env bash
# One benchmark run of every system on the same machine at about the same time: the C++ side
# (bench/bench.cc: torchpoint, torch::save/load, raw POSIX I/O, O_DIRECT) and the Python peers
# (bench/peers.py: torch.save/load, safetensors, DCP, Accelerate) take turns on each state, one
# repetition each, for ROUNDS rounds: C++ then Python on odd rounds, Python then C++ on even ones,
# so that a change of the disk's speed during the run (this VM's varies 2x within a day) falls on
# both sides alike. Both sides drop a file from the page cache the same way before each cold load
# (fdatasync, then posix_fadvise(POSIX_FADV_DONTNEED) on every file of the checkpoint) and use
# recycled pages (as much new memory touched and freed, a same-size file written and unlinked,
# then sync, before each timed op). Each side runs one repetition per round, its order of the cases rotated by the round
# number (--rotate), so that no system is always the first of its process.
# Prints every JSON record (with "round") to OUT.jsonl and the table of medians with min-max over
# the rounds (bench/table.py) to OUT.md.
#   bench/interleaved.sh [--rounds R] [--states S1,S2,S3] [--out PREFIX] [--build DIR] [--quick]
# Needs a build (scripts/setup.sh torchpoint_bench) and the venv (scripts/venv.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=5 states=S1,S2,S3 out=build/interleaved build=build quick=()
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) rounds=$2; shift 2 ;;
    --states) states=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    --quick) quick=(--quick); shift ;;
    *) echo "bench/interleaved.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
python=$(scripts/venv.sh)
scratch=$(mktemp -d "${TMPDIR:-/tmp}/interleaved.XXXXXX")
trap 'rm -rf "$scratch"' EXIT
: >"$out.jsonl"
tag() {  # adds "round" and "side" to each JSON line of stdin
  "$python" -c '
import json, sys
for line in sys.stdin:
    if line.startswith("{"):
        row = json.loads(line)
        row["round"], row["side"] = int(sys.argv[1]), sys.argv[2]
        print(json.dumps(row), flush=True)
' "$@"
}
cpp() {
  "$build/bench/torchpoint_bench" --states "$1" --reps 1 --rotate "$2" --json --no-incremental \
    --dir "$scratch/cpp" "${quick[@]}" 2>>"$out.log" | tag "$2" cpp >>"$out.jsonl"
}
py() {
  "$python" bench/peers.py --states "$1" --reps 1 --rotate "$2" --json --dir "$scratch/py" "${quick[@]}" \
    2>>"$out.log" | tag "$2" python >>"$out.jsonl"
}
: >"$out.log"
for round in $(seq "$rounds"); do
  IFS=, read -ra list <<<"$states"
  for state in "${list[@]}"; do
    echo "interleaved: round $round/$rounds, $state" >&2
    if ((round % 2)); then cpp "$state" "$round"; py "$state" "$round"
    else py "$state" "$round"; cpp "$state" "$round"; fi
  done
done
"$python" bench/table.py "$out.jsonl" | tee "$out.md"
