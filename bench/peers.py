#!/usr/bin/env python3
"""Times the Python checkpointing peers on the states of the C++ benchmark (bench/bench.cc).

    python bench/peers.py [--reps N] [--states S1,S2,S3] [--dir PATH] [--hot] [--no-recycle]
                          [--quick] [--json]

The states mirror make_s1/make_s2/make_s3 of bench/bench.cc in shapes, dtypes and tensor count:

  S1  one float32 tensor [8192, 8192], randn (256 MiB); --quick: [2048, 2048]
  S2  TinyTransformer (24 blocks, d=256, ffn=1024, vocab=32000, 1024 positions; --quick: 2 blocks,
      vocab 2000) plus the state of torch.optim.Adam(lr=1e-3) after 3 steps on random gradients
  S3  20000 float32 tensors of shape [1024] (4 KiB each), randn; --quick: 2000

A state's "bytes" counts the model parameters and, for S2, Adam's exp_avg and exp_avg_sq. Adam's
per-parameter "step" is a 0-dim tensor in Python but an integer scalar in the C++ state, so it is
saved and loaded here like any other entry but left out of "bytes", as the C++ side leaves it out.

How each peer is called (the timed region; every save is made as durable as torchpoint's, which
fsyncs, by adding os.fsync of the files and directories the peer itself does not sync):

  torch.save   save:      torch.save({"model": model.state_dict(), "optim": opt.state_dict()},
                          path) (no "optim" for S1 and S3), then fsync of the file and of its
                          directory
               load:      torch.load(path) (torch 2.13's default weights_only=True), new tensors,
                          then one byte of each of their pages read (see touch_pages)
               load_into: the same torch.load, then model.load_state_dict and
                          opt.load_state_dict on a second, pre-built model and optimizer
  safetensors  save:      safetensors.torch.save_file(flat, path), then fsync of file and directory;
                          "flat" names the model's tensors "model.<name>" and the optimizer's
                          "optim.<param index>.<name>" (safetensors holds tensors only, so Adam's
                          hyperparameters are not saved; the loader keeps its own)
               load:      safetensors.torch.load_file(path), new tensors (lazily mapped), then
                          one byte of each of their pages read, as for torch.load
               load_into: load_file, then model.load_state_dict and opt.load_state_dict
  dcp          save:      torch.distributed.checkpoint.save(state_dict, checkpoint_id=dir,
                          no_dist=True) in this one process, no process group (DCP 2.13 supports
                          that). Its FileSystemWriter fsyncs every file it writes (sync_files=True
                          by default), so only the checkpoint directory and its parent are synced
                          on top.
               load_into: dcp.load(state_dict, checkpoint_id=dir, no_dist=True), in place into
                          the tensors of the second model's and optimizer's state_dict()
  dcp-async    save:      dcp.async_save(state_dict, checkpoint_id=dir, no_dist=True) (thread
                          executor, default stager); "stall_seconds" runs until async_save
                          returns, "seconds" until its future is done and the directories synced
  accelerate   save:      Accelerator(project_config=ProjectConfiguration(...)) with
                          prepare(model, opt), then accelerator.save_state(dir) (safetensors for
                          the model, torch.save for the optimizer, a pickle of the RNG states),
                          then fsync of every file it wrote and of the directories. S1 and S3
                          have no optimizer of their own; accelerate gets a plain SGD (no state)
                          over the tensors, as a training script would have.
               load_into: accelerator.load_state(dir) on a second Accelerator that prepared the
                          second model and optimizer

Loads are cold by default: before each timed load every file of the checkpoint gets fdatasync +
posix_fadvise(POSIX_FADV_DONTNEED); --hot reads the files through once instead. As in the C++
benchmark, as much new memory is touched and freed, and a same-size file written and unlinked,
before every timed op, so that each one's new tensors and page-cache pages are recycled pages
(this VM is much slower on fresh ones; --no-recycle skips that); then every dirty page of the
system is written back (os.sync), so that no op's fsync waits for what the op before it left
dirty.
The order of the cases rotates each repetition; the first repetition checks that every load
returned the saved tensors (else it stops with an error). peak_extra_mib is taken in a separate,
untimed run of each op every repetition (max over repetitions), from a thread that reads
/proc/self/statm every 2 ms. The table goes to stderr; --json prints one JSON object per
(state, op, system) on stdout. It is a measurement, not a test: nothing about speed is asserted.
"""

