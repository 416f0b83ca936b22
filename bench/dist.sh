#!/usr/bin/env bash
# The multi-process benchmark: save_state and load_state of S2 on 1 process and on N processes
# under torchrun (default 2), alternating, ROUNDS times each; prints the JSON lines of every run
# and the ratio of the medians (N processes / 1 process).
#   bench/dist.sh [--processes N] [--rounds R] [--reps K] [--dir PATH] [--build DIR] [--quick]
#   bench/dist.sh --zero [--rounds R] [--reps K] [--dir PATH] [--build DIR] [--quick]
# Needs a build (scripts/setup.sh torchpoint_dist_bench, in ./build by default) and the venv
# (scripts/venv.sh). Also runs N processes that each save and load a checkpoint of their own at
# the same time ("independent": what the machine charges for N processes doing that work at once,
# with no coordination), and prints memcpy of the checkpoint's bytes in every process at once: how
# the machine's memory serves several processes; and a cold pread of every file of the checkpoint
# in every process at once, the floor of a load on that many processes (the disk read once, each
# process copying every byte).
#
# --zero: the sharded training state of issue 40. S2 with Adam on 1, 2 and 4 processes at ZeRO
# stages 0, 1 and 2, torchpoint's save_state/load_state against torch.distributed.checkpoint
# (bench/dcp_zero.py: the venv's torch on as many gloo processes, the moments sharded the same
# way), in rotation each round; then loads onto another number of processes (saved on 4 at
# stage 1, loaded on 2 at stage 2; saved on 2 at stage 2, loaded on 4 at stage 1) next to loads
# onto the number that saved. JSON records (system, op, processes, stage, seconds,
# bytes_written_per_rank, bytes_read_per_rank, store_messages), then a table of medians.
set -euo pipefail
cd "$(dirname "$0")/.."
processes=2 rounds=3 reps=3 dir=build/dist-bench build=build quick=() zero=0
while [ $# -gt 0 ]; do
  case "$1" in
    --zero) zero=1; shift ;;
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
quiet() { grep -v '^\*\|OMP_NUM_THREADS' >&2; }
torchrun() {
  local n=$1
  shift
  "$python" -m torch.distributed.run --standalone --nproc-per-node "$n" --monitor-interval 0.1 \
    "$@" 2> >(quiet)
}

if ((zero)); then
  rm -rf "$dir" && mkdir -p "$dir"
  for round in $(seq "$rounds"); do
    for n in 1 2 4; do
      for stage in 0 1 2; do
        torchrun "$n" --no-python "$bench" --dir "$dir/tp" --reps "$reps" --json \
          --zero-stage "$stage" "${quick[@]}" | grep -v -e '"memcpy"' -e '"pread"' | tee -a "$out"
        if [[ $n == 4 && $stage == 1 ]] || [[ $n == 2 && $stage == 2 ]]; then
          rm -rf "$dir/tp_saved_${n}_$stage"
          mv "$(ls -d "$dir"/tp/checkpoints/checkpoint_* | sort -V | tail -n 1)" \
            "$dir/tp_saved_${n}_$stage"
        fi
        torchrun "$n" bench/dcp_zero.py --dir "$dir/dcp" --reps "$reps" --stage "$stage" \
          "${quick[@]}" | tee -a "$out"
        if [[ $n == 4 && $stage == 1 ]] || [[ $n == 2 && $stage == 2 ]]; then
          rm -rf "$dir/dcp_saved_${n}_$stage"
          mv "$dir/dcp/dcp_last" "$dir/dcp_saved_${n}_$stage"
        fi
      done
    done
    # Loads onto another number of processes and stage.
    for move in "4 1 2 2" "2 2 4 1"; do
      read -r from from_stage to to_stage <<<"$move"
      torchrun "$to" --no-python "$bench" --dir "$dir/tp" --reps "$reps" --json \
        --zero-stage "$to_stage" --load-from "$dir/tp_saved_${from}_$from_stage" "${quick[@]}" |
        tee -a "$out"
      torchrun "$to" bench/dcp_zero.py --dir "$dir/dcp" --reps "$reps" --stage "$to_stage" \
        --load-from "$dir/dcp_saved_${from}_$from_stage" "${quick[@]}" | tee -a "$out"
    done
  done
  rm -rf "$dir"
  "$python" - "$out" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.startswith("{")]
