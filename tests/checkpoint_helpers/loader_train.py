"""Subprocess entry point: a DDP job with dropout fed by a real DataLoader with a shuffling
``DistributedSampler``, under ResilientRun (run it with LocalLauncher, which adds --progress).

    python loader_train.py --loader stateful|resumable --steps 25 --ckpt DIR --out W.pt
        [--workers N] [--progress FILE]

``stateful``: torchdata's StatefulDataLoader put in the state as it is, the epochs driven by the
script (``sampler.set_epoch``). ``resumable``: a plain DataLoader wrapped in
``kempner_resilience.ResumableLoader``. Each rank appends ``step S idx i,j,...`` (the sample
indices it trained on) to ``seen.rank<R>`` in the working directory; rank 0 writes the final
weights and Adam state to --out.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import kempner_resilience as kr

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset  # noqa: E402

SAMPLES, BATCH = 160, 8         # 2 ranks: 10 batches per rank and epoch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--loader", choices=["stateful", "resumable"], required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--workers", type=int, default=0)
    ap.add_argument("--step-time", type=float, default=0.03)
    ap.add_argument("--progress")
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    ds = TensorDataset(torch.randn(SAMPLES, 16, generator=g), torch.randn(SAMPLES, 1, generator=g),
                       torch.arange(SAMPLES))
    sampler = DistributedSampler(ds, shuffle=True, seed=7)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1)))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    torch.manual_seed(100 + rank)        # dropout masks differ per rank
    if args.loader == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = StatefulDataLoader(ds, batch_size=BATCH, sampler=sampler,
                                    num_workers=args.workers)

        def batches():
            while True:
                yield from loader
                sampler.set_epoch(sampler.epoch + 1)
        data, stream = loader, batches()
    else:
        data = stream = kr.ResumableLoader(DataLoader(ds, batch_size=BATCH, sampler=sampler,
                                                      num_workers=args.workers))
    progress = open(args.progress, "a", buffering=1) if args.progress else None
    seen = open(f"seen.rank{rank}", "a", buffering=1)
    cfg = kr.load_config(None, [f"checkpoint.dir={args.ckpt}", "signals.grace_s=60",
                                "watchdog.hang_timeout_s=120"])
    with kr.ResilientRun(cfg, state={"model": model, "optim": optim, "data": data}) as run:
        for step, (x, y, idx) in zip(run.steps(args.steps), stream):
            time.sleep(args.step_time)
            optim.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optim.step()
            seen.write(f"step {step} idx {','.join(map(str, idx.tolist()))}\n")
            if progress is not None:
                progress.write(f"rank {rank} step {step}\n")
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "optim": optim.state_dict()}, args.out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
