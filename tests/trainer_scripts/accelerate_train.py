"""An Accelerate script written the library's documented way, adopted in three marked lines.
Rank 0 saves the final model, optimizer, scheduler and RNG to --out; each step is a line in
--progress (``rank R step S``). Config: $KEMPNER_RESILIENCE_CONFIG."""

import argparse
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

PLAIN = "--plain" in sys.argv       # the script as it was before (bench/trainers_bench.py)
if not PLAIN:
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
ap.add_argument("--rewards", action="store_true", help="Flow-Factory's reward thread pool")
ap.add_argument("--sched-outside-state", action="store_true",
                help="the LR scheduler left out of the run's state (a resume restarts it)")
ap.add_argument("--plain", action="store_true", help="without the package: Accelerate alone")
ap.add_argument("--times", help="rank 0 appends each step's end (time.perf_counter) here")
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

times = open(args.times, "a", buffering=1) if args.times and accelerator.is_main_process \
    else None


def train(step, x, y, pool=None):
    if pool is not None:
        for _ in range(4):
            pool.submit(lambda t=x.clone(): (time.sleep(0.2), t.sum()))
    optim.zero_grad()
    accelerator.backward(nn.functional.mse_loss(model(x), y))
    optim.step()
    sched.step()
    time.sleep(args.step_s)
    if progress:
        progress.write(f"rank {accelerator.process_index} step {step}\n")
    if times:
        times.write(f"{time.perf_counter()}\n")


def epochs():
    while True:
        yield from loader


if PLAIN:
    for step, (x, y) in zip(range(args.steps), epochs()):
        train(step, x, y)
    sys.exit(0)
state = {"model": model, "optim": optim, "sched": sched, "data": loader}
if args.sched_outside_state:
    del state["sched"]
run = ResilientAccelerate(None, accelerator, state=state)                            # marked
if args.progress:       # which process is which rank, for a test that signals one
    with open(f"{args.progress}.pid{accelerator.process_index}", "w") as f:
        f.write(str(os.getpid()))
with run:                                                                             # marked
    pool = None
    if args.rewards:    # each step queues reward work holding tensors, as Flow-Factory does
        pool = run.add_executor(ThreadPoolExecutor(2), name="rewards")
    for step, (x, y) in zip(run.steps(args.steps), run.data):                        # marked
        train(step, x, y, pool)

if accelerator.is_main_process and args.out:
    torch.save({"model": accelerator.unwrap_model(model).state_dict(),
                "optim": optim.state_dict(), "sched": sched.state_dict(),
                "rng": torch.get_rng_state()}, args.out)
