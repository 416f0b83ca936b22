"""Python Accelerate and torchpoint continue each other's runs.

Usage: accelerate_interop_check.py CHILD SCRATCH [adamw|sgd]

The seed's example (a small model, AdamW, a StepLR, a registered object, automatic naming) is
trained for N steps on fixed batches and saved, then continued for M more steps, by Python
Accelerate and by CHILD (tests/accelerate_interop_child.cc), in both directions:

  Python -> C++: the real accelerate saves; the C++ program and a fresh Python process each load
  that checkpoint and train M steps.
  C++ -> Python: the C++ program saves, exports the checkpoint to Accelerate's layout and trains
  M steps; a fresh Python process runs accelerator.load_state on the export and trains M steps.

Checked, for each direction: right after the load, the parameters and the optimizer's state
are bit-identical to the saving run's; after M steps the learning rates of the scheduler and the
next 16 numbers of torch's CPU generator are identical, and the parameters agree within
TOLERANCE (PyTorch's Python AdamW and LibTorch's C++ AdamW do the same arithmetic with other
kernels: Python's exp_avg.lerp_ against C++'s mul_().add_()); with SGD (momentum), whose two
implementations round alike, they must be bit-identical. The registered object's state and the
step are carried. Prints the largest difference seen.

  accelerate_interop_check.py _python_continue DIR BATCHES FROM STEPS OUT
      the Python side of a continuation (run in its own process).
"""
import json
import os
import shutil
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file

N, M = 5, 6
OPTIMIZER = sys.argv[3] if len(sys.argv) > 3 and sys.argv[1] != "_python_continue" else "adamw"
if sys.argv[1] != "_python_continue":
    os.environ["INTEROP_OPTIMIZER"] = OPTIMIZER  # for the child and the Python continuations
# Largest absolute difference allowed between the parameters (of magnitude below 1) of the
# Python and the C++ continuation after M steps, both float32: for AdamW a few units in the last
# place (see the docstring; measured: below 1e-8), for SGD none.
TOLERANCE = 1e-7 if OPTIMIZER == "adamw" else 0.0


class Counter:
    """The registered object: an int, a str, a tensor and a list."""

    def __init__(self):
        self.n = 0
        self.name = "start"
        self.t = torch.zeros(3, dtype=torch.long)
        self.l = [0.0]

    def state_dict(self):
        return {"n": self.n, "name": self.name, "t": self.t, "l": self.l}

    def load_state_dict(self, s):
        self.n, self.name, self.t, self.l = s["n"], s["name"], s["t"], list(s["l"])


def make_run(project=None):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True) \
        if project else None
    accelerator = Accelerator(project_config=config, cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    if os.environ.get("INTEROP_OPTIMIZER") == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    counter = Counter()
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    accelerator.register_for_checkpointing(counter)
    return accelerator, model, optimizer, scheduler, counter


def train(accelerator, model, optimizer, scheduler, counter, batches, start, steps):
    lrs = []
    for k in range(start, start + steps):
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(batches["x%d" % k]), batches["y%d" % k])
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        counter.n += 1
        lrs.append(scheduler.get_last_lr()[0])
    return lrs


def record(model, optimizer, counter, prefix, out):
    for name, p in model.named_parameters():
        out[prefix + name] = p.detach().clone()
    state = optimizer.state_dict()
    groups = state["param_groups"]
    where = {}
    for g, group in enumerate(groups):
        for i, index in enumerate(group["params"]):
            where[index] = (g, i)
    for index, fields in state["state"].items():
        g, i = where[index]
        for key, value in fields.items():
            if key == "step":
                out["%soptimizer.state.%d.%d.step" % (prefix, g, i)] = \
                    torch.tensor([int(value.item())], dtype=torch.long)
            else:
                out["%soptimizer.state.%d.%d.%s" % (prefix, g, i, key)] = value.clone()
    out[prefix + "lr"] = torch.tensor([groups[0]["lr"]], dtype=torch.float64)
    out[prefix + "counter.t"] = counter.t.clone()
    out[prefix + "counter.n"] = torch.tensor([counter.n], dtype=torch.long)


def python_continue(directory, batches_path, start, steps, out_path):
    accelerator, model, optimizer, scheduler, counter = make_run()
    # Accelerate logs, and does not raise, when it cannot restore the RNG: make that visible.
    import logging
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("accelerate.checkpointing").addHandler(Keep())
    logging.getLogger("accelerate.checkpointing").setLevel(logging.INFO)
    accelerator.load_state(directory)
    out = {}
    record(model, optimizer, counter, "start.", out)
    out["start.step"] = torch.tensor([accelerator.step], dtype=torch.long)
    batches = load_file(batches_path)
    lrs = train(accelerator, model, optimizer, scheduler, counter, batches, start, steps)
    record(model, optimizer, counter, "end.", out)
    out["end.lrs"] = torch.tensor(lrs, dtype=torch.float64)
    out["end.rand"] = torch.rand(16, dtype=torch.float64)
    save_file(out, out_path)
    with open(out_path + ".json", "w") as f:
        json.dump({"log": records, "counter_name": counter.name, "counter_l": counter.l}, f)


if len(sys.argv) == 7 and sys.argv[1] == "_python_continue":
    python_continue(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), sys.argv[6])
    sys.exit(0)

child, scratch = sys.argv[1:3]
scratch = os.path.join(scratch, OPTIMIZER)
shutil.rmtree(scratch, ignore_errors=True)
os.makedirs(scratch)
problems = []
worst = {}


