"""Every LR scheduler crosses between Python Accelerate and torchpoint, both ways.

Usage: accelerate_scheduler_check.py CHILD SCRATCH

For each scheduler, a relay on fixed batches with SGD (momentum, two param groups), whose Python
and LibTorch implementations round alike:

  Python, N steps, accelerator.save_state()
  -> C++ (CHILD relay: the scheduler built with other options), load_state, M steps, save_state,
     export_accelerate_checkpoint
  -> Python (the scheduler built with other options), load_state of the export, K steps

must equal the same run done by Python alone, bit for bit: the learning rates and momenta of
every step, the losses, the parameters after each leg, and right after the second load the
scheduler's state_dict() and the scheduler's keys in the optimizer's param groups. Each leg must
change the learning rate (the phases of a schedule are crossed on both sides). LibTorch's
StepLR takes the C++ leg as torch::optim::StepLR too. Then damaged Python checkpoints: the load
fails naming the key, its meaning and the file.
"""
import copy
import json
import logging
import os
import shutil
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file

N, M, K = 5, 7, 6
TOTAL = N + M + K
L = torch.optim.lr_scheduler

# name: (the run's scheduler, the continuation's decoy). Options chosen so that every leg moves
# the learning rate: StepLR decays at 3, 6, ...; milestones fall in each leg; OneCycleLR's
# warm-up ends in the C++ leg (two phases) or its phases end in the first two legs (three).
SCHEDULERS = {
    "StepLR": (lambda o: L.StepLR(o, step_size=3, gamma=0.5),
               lambda o: L.StepLR(o, step_size=7, gamma=0.9)),
    "MultiStepLR": (lambda o: L.MultiStepLR(o, milestones=[2, 8, 8, 15], gamma=0.5),
                    lambda o: L.MultiStepLR(o, milestones=[1], gamma=0.9)),
    "ExponentialLR": (lambda o: L.ExponentialLR(o, gamma=0.9),
                      lambda o: L.ExponentialLR(o, gamma=0.5)),
    "CosineAnnealingLR": (lambda o: L.CosineAnnealingLR(o, T_max=4, eta_min=0.001),
                          lambda o: L.CosineAnnealingLR(o, T_max=9)),
    "LinearLR": (lambda o: L.LinearLR(o, start_factor=0.25, end_factor=0.9, total_iters=14),
                 lambda o: L.LinearLR(o)),
    "OneCycleLR": (lambda o: L.OneCycleLR(o, max_lr=[0.1, 0.05], total_steps=TOTAL,
                                          pct_start=0.4),
                   lambda o: L.OneCycleLR(o, max_lr=1.0, total_steps=100)),
    "OneCycleLR_three_phase": (
        lambda o: L.OneCycleLR(o, max_lr=0.08, total_steps=TOTAL, pct_start=0.25,
                               anneal_strategy="linear", three_phase=True, cycle_momentum=False,
                               div_factor=10.0, final_div_factor=100.0),
        lambda o: L.OneCycleLR(o, max_lr=1.0, total_steps=100)),
    "ReduceLROnPlateau": (lambda o: L.ReduceLROnPlateau(o, factor=0.7, patience=0, cooldown=1,
                                                        min_lr=[0.004, 0.001]),
                          lambda o: L.ReduceLROnPlateau(o, min_lr=0.001)),
    "ReduceLROnPlateau_one_floor": (
        lambda o: L.ReduceLROnPlateau(o, factor=0.8, patience=0, threshold=1e-3,
                                      threshold_mode="abs", min_lr=0.003),
        lambda o: L.ReduceLROnPlateau(o, mode="max", min_lr=0.5)),
    # LibTorch's torch::optim::StepLR(3, 0.5) in the C++ leg (it cannot be built otherwise).
    "libtorch_StepLR": (lambda o: L.StepLR(o, step_size=3, gamma=0.5),
                        lambda o: L.StepLR(o, step_size=7, gamma=0.9)),
}
PLATEAU = ("ReduceLROnPlateau", "ReduceLROnPlateau_one_floor")

child, scratch = sys.argv[1], os.path.join(sys.argv[2], "schedulers")
shutil.rmtree(scratch, ignore_errors=True)
os.makedirs(scratch)
logging.getLogger("accelerate").setLevel(logging.ERROR)
problems = []

