"""Subprocess entry point: train a small DDP model on ``WORLD_SIZE`` gloo ranks, optionally
resuming first and saving after ``--save-at`` steps, then dump rank 0's weights and Adam state.

    RANK=0 WORLD_SIZE=3 MASTER_ADDR=127.0.0.1 MASTER_PORT=... python ddp_train.py --dir D
        --steps 8 [--save-at 4] [--resume] [--bucket-cap-mb 0.01] [--static-graph]
        [--find-unused] [--comm-hook] [--no-ddp-buckets] --out OUT   (rank 0 writes OUT)

With ``--bucket-cap-mb`` small, DDP's rebuilt layout has several buckets. Prints DDP's logged
bucket layout as ``layout <text>`` after the last step.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from kempner_resilience.checkpoint import CheckpointManager  # noqa: E402
from kempner_resilience.config import CheckpointConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--save-at", type=int, default=-1)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--bucket-cap-mb", type=float, default=None)
    ap.add_argument("--static-graph", action="store_true")
    ap.add_argument("--find-unused", action="store_true")
    ap.add_argument("--comm-hook", action="store_true")
    ap.add_argument("--grad-as-bucket-view", action="store_true")
    ap.add_argument("--freeze-first", action="store_true",
                    help="the first layer does not train (DDP then reduces 4 parameters, not 6)")
    ap.add_argument("--no-ddp-buckets", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 48), nn.Tanh(), nn.Linear(48, 48), nn.Tanh(),
                          nn.Linear(48, 4))
    if args.freeze_first:
        model[0].requires_grad_(False)
    kw = {} if args.bucket_cap_mb is None else {"bucket_cap_mb": args.bucket_cap_mb}
    kw["gradient_as_bucket_view"] = args.grad_as_bucket_view
    ddp = nn.parallel.DistributedDataParallel(model, static_graph=args.static_graph,
                                              find_unused_parameters=args.find_unused, **kw)
    if args.comm_hook:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        ddp.register_comm_hook(None, allreduce_hook)
    optim = torch.optim.Adam(ddp.parameters(), lr=1e-2)
    cfg = CheckpointConfig(dir=args.dir)
    if args.no_ddp_buckets:
        cfg.ddp_buckets = False
    # A frozen layer has no optimizer state: a resume leaves the checkpoint's out, which is
    # refused unless asked for (a partial resume; see statekeys).
    cfg.allow_partial_resume = args.freeze_first
    mgr = CheckpointManager(cfg, {"model": ddp, "optim": optim}, rank=rank, world_size=world)
    start = 0
    if args.resume:
        info = mgr.resume()
        assert info is not None, "expected a checkpoint to resume from"
        start = info.step
    g = torch.Generator().manual_seed(1000 + rank)
    for _ in range(start):      # the data of the steps already trained
        torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
    for step in range(start, args.steps):
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
        optim.zero_grad()
        ((ddp(x) - y) ** 2).mean().backward()
        optim.step()
        mgr.maybe_save(step + 1)
        if step + 1 == args.save_at:
            mgr.save(step + 1)
    mgr.close()
    if rank == 0:
        print("layout", ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices"),
              flush=True)
        torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
