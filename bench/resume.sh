#!/usr/bin/env bash
# Cold loads of S1 (256 MiB) each in a process of its own, as a resume after a preemption does
# them: torchpoint's load into the model (load_file_into), its load into new tensors (load_file)
# and a pread of the same bytes straight into the model, nothing verified. The three take turns
# (their order rotating each round) for ROUNDS rounds, each one WAIT seconds after its files left
# the page cache (default 3: this VM hands memory free for ~2 s back to the host, as it is after
# a process that died and one that is starting). Prints each run's JSON, then medians and
# min-max.
#   bench/resume.sh [--rounds R] [--wait S] [--dir PATH] [--build DIR]
# Needs a build (scripts/setup.sh torchpoint_resume_probe, in ./build by default).
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=10 wait=3 dir=build/resume-bench build=build
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) rounds=$2; shift 2 ;;
    --wait) wait=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    --build) build=$2; shift 2 ;;
    *) echo "bench/resume.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
probe=$build/bench/torchpoint_resume_probe
rm -rf "$dir" && mkdir -p "$dir"
out=$(mktemp)
trap 'rm -f "$out"; rm -rf "$dir"' EXIT
"$probe" write "$dir"
modes=(into load pread)
for round in $(seq 0 $((rounds - 1))); do
  for k in 0 1 2; do
    "$probe" "${modes[$(((round + k) % 3))]}" "$dir" "$wait" | tee -a "$out"
  done
done
python3 - "$out" <<'PY'
import collections, json, statistics, sys
runs = collections.defaultdict(list)
for line in open(sys.argv[1]):
    row = json.loads(line)
    runs[row["mode"]].append(row)
pread = statistics.median(r["seconds"] for r in runs["pread"])
for mode in ("into", "load", "pread"):
    s = [r["seconds"] for r in runs[mode]]
    cpu = statistics.median(r["cpu_seconds"] for r in runs[mode])
    print(f"{mode:>5}: median {statistics.median(s):.3f} s ({statistics.median(s) / pread:.2f}x "
          f"pread), min-max {min(s):.3f}-{max(s):.3f} s, CPU {cpu:.3f} s, n={len(s)}")
PY