torch.manual_seed(123)
batches = {}
for k in range(TOTAL):
    batches["x%d" % k] = torch.randn(5, 4)
    batches["y%d" % k] = torch.randn(5, 2)
batches_path = os.path.join(scratch, "batches.safetensors")
save_file(batches, batches_path)


def make_run(make_scheduler, project=None):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    config = ProjectConfiguration(project_dir=project) if project else None
    accelerator = Accelerator(project_config=config, cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    optimizer = torch.optim.SGD([{"params": weights}, {"params": biases, "lr": 0.02}], lr=0.05,
                                momentum=0.9)
    scheduler = make_scheduler(optimizer)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    return accelerator, model, optimizer, scheduler


def train(run, start, steps, trace):
    accelerator, model, optimizer, scheduler = run
    for k in range(start, start + steps):
        loss = torch.nn.functional.mse_loss(model(batches["x%d" % k]), batches["y%d" % k])
        accelerator.backward(loss)
        optimizer.step()
        if isinstance(scheduler.scheduler, L.ReduceLROnPlateau):
            scheduler.step(float(loss.detach()))
        else:
            scheduler.step()
        optimizer.zero_grad()
        trace["losses"].append(float(loss.detach()))
        trace["lrs"].append([g["lr"] for g in optimizer.param_groups])
        trace["momenta"].append([g["momentum"] for g in optimizer.param_groups])


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def groups_without_params(optimizer):
    return [{k: v for k, v in g.items() if k != "params"}
            for g in optimizer.state_dict()["param_groups"]]


def same_params(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)


def new_trace():
    return {"losses": [], "lrs": [], "momenta": []}


def relay(name):
    real, decoy = SCHEDULERS[name]
    where = os.path.join(scratch, name)
    # Python alone, saving after N steps and recording everything after N + M.
    alone = make_run(real, os.path.join(where, "py"))
    trace = new_trace()
    train(alone, 0, N, trace)
    alone[0].save_state(os.path.join(where, "py", "after_n"))
    after_n = params(alone[1])
    train(alone, N, M, trace)
    after_nm = params(alone[1])
    scheduler_nm = copy.deepcopy(alone[3].scheduler.state_dict())
    groups_nm = copy.deepcopy(groups_without_params(alone[2]))
    train(alone, N + M, K, trace)

    out = os.path.join(where, "cpp.safetensors")
    export = os.path.join(where, "to_python")
    p = subprocess.run([child, "relay", name, os.path.join(where, "py", "after_n"), batches_path,
                        str(N), str(M), os.path.join(where, "cpp"), export, out],
                       capture_output=True, text=True)
    if p.returncode != 0:
        problems.append("%s: the C++ leg failed: %s%s" % (name, p.stdout, p.stderr))
        return
    cpp = load_file(out)
    report = json.load(open(out + ".json"))

    def check_leg(leg, got, first, count):
        for key in ("lrs", "momenta", "losses"):
            want = torch.tensor(trace[key][first:first + count], dtype=torch.float64)
            if not torch.equal(got[key], want):
                problems.append("%s: %s's %s differ from Python alone's:\n  got  %s\n  want %s" %
                                (name, leg, key, got[key].tolist(), want.tolist()))
        lrs = got["lrs"]
        before = torch.tensor([trace["lrs"][first - 1]], dtype=torch.float64)
        if torch.equal(torch.cat([before, lrs]).diff(dim=0).abs().sum(), torch.tensor(0.0,
                                                                          dtype=torch.float64)):
            problems.append("%s: the learning rate does not change in the %s leg: the test "
                            "crosses nothing there" % (name, leg))

    if not same_params({n[6:]: t for n, t in cpp.items() if n.startswith("start.")}, after_n):
        problems.append("%s: the parameters after C++'s load differ from the saved run's" % name)
    check_leg("C++", cpp, N, M)
    if not same_params({n[4:]: t for n, t in cpp.items() if n.startswith("end.")}, after_nm):
        problems.append("%s: the parameters after the C++ leg differ from Python alone's" % name)

    if "export_error" in report:
        problems.append("%s: the export failed: %s" % (name, report["export_error"]))
        return

    # The exported state is Python's own, key for key (the decoy's state after loading it may
    # keep attributes of its own: load_state_dict() only adds).
    exported = torch.load(os.path.join(export, "scheduler.bin"), weights_only=True)
    if name == "libtorch_StepLR":
        # LibTorch keeps no base learning rates: the export writes the current ones.
        if exported.get("base_lrs") != scheduler_nm["_last_lr"]:
            problems.append("%s: base_lrs %s are not the current learning rates %s" %
                            (name, exported.get("base_lrs"), scheduler_nm["_last_lr"]))
        exported["base_lrs"] = scheduler_nm["base_lrs"]
        for group, lr in zip(groups_nm, scheduler_nm["_last_lr"]):
            group["initial_lr"] = lr
    if exported != scheduler_nm:
        problems.append("%s: the exported scheduler.bin differs from Python's state_dict():\n"
                        "  got  %s\n  want %s" % (name, exported, scheduler_nm))
    back = make_run(decoy)
    back[0].load_state(export)
    if groups_without_params(back[2]) != groups_nm:
        problems.append("%s: the param groups after loading the export differ:\n  got  %s\n"
                        "  want %s" % (name, groups_without_params(back[2]), groups_nm))
    again = new_trace()
    train(back, N + M, K, again)
    got = {k: torch.tensor(v, dtype=torch.float64) for k, v in again.items()}
    check_leg("second Python", got, N + M, K)
    if not same_params(params(back[1]), params(alone[1])):
        problems.append("%s: the final parameters differ from Python alone's" % name)
    print("%s: Python %d -> C++ %d -> Python %d steps: identical to Python alone "
          "(learning rates %s -> %s)" % (name, N, M, K, trace["lrs"][0], trace["lrs"][-1]))


def refused(name, damage, parts, target="OneCycleLR"):
    """Damages a copy of `target`'s Python checkpoint with `damage(directory)` and checks that the
    C++ load fails with a message holding every one of `parts`."""
    source = os.path.join(scratch, target, "py", "after_n")
    where = os.path.join(scratch, "damaged", name)
    shutil.copytree(source, os.path.join(where, "in"))
    damage(os.path.join(where, "in"))
    p = subprocess.run([child, "relay", target, os.path.join(where, "in"), batches_path, str(N),
                        "1", os.path.join(where, "cpp"), os.path.join(where, "x"),
                        os.path.join(where, "out.safetensors")], capture_output=True, text=True)
    missing = [part for part in parts if part not in p.stderr]
    if p.returncode != 1 or missing:
        problems.append("%s: the load should fail naming %s; exit %d: %s" %
                        (name, missing, p.returncode, p.stderr.strip()))
    else:
        print("%s: refused: %s" % (name, p.stderr.strip().split(": ", 1)[-1]))


def edit(file, change):
    def damage(directory):
        path = os.path.join(directory, file)
        value = torch.load(path, weights_only=False)
        change(value)
        torch.save(value, path)
    return damage


for scheduler_name in SCHEDULERS:
    relay(scheduler_name)

refused("optimizer without max_lr",
        edit("optimizer.bin", lambda v: v["param_groups"][1].pop("max_lr")),
        ["optimizer.bin param group 1", "'max_lr'", "peak learning rate", "scheduler.bin"])
refused("plateau without best", edit("scheduler.bin", lambda v: v.pop("best")),
        ["scheduler.bin", "'best'", "the best metric so far", "ReduceLROnPlateau"],
        target="ReduceLROnPlateau")
refused("another class", lambda d: shutil.copy(
    os.path.join(scratch, "ReduceLROnPlateau", "py", "after_n", "scheduler.bin"),
    os.path.join(d, "scheduler.bin")),
    ["scheduler.bin", "torch.optim.lr_scheduler.ReduceLROnPlateau", "torchpoint::OneCycleLR"])
refused("LibTorch's StepLR of other options",
        edit("scheduler.bin", lambda v: v.update(step_size=4)),
        ["scheduler.bin", "step_size 4", "torch::optim::StepLR has step_size 3", "cannot change"],
        target="libtorch_StepLR")
refused("phases of no pct_start", edit("scheduler.bin", lambda v: v["_schedule_phases"][0].update(
    end_step=-2.0)), ["scheduler.bin", "no pct_start"])

if problems:
    print("\n".join("FAILED: " + p for p in problems))
    sys.exit(1)
print("ok")