import argparse
import copy
import ctypes
import gc
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable, Optional

import accelerate
import numpy
import safetensors
import safetensors.torch
import torch
import torch.distributed.checkpoint as dcp
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration
from torch import nn

DEFAULT_REPS = 5
SAMPLE_PERIOD_S = 0.002
IO_CHUNK = 8 << 20  # bytes per write/read in the untimed page-cache preparation
MIB = 1024.0 * 1024.0
ADAM_STEPS = 3

_libc = ctypes.CDLL(None)
_PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")

# DCP warns on every process that it runs without a process group; that is intended here.
warnings.filterwarnings("ignore", message=r"torch\.distributed is .*single process")


class VerificationError(RuntimeError):
    """A peer loaded something other than what was saved: its timing would be meaningless."""


# ---- The states ----------------------------------------------------------------------------


class Block(nn.Module):
    """One block of bench.cc's TinyTransformer: same modules, same registration order."""

    def __init__(self, d, ffn):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.o = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.ff1 = nn.Linear(d, ffn)
        self.ff2 = nn.Linear(ffn, d)


class TinyTransformer(nn.Module):
    """Only the parameters matter, so, as in bench.cc, there is no forward()."""

    def __init__(self, blocks, d, ffn, vocab, positions):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(positions, d)
        self.blocks = nn.ModuleList(Block(d, ffn) for _ in range(blocks))
        self.ln_f = nn.LayerNorm(d)


class OneTensor(nn.Module):
    def __init__(self, side):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(side, side))


class ManyTensors(nn.Module):
    def __init__(self, count):
        super().__init__()
        self.small = nn.ParameterList(torch.randn(1024) for _ in range(count))


@dataclass
class State:
    name: str
    description: str
    model: nn.Module
    optimizer: Optional[torch.optim.Optimizer]  # None for S1/S3: the tensors alone
    target_model: Optional[nn.Module] = None  # what the load_into ops write into
    target_optimizer: Optional[torch.optim.Optimizer] = None
    bytes: int = 0
    flat: dict = field(default_factory=dict)  # the saved tensors by flat name, for checks

    def state_dict(self):
        return nested_state_dict(self.model, self.optimizer)

    def target_state_dict(self):
        return nested_state_dict(self.target_model, self.target_optimizer)


def nested_state_dict(model, optimizer):
    sd = {"model": model.state_dict()}
    if optimizer is not None:
        sd["optim"] = optimizer.state_dict()
    return sd


def flatten(sd):
    """{"model": ..., "optim": ...} to one level of tensors, the form safetensors stores."""
    flat = {"model." + k: v for k, v in sd["model"].items()}
    for index, entries in sd.get("optim", {}).get("state", {}).items():
        for key, value in entries.items():
            flat[f"optim.{index}.{key}"] = value
    return flat


def unflatten_into(flat, model, optimizer):
    """Loads a flat dict (see flatten) into a model and its optimizer."""
    prefix = "model."
    model.load_state_dict({k[len(prefix):]: v for k, v in flat.items() if k.startswith(prefix)})
    if optimizer is None:
        return
    state = {}
    for key, value in flat.items():
        if key.startswith("optim."):
            _, index, name = key.split(".", 2)
            state.setdefault(int(index), {})[name] = value
    # safetensors stores no hyperparameters: the loading optimizer keeps its own param_groups.
    param_groups = optimizer.state_dict()["param_groups"]
    optimizer.load_state_dict({"state": state, "param_groups": param_groups})


def finish_state(s):
    """Builds the target model and optimizer (same structure, different values) and the totals."""
    s.target_model = copy.deepcopy(s.model)
    if s.optimizer is not None:
        s.target_optimizer = type(s.optimizer)(s.target_model.parameters(), **s.optimizer.defaults)
        # A deep copy, or the target's optimizer state would share tensors with the source.
        s.target_optimizer.load_state_dict(copy.deepcopy(s.optimizer.state_dict()))
    clear_target(s)
    s.flat = flatten(s.state_dict())
    s.bytes = sum(t.nbytes for k, t in s.flat.items() if not k.endswith(".step"))
    return s


