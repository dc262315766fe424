"""An Accelerate script written the library's documented way, adopted in three marked lines.
Rank 0 saves the final model, optimizer, scheduler and RNG to --out; each step is a line in
--progress (``rank R step S``). Config: $KEMPNER_RESILIENCE_CONFIG."""

import argparse
import time

import kempner_resilience as kr                                         # first, before torch
from kempner_resilience.trainers.accelerate import ResilientAccelerate  # marked
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=40)
ap.add_argument("--out")
ap.add_argument("--progress")
ap.add_argument("--step-s", type=float, default=0.05)
args = ap.parse_args()

accelerator = Accelerator()
set_seed(0)
data = TensorDataset(torch.randn(256, 16), torch.randn(256, 1))
loader = DataLoader(data, batch_size=8, shuffle=True)
model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(optim, step_size=7, gamma=0.5)
model, optim, loader, sched = accelerator.prepare(model, optim, loader, sched)
progress = open(args.progress, "a", buffering=1) if args.progress else None

run = ResilientAccelerate(None, accelerator, state={"model": model, "optim": optim,  # marked
                                                    "sched": sched, "data": loader})
with run:                                                                             # marked
    for step, (x, y) in zip(run.steps(args.steps), run.data):                        # marked
        optim.zero_grad()
        accelerator.backward(nn.functional.mse_loss(model(x), y))
        optim.step()
        sched.step()
        time.sleep(args.step_s)
        if progress:
            progress.write(f"rank {accelerator.process_index} step {step}\n")

if accelerator.is_main_process and args.out:
    torch.save({"model": accelerator.unwrap_model(model).state_dict(),
                "optim": optim.state_dict(), "sched": sched.state_dict(),
                "rng": torch.get_rng_state()}, args.out)
