#!/usr/bin/env bash
# Sets up, builds the examples and runs them: the main job of this repository.
#   1. torchpoint_demo: save a trained model and its Adam state, load into fresh objects,
#      continue bit for bit; what happens to a corrupt file and an existing checkpoint.
#   2. accelerate_example: the checkpointing example of Accelerate's guide (seed 000).
#   3. luz_example: the model-snapshot guide of luz (seed 004): auto_resume after an
#      interrupt, model_checkpoint, load_checkpoint, resume_from_checkpoint, callback state;
#      writes the plot of the records to build/demo-run/luz/auto_resume.png (and .svg) and
#      TensorBoard event files to build/demo-run/luz/logs.
#   4. accelerate_torchrun: Accelerate's loop on 2 processes under torchrun, once uninterrupted
#      and once with rank 1 killed (SIGKILL) mid-epoch and the pair restarted by torchrun
#      (--max-restarts 1): both end with the same weights, bit for bit.
#   5. The same on two "nodes" (torchrun agents on 127.0.0.2 and 127.0.0.3, 2 processes each),
#      node 1 killed whole (agent and workers) after two checkpoints and started again: the
#      4 processes end with the uninterrupted 4-process run's weights, bit for bit.
#   6. accelerate_interop: from Python Accelerate to C++ and back: the real accelerate trains
#      and saves, the C++ program loads that directory, trains and exports it in Accelerate's
#      layout, and Python loads it and finishes where a Python-only run ends.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh torchpoint_demo accelerate_example luz_example accelerate_torchrun \
  accelerate_interop torchpoint_cli
rm -rf build/demo-run
mkdir -p build/demo-run
echo "== torchpoint_demo"
./build/examples/torchpoint_demo build/demo-run
echo
echo "== accelerate_example (Accelerate's checkpointing guide, in C++)"
./build/examples/accelerate_example build/demo-run
echo
echo "== luz_example (luz's guide to saving model snapshots, in C++)"
./build/examples/luz_example build/demo-run
echo
echo "== accelerate_torchrun (the same loop on 2 processes, torchrun restarting a killed one)"
python=$(scripts/venv.sh)
torchrun=("$python" -m torch.distributed.run --standalone --nproc-per-node 2)
export OMP_NUM_THREADS=1
mkdir -p build/demo-run/torchrun
# torchrun's own messages (its agent's warnings, the killed worker's report) go to a log.
echo "-- uninterrupted:"
"${torchrun[@]}" --no-python ./build/examples/accelerate_torchrun build/demo-run/torchrun/uninterrupted \
  2>build/demo-run/torchrun/uninterrupted.log
echo "-- rank 1 killed after step 80, restarted by torchrun:"
"${torchrun[@]}" --max-restarts 1 --no-python ./build/examples/accelerate_torchrun \
  build/demo-run/torchrun/killed 80 2>build/demo-run/torchrun/killed.log
grep -h "killing itself" build/demo-run/torchrun/killed.log || true
if ./build/tools/torchpoint diff build/demo-run/torchrun/uninterrupted/final_model.safetensors \
  build/demo-run/torchrun/killed/final_model.safetensors >/dev/null; then
  echo "  [ok] the killed and restarted pair ends with the uninterrupted pair's weights, bit for bit"
else
  echo "  [FAILED] the killed and restarted pair's weights differ from the uninterrupted pair's"
  exit 1
fi
./build/tools/torchpoint ls build/demo-run/torchrun/killed/checkpoints
echo
echo "== two nodes (torchrun agents on 127.0.0.2 and 127.0.0.3, 2 processes each), one killed whole"
nodes=build/demo-run/nodes
mkdir -p "$nodes"
echo "-- uninterrupted, 4 processes on one node (20 epochs):"
"$python" -m torch.distributed.run --standalone --nproc-per-node 4 --no-python \
  ./build/examples/accelerate_torchrun "$nodes/uninterrupted" -1 20 >"$nodes/uninterrupted.log" 2>&1
tail -n 1 "$nodes/uninterrupted.log"
port=$("$python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.2", 0)); print(s.getsockname()[1])')
# One torchrun agent per "node". TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: with torchrun's shared
# store (torch 2.4 and later) a node started again could not join the next rendezvous round.
agent() {  # agent NODE
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 GLOO_SOCKET_IFNAME=lo exec "$python" -m torch.distributed.run \
    --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint "127.0.0.2:$port" \
    --rdzv-id "demo$port" --rdzv-conf "is_host=$([[ $1 == 0 ]] && echo true || echo false)" \
    --local-addr "127.0.0.$(($1 + 2))" --max-restarts 3 --no-python \
    ./build/examples/accelerate_torchrun "$nodes/killed" -1 20 >>"$nodes/node$1.log" 2>&1
}
agent 0 & node0=$!
agent 1 & node1=$!
until (($(find "$nodes/killed/checkpoints" -maxdepth 1 -name 'checkpoint_*' ! -name '*.tmp-*' 2>/dev/null | wc -l) >= 2)); do
  sleep 0.05
done
# The whole of node 1 at once, as a machine losing power: its agent and its 2 workers.
kill -STOP "$node1"
workers=$(pgrep -P "$node1" || true)
kill -KILL $workers "$node1"
wait "$node1" 2>/dev/null || true
echo "-- node 1 killed (agent and workers, SIGKILL) after 2 checkpoints; started again:"
agent 1 & node1=$!
wait "$node0"
wait "$node1"
grep -h "resumed from" "$nodes"/node*.log | sort -u
if ./build/tools/torchpoint diff "$nodes/uninterrupted/final_model.safetensors" \
  "$nodes/killed/final_model.safetensors" >/dev/null; then
  echo "  [ok] the two nodes, one killed and started again, end with the 4-process run's weights, bit for bit"
else
  echo "  [FAILED] the two nodes' weights differ from the uninterrupted 4-process run's"
  exit 1
fi
echo
echo "== accelerate_interop (from Python Accelerate to C++ and back)"
mkdir -p build/demo-run/interop
"$python" examples/accelerate_interop.py start build/demo-run/interop
./build/examples/accelerate_interop build/demo-run/interop
"$python" examples/accelerate_interop.py finish build/demo-run/interop
./build/tools/torchpoint show build/demo-run/interop/back_to_python | sed -n 1,12p