def clear_target(s):
    """Zeroes what load_into writes, so that a load that does nothing cannot pass the check."""
    with torch.no_grad():
        for t in flatten(s.target_state_dict()).values():
            t.zero_()


def make_s1(quick):
    side = 2048 if quick else 8192
    return finish_state(
        State("S1", f"one float32 tensor [{side}, {side}], randn", OneTensor(side), None))


def make_s2(quick):
    blocks, d, ffn, positions = (2 if quick else 24), 256, 1024, 1024
    vocab = 2000 if quick else 32000
    model = TinyTransformer(blocks, d, ffn, vocab, positions)
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    for _ in range(ADAM_STEPS):
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        adam.step()
    model.zero_grad(set_to_none=True)  # gradients are not part of the checkpoint
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    description = (f"transformer-like ({blocks} blocks, d={d}, ffn={ffn}, vocab={vocab}): {numel} "
                   f"params in {len(params)} tensors + Adam state after {ADAM_STEPS} steps")
    return finish_state(State("S2", description, model, adam))


def make_s3(quick):
    count = 2000 if quick else 20000
    return finish_state(
        State("S3", f"{count} float32 tensors of 4 KiB, randn", ManyTensors(count), None))


STATE_MAKERS = {"S1": make_s1, "S2": make_s2, "S3": make_s3}


