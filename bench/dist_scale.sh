#!/usr/bin/env bash
# What one save_state() costs in coordination as the number of processes grows: dist_child (the
# tests' Accelerate loop: a small model, AdamW, a scheduler, a scaler, a sampler, a counter and a
# save hook) on 2, 4 and 8 processes under one torchrun agent, and on 16 processes as 4 agents
# ("nodes" on 127.0.0.2 .. 127.0.0.5) of 4. Every layout trains on the same global batches of
# 32 samples. Prints, per layout, the store requests one save makes on rank 0 and on the other
# ranks (median), the seconds rank 0 spends in them (waiting for the others included) and the
# whole save's seconds on rank 0, as medians over the run's saves.
#   bench/dist_scale.sh [--build DIR] [--dir PATH]
# Needs the tests' build (scripts/setup.sh dist_child) and the venv (scripts/venv.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
build=build dir=build/dist-scale
while [ $# -gt 0 ]; do
  case "$1" in
    --build) build=$2; shift 2 ;;
    --dir) dir=$2; shift 2 ;;
    *) echo "bench/dist_scale.sh: unknown argument '$1'" >&2; exit 2 ;;
  esac
done
child=$build/tests/dist_child
python=$(scripts/venv.sh)
export OMP_NUM_THREADS=1 TORCHPOINT_TEST_EPOCHS=3
rm -rf "$dir"
mkdir -p "$dir"
run() {  # run NODES PER_NODE
  local nodes=$1 per_node=$2 world=$(($1 * $2)) sub=$dir/$1x$2
  mkdir -p "$sub"
  local batch=$((32 / world))
  if ((nodes == 1)); then
    "$python" -m torch.distributed.run --standalone --nproc-per-node "$per_node" \
      --monitor-interval 0.1 --no-python "$child" "$sub/project" "$sub/log" none "$batch" \
      >"$sub/agents.out" 2>&1
  else
    local port
    port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.2", 0)); print(s.getsockname()[1])')
    local pids=()
    for ((n = 0; n < nodes; n++)); do
      GLOO_SOCKET_IFNAME=lo "$python" -m torch.distributed.run --nnodes "$nodes" \
        --nproc-per-node "$per_node" --rdzv-backend c10d --rdzv-endpoint "127.0.0.2:$port" \
        --rdzv-id "scale$port" --rdzv-conf "is_host=$([[ $n == 0 ]] && echo true || echo false)" \
        --local-addr "127.0.0.$((n + 2))" --monitor-interval 0.1 --no-python "$child" \
        "$sub/project" "$sub/log" none "$batch" >>"$sub/agents.out" 2>&1 &
      pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid"; done
  fi
  "$python" - "$sub" "$nodes" "$per_node" <<'PY'
import statistics, sys
sub, nodes, per_node = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
world = nodes * per_node
costs = {}
for r in range(world):
    with open(f"{sub}/log.{r}") as f:
        costs[r] = [l.split()[2:] for l in f if l.startswith("save_cost ")]
med = lambda xs: statistics.median(xs) if xs else float("nan")
r0 = costs[0]
others = [float(c[0]) for r in range(1, world) for c in costs[r]]
print(f"| {world} ({nodes} x {per_node}) | {len(r0)} | {med([float(c[0]) for c in r0]):.0f} | "
      f"{med(others):.0f} | {1e3 * med([float(c[1]) for c in r0]):.1f} | "
      f"{1e3 * med([float(c[2]) for c in r0]):.1f} |")
PY
}
echo "| processes | saves | store requests per save, rank 0 | the others (median) | rank 0's ms in them | rank 0's ms per save |"
echo "|---|---|---|---|---|---|"
run 1 2
run 1 4
run 1 8
run 4 4
rm -rf "$dir"
