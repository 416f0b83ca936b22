#!/usr/bin/env bash
# Runs dist_child (tests/dist_child.cc) as 2 processes without torchrun, rank 0 serving the
# TCPStore: the LibTorch 1.13 leg (scripts/sanitize.sh), whose c10d cannot talk to the store of
# the venv's torchrun (2.13). Checks that both ranks step identically, and that a pair stopped
# after step 8's save and started again ends with the uninterrupted pair's state.
# Usage: tests/run_pair.sh DIST_CHILD WORK_DIR
set -euo pipefail
child=$1
dir=$2
rm -rf "$dir"
mkdir -p "$dir"

# run_pair NAME PLAN: both ranks of one run; fails when either rank fails.
run_pair() {
  local name=$1 plan=$2 port=$((20000 + RANDOM % 9000)) pids=() r
  for r in 0 1; do
    WORLD_SIZE=2 RANK=$r LOCAL_RANK=$r LOCAL_WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 \
      MASTER_PORT=$port TORCHPOINT_PROCESS_TIMEOUT=120 \
      "$child" "$dir/$name" "$dir/$name.log" "$plan" 16 >>"$dir/$name.out.$r" 2>&1 &
    pids+=($!)
  done
  for r in 0 1; do
    if ! wait "${pids[$r]}"; then
      echo "run_pair: rank $r of $name ($plan) failed:"
      tail -n 20 "$dir/$name.out.$r"
      return 1
    fi
  done
}

run_pair whole none
cmp <(grep '^step' "$dir/whole.log.0") <(grep '^step' "$dir/whole.log.1")
steps=$(grep -c '^step' "$dir/whole.log.0")
[[ $steps == 18 ]] || { echo "run_pair: $steps steps, not 18"; exit 1; }

run_pair resumed stop:step:8
run_pair resumed none
grep -q '^resumed ' "$dir/resumed.log.0"
for r in 0 1; do
  cmp <(grep '^final' "$dir/whole.log.$r") <(grep '^final' "$dir/resumed.log.$r")
done
echo "run_pair: 2 processes, $steps identical steps; stopped after step 8 and resumed: the same" \
  "final state on both ranks"