def check_loaded(label, got, want):
    """Spot-checks the first, middle and last tensor of a load against the saved state."""
    if len(got) != len(want):
        raise VerificationError(f"{label}: {len(got)} tensors, expected {len(want)}")
    names = list(want)
    for name in (names[0], names[len(names) // 2], names[-1]):
        if name not in got or not torch.equal(got[name], want[name]):
            raise VerificationError(f"{label}: tensor '{name}' differs from the saved one")


# ---- Files, page cache and memory -----------------------------------------------------------


def files_under(path):
    if os.path.isfile(path):
        return [path]
    return [os.path.join(root, f) for root, _, names in os.walk(path) for f in names]


def fsync_path(path):
    """fsync of a file or a directory (a directory's fsync makes its entries durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_all(paths):
    for p in paths:
        fsync_path(p)


def remove_path(path):
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def touch_pages(tensors):
    """Reads one byte of every memory page of each distinct storage behind `tensors`.

    safetensors' load_file maps the file and reads a page only when it is first used, while
    torch.load and torchpoint read everything before returning; touching every page makes each
    timed load end with the whole state in memory. It costs ~0.5 us per small storage and one
    strided numpy read per large one (about 1% of the fastest load here).
    """
    total = 0
    seen = set()
    for t in tensors:
        storage = t.untyped_storage()
        ptr, n = storage.data_ptr(), storage.nbytes()
        if n == 0 or ptr in seen:
            continue
        seen.add(ptr)
        if n <= _PAGE_SIZE:  # at most two pages: its first and last byte
            total += ctypes.c_uint8.from_address(ptr).value
            total += ctypes.c_uint8.from_address(ptr + n - 1).value
        else:
            data = numpy.frombuffer((ctypes.c_uint8 * n).from_address(ptr), dtype=numpy.uint8)
            total += int(data[::_PAGE_SIZE].sum()) + int(data[-1])
    return total


def drop_page_cache(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)  # dirty pages cannot be dropped; write them back first
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_through(path):
    with open(path, "rb", buffering=0) as f:
        while f.read(IO_CHUNK):
            pass


def recycle_pages(directory, nbytes):
    """Touches and frees nbytes of new memory, then writes and unlinks a file of nbytes, as
    bench.cc does before each op (see the docstring)."""
    if nbytes > 0:
        huge = 2 << 20
        size = (nbytes + huge - 1) // huge * huge
        with mmap.mmap(-1, size) as memory:
            if hasattr(mmap, "MADV_HUGEPAGE"):
                memory.madvise(mmap.MADV_HUGEPAGE)
            block = b"\x5a" * huge
            for at in range(0, size, huge):
                memory[at:at + huge] = block
    path = os.path.join(directory, "recycle.tmp")
    chunk = b"\x5a" * IO_CHUNK
    with open(path, "wb", buffering=0) as f:
        while nbytes > 0:
            n = min(nbytes, IO_CHUNK)
            f.write(chunk[:n])
            nbytes -= n
    os.unlink(path)
    os.sync()  # as bench.cc: nothing an earlier op left dirty is written back during this one


def resident_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE_SIZE


class PeakMemory:
    """Samples the resident set on a thread every 2 ms; finish() gives the peak above the start.

    Like bench.cc's sampler it can miss a spike shorter than the period (a mapped file released
    right after its copy, say). The thread needs the GIL for each sample; torch and safetensors
    release it while copying and doing I/O. finish() takes a last sample while the op's result
    is still alive.
    """

    def __init__(self):
        gc.collect()
        _libc.malloc_trim(0)  # memory freed by earlier ops would otherwise hide new allocations
        self._base = self._peak = resident_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(SAMPLE_PERIOD_S):
            self._peak = max(self._peak, resident_bytes())

    def finish(self):
        self._stop.set()
        self._thread.join()
        self._peak = max(self._peak, resident_bytes())
        return self._peak - self._base


# ---- The peers ------------------------------------------------------------------------------
# A save function writes the state to `path` durably. It returns None, or, for dcp-async, the
# perf_counter() time at which the call handed control back to the caller. A load function
# returns the loaded tensors as a flat dict (see flatten) after touching every page of them; a
# load_into function fills the state's target model and optimizer.


def torch_save(s, path):
    torch.save(s.state_dict(), path)
    fsync_all([path, os.path.dirname(path)])


def torch_load(s, path):
    flat = flatten(torch.load(path))
    touch_pages(flat.values())
    return flat


def torch_load_into(s, path):
    sd = torch.load(path)
    s.target_model.load_state_dict(sd["model"])
    if s.target_optimizer is not None:
        s.target_optimizer.load_state_dict(sd["optim"])


def safetensors_save(s, path):
    safetensors.torch.save_file(flatten(s.state_dict()), path)
    fsync_all([path, os.path.dirname(path)])


def safetensors_load(s, path):
    flat = safetensors.torch.load_file(path)
    touch_pages(flat.values())
    return flat


def safetensors_load_into(s, path):
    unflatten_into(safetensors.torch.load_file(path), s.target_model, s.target_optimizer)


def dcp_save(s, path):
    dcp.save(s.state_dict(), checkpoint_id=path, no_dist=True)
    # DCP fsyncs its files; the directory entries (new files, the metadata rename) are not.
    fsync_all([path, os.path.dirname(path)])


def dcp_async_save(s, path):
    future = dcp.async_save(s.state_dict(), checkpoint_id=path, no_dist=True)
    returned = time.perf_counter()
    future.result()
    fsync_all([path, os.path.dirname(path)])
    return returned


def dcp_load_into(s, path):
    # The optimizer's state_dict() holds its live state tensors, so an in-place load fills them.
    dcp.load(s.target_state_dict(), checkpoint_id=path, no_dist=True)


@dataclass
class AcceleratePair:
    """One Accelerator that prepared the state's model (it saves) and one for the target."""

    source: Accelerator
    target: Accelerator


def prepared_accelerator(scratch, model, optimizer):
    if optimizer is None:
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)  # no per-parameter state
    accelerator = Accelerator(project_config=ProjectConfiguration(project_dir=scratch))
    accelerator.prepare(model, optimizer)
    return accelerator


def accelerate_save(pair, path):
    pair.source.save_state(path)
    fsync_all(files_under(path) + [path, os.path.dirname(path)])


def accelerate_load_into(pair, path):
    pair.target.load_state(path)


@dataclass
class Peer:
    name: str
    suffix: str  # appended to "<state>.<system>" for the file or checkpoint directory
    save: Callable
    loads: dict  # op name -> function


PEERS = [
    Peer("torch.save", ".pt", torch_save, {"load": torch_load, "load_into": torch_load_into}),
    Peer("safetensors", ".safetensors", safetensors_save,
         {"load": safetensors_load, "load_into": safetensors_load_into}),
    Peer("dcp", ".dcp", dcp_save, {"load_into": dcp_load_into}),
    Peer("dcp-async", ".dcp-async", dcp_async_save, {}),
    Peer("accelerate", ".accelerate", accelerate_save, {"load_into": accelerate_load_into}),
]


# ---- The run --------------------------------------------------------------------------------


def rotated(items, rep):
    k = rep % len(items)
    return items[k:] + items[:k]