def pick(system, op, n, stage, saved=None):
    return [r for r in rows if r["system"] == system and r["op"].endswith(op) and
            r["processes"] == n and r["stage"] == stage and
            (saved is None or r.get("saved_processes", n) == saved)]
def med(rs):
    return statistics.median(r["seconds"] for r in rs) if rs else float("nan")
def worst_share(rs, key):
    # The largest share of the checkpoint's bytes one rank wrote or read, over the rounds.
    shares = []
    for r in rs:
        values = r.get(key) or []
        total = sum(values) if key == "bytes_written_per_rank" else None
        if values and total:
            shares.append(max(values) / total)
    return max(shares) if shares else float("nan")
print("S2 with Adam, medians over the rounds (seconds); tp = torchpoint, dcp = "
      "torch.distributed.checkpoint")
print(f"{'procs':>5} {'stage':>5} {'tp save':>8} {'dcp save':>8} {'ratio':>6} {'tp load':>8} "
      f"{'dcp load':>8} {'ratio':>6} {'tp max write share':>18} {'dcp':>6} {'tp msgs/rank':>12}")
for n in (1, 2, 4):
    for stage in (0, 1, 2):
        ts, ds = pick("torchpoint", "save", n, stage), pick("dcp", "save", n, stage)
        tl, dl = pick("torchpoint", "load", n, stage, n), pick("dcp", "load", n, stage, n)
        msgs = max((max(r["store_messages"]) for r in ts), default=0)
        print(f"{n:>5} {stage:>5} {med(ts):8.3f} {med(ds):8.3f} {med(ts) / med(ds):6.2f} "
              f"{med(tl):8.3f} {med(dl):8.3f} {med(tl) / med(dl):6.2f} "
              f"{worst_share(ts, 'bytes_written_per_rank'):18.3f} "
              f"{worst_share(ds, 'bytes_written_per_rank'):6.3f} {msgs:>12}")
for frm, fs, to, st in ((4, 1, 2, 2), (2, 2, 4, 1)):
    for system in ("torchpoint", "dcp"):
        other = med(pick(system, "load", to, st, frm))
        same = med(pick(system, "load", to, st, to))
        read = [r["bytes_read_per_rank"] for r in pick(system, "load", to, st, frm)]
        print(f"{system}: saved on {frm} at stage {fs}, loaded on {to} at stage {st}: "
              f"{other:.3f} s; saved on {to}: {same:.3f} s; ratio {other / same:.2f}; "
              f"bytes read per rank {read[-1] if read else []}")
PY
  exit 0
fi
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
for op in ("accelerator_save", "accelerator_load", "accelerator_load_automatic", "memcpy",
           "pread"):
    one = med(op, 1, ("torchpoint", "memcpy", "pread"))
    many = med(op, n, ("torchpoint", "memcpy", "pread"))
    line = f"S2 {op}: 1 process {one:.3f} s, {n} processes {many:.3f} s, ratio {many / one:.2f}"
    if op not in ("memcpy", "pread"):
        alone = med(op, n, ("independent",))
        line += f"; {n} processes each alone {alone:.3f} s ({alone / one:.2f})"
    print(line)
# What the automatic choice cost while it verified the newest checkpoint before reading it.
verify_first = med("verify_then_load", 1, ("torchpoint",))
automatic = med("accelerator_load_automatic", 1, ("torchpoint",))
print(f"S2 load_state() on 1 process: {automatic:.3f} s; verify() of the newest first, then "
      f"load_state(newest): {verify_first:.3f} s ({verify_first / automatic:.2f}x)")
# The cores' floor: the CPU time the processes' loads take together, spread over every core.
import os
def cpu(processes):
    return statistics.median(sum(r["cpu_seconds_per_rank"]) for r in rows
                             if r["op"] == "accelerator_load" and r["processes"] == processes
                             and r["system"] == "torchpoint" and "cpu_seconds_per_rank" in r)
cores = os.cpu_count()
one_wall = med("accelerator_load", 1, ("torchpoint",))
one_cpu, many_cpu = cpu(1), cpu(n)
print(f"S2 accelerator_load CPU time: 1 process {one_cpu:.3f} CPU-s ({one_cpu / one_wall:.2f} "
      f"cores busy), {n} processes {many_cpu:.3f} CPU-s together; on {cores} cores that takes at "
      f"least {many_cpu / cores:.3f} s, {many_cpu / cores / one_wall:.2f}x one process's load")
PY
