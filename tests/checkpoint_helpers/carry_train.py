"""Subprocess entry point: a 2-rank DDP job with dropout, a ``kr.ResumableLoader`` over a
shuffling ``DistributedSampler``, Adam and a StepLR scheduler, written the ways users write
their loops (run it with LocalLauncher, which adds --progress).

    python carry_train.py --loop steps-first|loader-first|prefetch [--accum A [--no-sync]]
        --steps N --ckpt DIR --out W.pt [--signal-at S] [--case train|no-loop|unsaved-sched]

``--loop``: ``zip(run.steps(n), data)``, ``zip(data, run.steps(n))``, or a batch taken before
the loop and carried into the next step (nanoGPT's prefetch). ``--accum A``: ``optim.step()``
every A steps, the gradients accumulated across step boundaries in between (``--no-sync``: in
DDP's ``no_sync`` windows, each rank its own). ``--signal-at S``: rank 0 sends itself SIGUSR1
during step S of the first launch (a real signal: the run stops at an agreed boundary soon
after); ``--kill-at S``: SIGKILL instead (``--no-rescue``: the resume is from the last
periodic checkpoint, one every 7 steps). ``--case no-loop`` enters the run and never iterates ``run.steps``; ``unsaved-sched``
leaves the scheduler out of the state. Each rank appends the sample indices of each step to
``seen.rank<R>``; rank 0 writes the weights, the optimizer state and the learning rate to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import time

import kempner_resilience as kr

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

SAMPLES, BATCH = 80, 4          # 2 ranks: 10 batches per rank and epoch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loop", choices=["steps-first", "loader-first", "prefetch"],
                    default="steps-first")
    ap.add_argument("--accum", type=int, default=1)
    ap.add_argument("--no-sync", action="store_true")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--signal-at", type=int, default=-1)
    # Rank 0 dawdles this long at --signal-at before it signals itself: the other rank runs
    # ahead through the window's steps, which have no collective.
    ap.add_argument("--lag-s", type=float, default=0.0)
    ap.add_argument("--kill-at", type=int, default=-1)
    ap.add_argument("--no-rescue", action="store_true")
    ap.add_argument("--case", choices=["train", "no-loop", "unsaved-sched"], default="train")
    ap.add_argument("--progress")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(SAMPLES, 16, generator=g),
                       torch.randn(SAMPLES, 1, generator=g), torch.arange(SAMPLES))
    data = kr.ResumableLoader(DataLoader(ds, batch_size=BATCH,
                                         sampler=DistributedSampler(ds, shuffle=True, seed=7)))
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1)))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=3, gamma=0.5)
    torch.manual_seed(100 + rank)        # dropout masks differ per rank
    state = {"model": model, "optim": optim, "data": data}
    if args.case != "unsaved-sched":
        state["sched"] = sched
    progress = open(args.progress, "a", buffering=1) if args.progress else None
    seen = open(f"seen.rank{rank}", "a", buffering=1)
    cfg = kr.load_config(None, [f"checkpoint.dir={args.ckpt}", "signals.grace_s=60",
                                "watchdog.hang_timeout_s=120", "checkpoint.every_steps=7",
                                f"rescue.enabled={not args.no_rescue}"])

    def train(step: int, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> None:
        last = (step + 1) % args.accum == 0
        quiet = model.no_sync() if args.no_sync and not last else contextlib.nullcontext()
        with quiet:
            nn.functional.mse_loss(model(x), y).backward()
        if last:
            optim.step()
            sched.step()
            optim.zero_grad()
        seen.write(f"step {step} idx {','.join(map(str, idx.tolist()))}\n")
        if rank == 0 and step == args.signal_at and run.start_step == 0:
            time.sleep(args.lag_s)
            os.kill(os.getpid(), signal.SIGUSR1)
        if rank == 0 and step == args.kill_at and run.start_step == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        if progress is not None:
            progress.write(f"rank {rank} step {step}\n")

    with kr.ResilientRun(cfg, state=state) as run:
        if args.case == "no-loop":
            pass                         # the trap: the loop was never written
        elif args.loop == "steps-first":
            for step, (x, y, idx) in zip(run.steps(args.steps), data):
                train(step, x, y, idx)
        elif args.loop == "loader-first":
            for (x, y, idx), step in zip(data, run.steps(args.steps)):
                train(step, x, y, idx)
        else:
            batch = next(data)           # taken before the loop, carried into each next step
            for step in run.steps(args.steps):
                now, batch = batch, next(data)
                train(step, *now)
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "optim": optim.state_dict(),
                    "lr": optim.param_groups[0]["lr"]}, args.out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