def median(values):
    return statistics.median(values) if values else 0.0


class Bench:
    def __init__(self, options, states, scratch):
        self.options = options
        self.states = states
        self.scratch = scratch
        # seconds[(state, op, system)] -> list; stall likewise for dcp-async; peak is a max
        self.seconds = {}
        self.stall = {}
        self.peak = {}
        self.accelerators = {}

    def path(self, s, peer):
        return os.path.join(self.scratch, s.name + "." + peer.name + peer.suffix)

    def handle(self, s, peer):
        """What a peer's functions take: the state, or accelerate's prepared pair for it."""
        if peer.name != "accelerate":
            return s
        if s.name not in self.accelerators:
            self.accelerators[s.name] = AcceleratePair(
                prepared_accelerator(self.scratch, s.model, s.optimizer),
                prepared_accelerator(self.scratch, s.target_model, s.target_optimizer))
        return self.accelerators[s.name]

    def prepare_save(self, s, path):
        remove_path(path)
        if self.options.recycle:
            recycle_pages(self.scratch, s.bytes)

    def prepare_load(self, s, path):
        for f in files_under(path):
            if self.options.hot:
                read_through(f)
            else:
                drop_page_cache(f)
        if self.options.recycle and not self.options.hot:
            recycle_pages(self.scratch, s.bytes)

    def run(self):
        for rep in range(self.options.reps):
            for s in self.states:
                self.run_state(rep, s)

    def run_state(self, rep, s):
        line = []
        for peer in rotated(PEERS, rep + self.options.rotate):
            path, handle = self.path(s, peer), self.handle(s, peer)
            self.prepare_save(s, path)
            start = time.perf_counter()
            returned = peer.save(handle, path)
            end = time.perf_counter()
            self.record(s, "save", peer, end - start)
            if returned is not None:
                self.stall.setdefault((s.name, "save", peer.name), []).append(returned - start)
            line.append(f"save {peer.name} {end - start:.3f}")
        loads = [(peer, op) for peer in PEERS for op in peer.loads]
        for peer, op in rotated(loads, rep + self.options.rotate):
            path, handle = self.path(s, peer), self.handle(s, peer)
            if op == "load_into":
                clear_target(s)
            self.prepare_load(s, path)
            start = time.perf_counter()
            result = peer.loads[op](handle, path)
            end = time.perf_counter()
            self.record(s, op, peer, end - start)
            if rep == 0:
                self.verify(s, peer, op, result)
            del result  # freeing the result is not part of the load
            line.append(f"{op} {peer.name} {end - start:.3f}")
        self.measure_memory(s)
        print(f"rep {rep + 1}/{self.options.reps} {s.name}: " + ", ".join(line) + " s",
              file=sys.stderr, flush=True)

    def record(self, s, op, peer, seconds):
        self.seconds.setdefault((s.name, op, peer.name), []).append(seconds)

    def verify(self, s, peer, op, result):
        label = f"{peer.name} {op} of {s.name}"
        got = result if op == "load" else flatten(s.target_state_dict())
        check_loaded(label, got, s.flat)

    def measure_memory(self, s):
        """Untimed runs of every op under the sampler, so it never competes with a timed one."""
        for peer in PEERS:
            path, handle = self.path(s, peer), self.handle(s, peer)
            self.prepare_save(s, path)
            peak = PeakMemory()
            peer.save(handle, path)
            self.note_peak(s, "save", peer, peak.finish())
            for op, load in peer.loads.items():
                self.prepare_load(s, path)
                peak = PeakMemory()
                result = load(handle, path)
                self.note_peak(s, op, peer, peak.finish())
                del result

    def note_peak(self, s, op, peer, extra):
        key = (s.name, op, peer.name)
        self.peak[key] = max(self.peak.get(key, 0), extra)

    def rows(self):
        """One dict per (state, op, system), in the JSON lines' field order."""
        for s in self.states:
            for op in ("save", "load", "load_into"):
                for peer in PEERS:
                    key = (s.name, op, peer.name)
                    if key not in self.seconds:
                        continue
                    row = {"state": s.name, "op": op, "system": peer.name,
                           "seconds": median(self.seconds[key]), "bytes": s.bytes,
                           "peak_extra_mib": round(self.peak.get(key, 0) / MIB, 1),
                           "reps": len(self.seconds[key])}
                    if key in self.stall:
                        row["stall_seconds"] = median(self.stall[key])
                    yield row

    def print_table(self, out, load_before, load_after):
        versions = {"torch": torch.__version__, "safetensors": safetensors.__version__,
                    "accelerate": accelerate.__version__}
        o = self.options
        print(f"\npeers.py: median of {o.reps} repetition(s), order rotated; "
              f"{'hot' if o.hot else 'cold'} loads; "
              f"{'recycled page-cache pages' if o.recycle else 'no page recycling'}", file=out)
        print(f"python_versions: {json.dumps(versions)}; Python {sys.version.split()[0]}, "
              f"{torch.get_num_threads()} intra-op thread(s), {os.cpu_count()} CPUs, "
              f"load average {load_before} -> {load_after}", file=out)
        by_state = {}
        for row in self.rows():
            by_state.setdefault(row["state"], []).append(row)
        for s in self.states:
            steps = sum(1 for k in s.flat if k.endswith(".step"))
            counted = f"{len(s.flat) - steps} tensor(s)" + (
                f" + {steps} Adam step scalars, not counted" if steps else "")
            print(f"\n{s.name}: {s.description}; {s.bytes / MIB:.1f} MiB in {counted}", file=out)
            print(f"  {'op':<10}{'system':<13}{'seconds':>9}{'GB/s':>8}{'stall s':>9}"
                  f"{'peak extra MiB':>16}", file=out)
            for row in by_state.get(s.name, []):
                gbps = s.bytes / row["seconds"] / 1e9 if row["seconds"] > 0 else 0.0
                stall = f"{row['stall_seconds']:.3f}" if "stall_seconds" in row else "-"
                print(f"  {row['op']:<10}{row['system']:<13}{row['seconds']:>9.3f}{gbps:>8.2f}"
                      f"{stall:>9}{row['peak_extra_mib']:>16.1f}", file=out)


