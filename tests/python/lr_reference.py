"""Prints the learning rates PyTorch's own LR schedulers compute, as the reference that
tests/scheduler_test.cc compares torchpoint's schedulers with, bit for bit.

Usage: lr_reference.py SPEC, where SPEC is JSON (or a JSON array of them, each with a "case"
name that every line it prints then carries: one Python process for every case):
  {"optimizer": "SGD" | "Adam" | "AdamW" | "RMSprop" | "Adagrad",
   "lrs": [lr of group 0, lr of group 1],     one or two param groups
   "scheduler": a class name in torch.optim.lr_scheduler,
   "kwargs": {its keyword arguments},
   "steps": number of scheduler steps,
   "metrics": [one per step]}                  ReduceLROnPlateau only
Prints one JSON line after construction and one after each step:
  {"lr": [float.hex of each group's lr], "momentum": [float.hex of each group's momentum or beta1]}
("momentum" only when the optimizer has one). Exits with 3 when torch cannot be imported.
"""
import json
import sys
import warnings

try:
    import torch
except ImportError as e:
    sys.stderr.write("lr_reference.py: cannot import torch ({}): run it with the project "
                     "venv's python (scripts/venv.sh makes it)\n".format(e))
    sys.exit(3)

# Calling scheduler.step() without optimizer.step() in between only warns.
warnings.simplefilter("ignore")

OPTIMIZERS = {
    # Momentum must be in the defaults for OneCycleLR to cycle it; the C++ test uses the same.
    "SGD": lambda groups, lr: torch.optim.SGD(groups, lr=lr, momentum=0.9),
    "Adam": lambda groups, lr: torch.optim.Adam(groups, lr=lr),
    "AdamW": lambda groups, lr: torch.optim.AdamW(groups, lr=lr),
    "RMSprop": lambda groups, lr: torch.optim.RMSprop(groups, lr=lr, momentum=0.5),
    "Adagrad": lambda groups, lr: torch.optim.Adagrad(groups, lr=lr),
}


def momentum(group):
    if "betas" in group:
        return group["betas"][0]
    return group.get("momentum")


def run(spec):
    model = torch.nn.Linear(3, 2)
    lrs = spec["lrs"]
    if len(lrs) == 1:
        groups = [{"params": list(model.parameters()), "lr": lrs[0]}]
    else:
        groups = [{"params": [model.weight], "lr": lrs[0]}, {"params": [model.bias], "lr": lrs[1]}]
    optimizer = OPTIMIZERS[spec["optimizer"]](groups, lrs[0])
    scheduler = getattr(torch.optim.lr_scheduler, spec["scheduler"])(optimizer, **spec["kwargs"])
    metrics = spec.get("metrics")

    def show():
        line = {"lr": [float(g["lr"]).hex() for g in optimizer.param_groups]}
        if "case" in spec:
            line["case"] = spec["case"]
        m = [momentum(g) for g in optimizer.param_groups]
        if all(v is not None for v in m):
            line["momentum"] = [float(v).hex() for v in m]
        print(json.dumps(line))

    show()
    for i in range(spec["steps"]):
        optimizer.step()
        if metrics is None:
            scheduler.step()
        else:
            scheduler.step(metrics[i])
        show()


def main():
    spec = json.loads(sys.argv[1])
    for one in spec if isinstance(spec, list) else [spec]:
        run(one)


main()