def run(*args):
    p = subprocess.run([str(a) for a in args], capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit("FAILED: %s\n%s%s" % (" ".join(map(str, args)), p.stdout, p.stderr))


def continue_in_python(directory, start, out):
    run(sys.executable, os.path.abspath(__file__), "_python_continue", directory, batches_path,
        start, M, out)


def compare(direction, saved, a_path, b_path):
    """`saved`: the state at the checkpoint ({name: tensor}, start.* keys); a and b: the two
    continuations' outputs."""
    a, b = load_file(a_path), load_file(b_path)
    for key, value in saved.items():
        for who, got in (("C++", a), ("Python", b)):
            if key not in got:
                problems.append("%s: %s's load has no %s" % (direction, who, key))
            elif not torch.equal(got[key], value):
                problems.append("%s: %s after %s's load differs from the saved run" %
                                (direction, key, who))
    for key in ("end.lrs", "end.rand", "end.counter.n", "end.counter.t", "start.step"):
        if not torch.equal(a[key], b[key]):
            problems.append("%s: %s differ: C++ %s, Python %s" %
                            (direction, key, a[key].tolist(), b[key].tolist()))
    largest = 0.0
    for key in a:
        if key.startswith("end.") and not key.startswith("end.optimizer") and \
                a[key].is_floating_point() and key not in ("end.lrs", "end.rand", "end.lr"):
            largest = max(largest, (a[key] - b[key]).abs().max().item())
    worst[direction] = largest
    if largest > TOLERANCE:
        problems.append("%s: the parameters after %d steps differ by %g > %g" %
                        (direction, M, largest, TOLERANCE))


# Fixed batches, the same for every run.
torch.manual_seed(123)
batches = {}
for k in range(N + M):
    batches["x%d" % k] = torch.randn(5, 4)
    batches["y%d" % k] = torch.randn(5, 2)
batches_path = os.path.join(scratch, "batches.safetensors")
save_file(batches, batches_path)

# --- Python -> C++ --------------------------------------------------------------------------
torch.manual_seed(0)
accelerator, model, optimizer, scheduler, counter = make_run(os.path.join(scratch, "py"))
counter.name, counter.t, counter.l = "from Python", torch.tensor([1, 2, 3]), [1, 2.5]
train(accelerator, model, optimizer, scheduler, counter, batches, 0, N)
accelerator.save_state()
checkpoint = os.path.join(scratch, "py", "checkpoints", "checkpoint_0")
saved = {}
record(model, optimizer, counter, "start.", saved)
saved["start.step"] = torch.tensor([accelerator.step], dtype=torch.long)
cpp_out = os.path.join(scratch, "py_to_cpp.safetensors")
py_out = os.path.join(scratch, "py_to_py.safetensors")
run(child, "continue", checkpoint, batches_path, N, M, cpp_out)
continue_in_python(checkpoint, N, py_out)
compare("Python -> C++", saved, cpp_out, py_out)
report = json.load(open(cpp_out + ".json"))
if report["step"] != N:
    problems.append("Python -> C++: the load report's step is %s, not %d" % (report["step"], N))
applicable = " ".join(report["not_applicable"])
for name in ("random_state", "numpy_random_seed"):
    if name not in applicable:
        problems.append("Python -> C++: not_applicable does not list %s: %s" %
                        (name, report["not_applicable"]))
if report["counter_name"] != "from Python" or report["counter_l"] != [1, 2.5]:
    problems.append("Python -> C++: the registered object came back as %s, %s" %
                    (report["counter_name"], report["counter_l"]))

# --- C++ -> Python --------------------------------------------------------------------------
export = os.path.join(scratch, "to_python")
cpp_out = os.path.join(scratch, "cpp_to_cpp.safetensors")
run(child, "train", os.path.join(scratch, "cpp"), batches_path, N, M, cpp_out, export)
py_out = os.path.join(scratch, "cpp_to_py.safetensors")
continue_in_python(export, N, py_out)
cpp = load_file(cpp_out)
saved = {k: v for k, v in cpp.items() if k.startswith("start.") and k != "start.step"}
compare("C++ -> Python", saved, cpp_out, py_out)
exported = json.load(open(cpp_out + ".json"))
py_report = json.load(open(py_out + ".json"))
if any("Could not load random states" in line for line in py_report["log"]):
    problems.append("C++ -> Python: Accelerate could not load the exported random states")
if py_report["counter_name"] != "from C++" or py_report["counter_l"] != [1.0, 2.5]:
    problems.append("C++ -> Python: the registered object came back as %s, %s" %
                    (py_report["counter_name"], py_report["counter_l"]))
# Every pickle of the export loads as Accelerate loads it: weights_only=True (the RNG file with
# the NumPy globals Accelerate allows), and with plain torch.load(weights_only=True) too except
# for the NumPy arrays of the RNG file.
from accelerate.utils.other import load as accelerate_load
for name in sorted(os.listdir(export)):
    path = os.path.join(export, name)
    if name.endswith(".bin") or name.endswith(".pkl"):
        try:
            accelerate_load(path)
            if not name.startswith("random_states_"):
                torch.load(path, weights_only=True)
        except Exception as e:  # noqa: BLE001 - any failure is the finding
            problems.append("C++ -> Python: %s does not load with weights_only=True: %s" % (name, e))
step = load_file(py_out)["start.step"].item()
if step != exported["step"]:
    problems.append("C++ -> Python: Accelerate's step after the load is %d, not %d" %
                    (step, exported["step"]))

for direction, largest in worst.items():
    print("%s (%s): parameters after %d more steps differ by at most %.3g (tolerance %g); "
          "learning rates, RNG draws, optimizer state at the load: identical" %
          (direction, OPTIMIZER, M, largest, TOLERANCE) if not problems else
          "%s: largest parameter difference %.3g" % (direction, largest))
if problems:
    print("\n".join("FAILED: " + p for p in problems))
    sys.exit(1)
print("ok")
