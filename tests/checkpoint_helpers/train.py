"""Subprocess entry point: train the toy for ``--steps`` steps on ``WORLD_SIZE`` gloo ranks,
optionally resuming first and saving after ``--save-at`` steps, then dump a snapshot.

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=... python train.py --dir D --steps 10
        [--save-at 4] [--resume] [--async] --out OUT   (writes OUT.rank<r>.pt)
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from checkpoint_helpers import toy  # noqa: E402
from kempner_resilience.checkpoint import CheckpointManager  # noqa: E402
from kempner_resilience.config import CheckpointConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--save-at", type=int, default=-1)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--async", dest="async_", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    state = toy.build(rank, ddp=world > 1)
    cfg = CheckpointConfig(dir=args.dir, keep_last=3, **{"async_": args.async_})
    mgr = CheckpointManager(cfg, state, rank=rank, world_size=world)
    mgr.check_dir()
    start = 0
    if args.resume:
        info = mgr.resume()
        assert info is not None, "expected a checkpoint to resume from"
        start = info.step
    for step in range(start, args.steps):
        toy.train_step(state)
        if step + 1 == args.save_at:
            if args.async_:
                cfg.every_steps = args.save_at
                mgr.maybe_save(step + 1)
                cfg.every_steps = 0
            else:
                mgr.save(step + 1)
    mgr.close()
    torch.save(toy.snapshot(state), f"{args.out}.rank{rank}.pt")
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