def load_average():
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


def parse_args(argv):
    p = argparse.ArgumentParser(description="Times the Python checkpointing peers on the states "
                                "of bench/bench.cc.")
    p.add_argument("--reps", type=int, default=DEFAULT_REPS, help="repetitions (default 5)")
    p.add_argument("--states", default="S1,S2,S3", help="comma-separated subset of S1,S2,S3")
    p.add_argument("--dir", help="scratch directory (default: a new one under the temp dir)")
    p.add_argument("--hot", action="store_true",
                   help="read the files through before each load instead of dropping them")
    p.add_argument("--no-recycle", dest="recycle", action="store_false",
                   help="skip writing+unlinking a same-size file before each op (VM idle effect)")
    p.add_argument("--rotate", type=int, default=0,
                   help="start the rotating order of the cases this many places on (as bench.cc)")
    p.add_argument("--quick", action="store_true",
                   help="small states for a smoke run (S1 16 MiB, S2 2 blocks, S3 2000 tensors)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per (state, op, system) on stdout")
    o = p.parse_args(argv)
    if o.reps < 1:
        p.error("--reps must be at least 1")
    o.states = [name.strip() for name in o.states.split(",") if name.strip()]
    unknown = [name for name in o.states if name not in STATE_MAKERS]
    if unknown or not o.states:
        p.error(f"--states: unknown state(s) {unknown}; choose from S1,S2,S3")
    return o


def main(argv):
    options = parse_args(argv)
    if options.dir:
        os.makedirs(options.dir, exist_ok=True)
        scratch = tempfile.mkdtemp(prefix="torchpoint_peers.", dir=options.dir)
    else:
        scratch = tempfile.mkdtemp(prefix="torchpoint_peers.")
    try:
        states = [STATE_MAKERS[name](options.quick) for name in options.states]
        load_before = load_average()
        print(f"scratch dir {scratch}, load average {load_before}", file=sys.stderr, flush=True)
        bench = Bench(options, states, scratch)
        bench.run()
        bench.print_table(sys.stderr, load_before, load_average())
        if options.json:
            for row in bench.rows():
                print(json.dumps(row), flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except (OSError, RuntimeError, ValueError) as e:  # VerificationError is a RuntimeError
        print(f"peers.py: error: {type(e).__name__}: {e}", file=sys.stderr)
        sys.exit(1)
