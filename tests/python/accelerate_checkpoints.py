"""Checkpoints of the real Python Accelerate for tests/accelerate_interop_test.cc, and the Python
side of its export checks.

  accelerate_checkpoints.py write OUT
      For each optimizer of CONFIGS: the model trained 3 steps with it (and, for adamw, a StepLR
      registered for checkpointing, as Accelerate's guide does), saved by accelerator.save_state
      to OUT/<name>; OUT/<name>.reference.safetensors holds what was saved (parameters,
      optimizer state by group and position, torch's RNG state). Then variants of OUT/adamw:
      with a GradScaler's scaler.pt; hostile ones: a missing optimizer.bin, a pickle with a
      global torchpoint must not read, a CUDA RNG state, a damaged record, an unclaimed extra
      file.
  accelerate_checkpoints.py check NAME DIR REFERENCE [NAME DIR REFERENCE ...]
      accelerator.load_state(DIR) into fresh objects of CONFIGS[NAME], for each triple; exits 1
      naming every value that differs from its REFERENCE (written by the C++ test in the same
      layout).
  accelerate_checkpoints.py check_scaler DIR SCALE TRACKER
      torch.amp.GradScaler("cpu") loads DIR/scaler.pt (weights_only=True) with that state.
"""
import collections
import os
import shutil
import sys
import zipfile

import torch
from safetensors.torch import load_file, save_file


def model():
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def sgd(m):
    weights = [p for n, p in m.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in m.named_parameters() if n.endswith("bias")]
    return torch.optim.SGD([{"params": weights},
                            {"params": biases, "lr": 0.05, "weight_decay": 0.001}],
                           lr=0.1, momentum=0.9, nesterov=True)


# The optimizers, as tests/accelerate_interop_test.cc builds them in LibTorch.
CONFIGS = {
    "sgd": sgd,
    "adam": lambda m: torch.optim.Adam(m.parameters(), lr=1e-2, amsgrad=True),
    "adamw": lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01),
    "rmsprop": lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-2, momentum=0.5,
                                             centered=True),
    "adagrad": lambda m: torch.optim.Adagrad(m.parameters(), lr=0.1, lr_decay=0.01),
}


def make(name):
    from accelerate import Accelerator
    accelerator = Accelerator(cpu=True)
    m = model()
    opt = CONFIGS[name](m)
    m, opt = accelerator.prepare(m, opt)
    scheduler = None
    if name == "adamw":
        scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        accelerator.register_for_checkpointing(scheduler)
    return accelerator, m, opt, scheduler


def reference(m, opt, scheduler):
    out = {}
    for n, p in m.named_parameters():
        out["model." + n] = p.detach().clone()
    state = opt.state_dict()
    where = {}
    for g, group in enumerate(state["param_groups"]):
        out["optimizer.lr.%d" % g] = torch.tensor([group["lr"]], dtype=torch.float64)
        for i, index in enumerate(group["params"]):
            where[index] = (g, i)
    for index, fields in state["state"].items():
        g, i = where[index]
        for key, value in fields.items():
            if value is None:
                continue
            if key == "step":
                value = torch.tensor([int(value.item())], dtype=torch.long)
            out["optimizer.state.%d.%d.%s" % (g, i, key)] = value.clone()
    if scheduler is not None:
        out["scheduler.last_epoch"] = torch.tensor([scheduler.last_epoch], dtype=torch.long)
    out["rng"] = torch.get_rng_state()
    return out


