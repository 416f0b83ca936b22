"""From Python Accelerate to C++ and back: the Python half of examples/accelerate_interop.cc.

  accelerate_interop.py start WORK      Accelerate trains 10 steps and saves_state (automatic
                                        naming: WORK/python/checkpoints/checkpoint_0).
  accelerate_interop.py finish WORK     accelerator.load_state(WORK/back_to_python), written by
                                        the C++ program after 10 more steps, and 10 more in
                                        Python; then the same 30 steps in Python alone, and the
                                        two are compared.
"""
import os
import sys

import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration


def batch(k):
    # The same numbers in Python and C++ (examples/accelerate_interop.cc).
    x = torch.linspace(-1, 1, 32).reshape(8, 4) * ((k % 5) + 1) / 5
    return x, x.sum(1, keepdim=True).sin()


def make(project=None):
    config = ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True) \
        if project else None
    accelerator = Accelerator(project_config=config, cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)  # as Accelerate's guide does
    return accelerator, model, optimizer, scheduler


def train(accelerator, model, optimizer, scheduler, steps):
    start = accelerator.step  # counts the steps of accumulate(), restored by load_state
    for k in range(start, start + steps):
        x, y = batch(k)
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(x), y)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return loss.item()


mode, work = sys.argv[1:3]
if mode == "start":
    run = make(os.path.join(work, "python"))
    loss = train(*run, 10)
    run[0].save_state()
    print("  Python: 10 steps with accelerate (loss %.6f), save_state() -> %s" %
          (loss, os.path.join(work, "python", "checkpoints", "checkpoint_0")))
else:
    run = make()
    run[0].load_state(os.path.join(work, "back_to_python"))
    print("  Python: load_state(back_to_python): step %d, lr %g" %
          (run[0].step, run[3].get_last_lr()[0]))
    loss = train(*run, 10)
    alone = make()
    alone_loss = train(*alone, 30)
    diff = max((a - b).abs().max().item()
               for a, b in zip(run[1].parameters(), alone[1].parameters()))
    print("  Python: 10 more steps (loss %.6f); the same 30 steps in Python alone: loss %.6f" %
          (loss, alone_loss))
    ok = diff < 1e-6 and run[3].get_last_lr() == alone[3].get_last_lr()
    print("  [%s] Python -> C++ -> Python ends where Python alone does: parameters within %.2g "
          "(the C++ steps use LibTorch's AdamW kernel), same learning rate %g" %
          ("ok" if ok else "FAILED", diff, run[3].get_last_lr()[0]))
    sys.exit(0 if ok else 1)
