#!/usr/bin/env python3
"""The peer of torchpoint_dist_bench --zero-stage: torch.distributed.checkpoint (DCP) saving and
loading the benchmark's S2 state, sharded as ZeRO shards it, from Python on gloo processes.

    python -m torch.distributed.run --nproc-per-node N bench/dcp_zero.py --dir PATH --stage S
        [--reps K] [--quick] [--load-from CHECKPOINT]

The state: the S2 model of bench/peers.py (replicated: every process holds all of it, and DCP's
planner deals each tensor to one process to write) and Adam's two moments over the flat
concatenation of the parameters' elements. At stage 0 the moments are replicated too (each
process holds all of them, as plain data parallel does); at stages 1 and 2 each is a DTensor
sharded on a 1-D mesh of the processes (Shard(0), each process ceil(T / N) elements, the last
fewer), which is the partition of torchpoint's ZeRO. Gradients are never part of a checkpoint,
so stages 1 and 2 hold the same checkpointed state.

Each repetition: a save (dcp.save into a new directory; its FileSystemWriter fsyncs every file,
and the directory and its parent are synced on top, as torchpoint commits), then a cold load of it
(dcp.load in place into a second state of the same layout, after every file got fdatasync and
POSIX_FADV_DONTNEED). With --load-from, only cold loads of that checkpoint (written by another
number of processes: DCP reshards the moments on load). Times are between barriers, the slowest
process's. Bytes written per process: the .distcp files it wrote (and the main process's
.metadata); bytes read: the rchar of /proc/self/io around the load (every byte read() returned).
Prints one JSON line per op, the fields of bench/dist.sh's records.
"""
import argparse
import json
import os
import shutil
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peers import TinyTransformer  # noqa: E402  (the S2 model of the single-process peers)


def make_state(quick, stage, mesh, seed):
    """The S2 model and Adam's moments over its flat parameters, this process's share of them."""
    torch.manual_seed(seed)
    blocks, vocab = (2, 2000) if quick else (24, 32000)
    model = TinyTransformer(blocks, 256, 1024, vocab, 1024)
    total = sum(p.numel() for p in model.parameters())
    world, rank = dist.get_world_size(), dist.get_rank()
    if stage == 0:
        lo, hi = 0, total
    else:
        part = (total + world - 1) // world
        lo, hi = min(total, rank * part), min(total, (rank + 1) * part)
    moments = {}
    for name in ("exp_avg", "exp_avg_sq"):
        local = torch.randn(hi - lo)
        if stage == 0:
            moments[name] = local
        else:
            moments[name] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                               shape=torch.Size([total]), stride=(1,))
    moments["step"] = torch.tensor(3.0)
    return {"model": model.state_dict(), "optim": moments}


def fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def evict(path):
    for name in os.listdir(path):
        fd = os.open(os.path.join(path, name), os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def rchar():
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar")


def timed(op):
    """Runs op on every process between barriers; the slowest process's seconds."""
    dist.barrier()
    start = time.perf_counter()
    op()
    seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return seconds.item()


def gather(value):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def written_by(path, rank):
    total = 0
    for name in os.listdir(path):
        if name.startswith(f"__{rank}_") or (rank == 0 and name == ".metadata"):
            total += os.path.getsize(os.path.join(path, name))
    return total


def main(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True)
    p.add_argument("--stage", type=int, choices=(0, 1, 2), default=1)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--load-from", default="")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    source = make_state(a.quick, a.stage, mesh, seed=1)
    target = make_state(a.quick, a.stage, mesh, seed=2)
    records = []

    def load(path):
        if rank == 0:
            evict(path)
        before = [0]

        def op():
            before[0] = rchar()
            dcp.load(target, checkpoint_id=path)
        seconds = timed(op)
        return seconds, rchar() - before[0]

    def record(op, seconds, written, read, **extra):
        records.append(dict({"state": "S2", "system": "dcp", "op": op, "processes": world,
                             "stage": a.stage, "seconds": seconds,
                             "bytes_written_per_rank": written, "bytes_read_per_rank": read,
                             "store_messages": None}, **extra))

    if a.load_from:
        seconds, reads = [], []
        for _ in range(a.reps):
            s, r = load(a.load_from)
            seconds.append(s)
            reads.append(r)
        record("load", statistics.median(seconds), None, gather(max(reads)), reps=a.reps,
               saved_processes=json.load(open(os.path.join(a.load_from, "processes.json"))))
    else:
        if rank == 0:  # what an earlier run left
            shutil.rmtree(a.dir, ignore_errors=True)
            os.makedirs(a.dir)
        dist.barrier()
        saves, loads, writes, reads = [], [], [], []
        path = ""
        for rep in range(a.reps + 1):  # the first, untimed: faulting in the writer's buffers
            old, path = path, os.path.join(a.dir, f"dcp_{rep}")

            def save():
                dcp.save(source, checkpoint_id=path)
                if rank == 0:
                    fsync_dir(path)
                    fsync_dir(a.dir)
            if rank == 0 and old:
                shutil.rmtree(old)
            seconds = timed(save)
            if rep == 0:
                continue
            saves.append(seconds)
            writes.append(written_by(path, rank))
            s, r = load(path)
            loads.append(s)
            reads.append(r)
        if rank == 0:
            with open(os.path.join(path, "processes.json"), "w") as f:
                json.dump(world, f)
        record("save", statistics.median(saves), gather(max(writes)), None, reps=a.reps)
        record("load", statistics.median(loads), None, gather(max(reads)), reps=a.reps,
               saved_processes=world)
        # The last checkpoint stays, for loads on another number of processes.
        dist.barrier()
        if rank == 0:
            os.replace(path, os.path.join(a.dir, "dcp_last"))
    # The load must have brought the saved moments (a load that did nothing would be fast).
    local = lambda t: t.to_local() if isinstance(t, DTensor) else t  # noqa: E731
    if not a.load_from and not torch.equal(local(target["optim"]["exp_avg"]),
                                           local(source["optim"]["exp_avg"])):
        raise RuntimeError("dcp.load did not restore the saved moments")
    if rank == 0:
        for r in records:
            print(json.dumps(r), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