def write(out_dir):
    shutil.rmtree(out_dir, ignore_errors=True)
    os.makedirs(out_dir)
    torch.manual_seed(123)
    xs = [torch.randn(5, 4) for _ in range(3)]
    ys = [torch.randn(5, 2) for _ in range(3)]
    for name in CONFIGS:
        torch.manual_seed(0)
        accelerator, m, opt, scheduler = make(name)
        for x, y in zip(xs, ys):
            loss = torch.nn.functional.mse_loss(m(x), y)
            accelerator.backward(loss)
            opt.step()
            if scheduler is not None:
                scheduler.step()
            opt.zero_grad()
        directory = os.path.join(out_dir, name)
        accelerator.save_state(directory)
        save_file(reference(m, opt, scheduler), directory + ".reference.safetensors")

    source = os.path.join(out_dir, "adamw")

    def variant(name):
        path = os.path.join(out_dir, name)
        shutil.copytree(source, path)
        return path

    os.remove(os.path.join(variant("missing_optimizer"), "optimizer.bin"))
    # A Python object torchpoint must not read: the pickle names collections.deque.
    path = variant("forbidden_global")
    torch.save({"last_epoch": 3, "queue": collections.deque([1, 2])},
               os.path.join(path, "custom_checkpoint_0.pkl"))
    # A GPU run's random states.
    path = variant("cuda_rng")
    rng_file = os.path.join(path, "random_states_0.pkl")
    states = torch.load(rng_file, weights_only=False)
    states["torch_cuda_manual_seed"] = [torch.zeros(16, dtype=torch.uint8)]
    torch.save(states, rng_file)
    # One bit of a stored tensor flipped: its zip CRC no longer matches.
    path = variant("damaged")
    opt_file = os.path.join(path, "optimizer.bin")
    with zipfile.ZipFile(opt_file) as z:
        info = z.getinfo("optimizer/data/1")
        header = info.header_offset
    data = bytearray(open(opt_file, "rb").read())
    name_len = int.from_bytes(data[header + 26:header + 28], "little")
    extra_len = int.from_bytes(data[header + 28:header + 30], "little")
    data[header + 30 + name_len + extra_len] ^= 0x10
    open(opt_file, "wb").write(bytes(data))
    # A GradScaler's state beside the rest, as Accelerate writes it with mixed precision.
    path = variant("with_scaler")
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=7)
    state = scaler.state_dict()
    state["_growth_tracker"] = 3
    torch.save(state, os.path.join(path, "scaler.pt"))
    # A second optimizer's file that no prepared optimizer takes.
    path = variant("extra_optimizer")
    shutil.copy(os.path.join(path, "optimizer.bin"), os.path.join(path, "optimizer_1.bin"))


def check(name, directory, reference_path):
    """Problems found loading one checkpoint (none: prints how many values matched)."""
    accelerator, m, opt, scheduler = make(name)
    accelerator.load_state(directory)
    got = reference(m, opt, scheduler)
    want = load_file(reference_path)
    problems = []
    for key in sorted(set(got) | set(want)):
        if key not in got or key not in want:
            problems.append("%s %s: only in %s" % (name, key, "C++" if key in want else "Python"))
        elif got[key].dtype != want[key].dtype or not torch.equal(got[key], want[key]):
            problems.append("%s %s: Python %s, C++ %s"
                            % (name, key, got[key].tolist(), want[key].tolist()))
    if not problems:
        print("%s: %d values identical" % (name, len(got)))
    return problems


def check_scaler(directory, scale, tracker):
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(torch.load(os.path.join(directory, "scaler.pt"), weights_only=True))
    state = scaler.state_dict()
    if state["scale"] != float(scale) or state["_growth_tracker"] != int(tracker):
        sys.exit("scaler: %s, expected scale %s and _growth_tracker %s" % (state, scale, tracker))
    print("scaler: %s" % state)


if sys.argv[1] == "write":
    write(sys.argv[2])
elif sys.argv[1] == "check":
    # One or more NAME DIRECTORY REFERENCE triples, in one interpreter: importing torch and
    # accelerate costs seconds of CPU each time.
    triples = sys.argv[2:]
    if not triples or len(triples) % 3:
        sys.exit(__doc__)
    problems = []
    for at in range(0, len(triples), 3):
        problems += check(*triples[at:at + 3])
    if problems:
        print("\n".join(problems))
        sys.exit(1)
elif sys.argv[1] == "check_scaler":
    check_scaler(sys.argv[2], sys.argv[3], sys.argv[4])
else:
    sys.exit(__doc__)
