"""A sharded training job for the rescue tests: a small MLP with dropout under ``fully_shard``
(FSDP2) on a 2-D ``("replicate", "shard")`` mesh (``--mesh hsdp``: HSDP, 2 replica groups) or a
1-D mesh (``--mesh fsdp``: pure FSDP, no replica), AdamW, a step LR schedule, a shuffled per-rank
data iterator and per-rank dropout streams, on ``WORLD_SIZE`` gloo ranks (CPU). The model and
optimizer go to ResilientRun as the user holds them. In the first launch only
(``KEMPNER_RESTART_COUNT`` 0), as a real failure would, once:

    --kill-at R[,R...]:S
                      rank R (each of them) SIGKILLs itself in step S after its forward pass
                      (the others are in the backward's reduce-scatter or all-reduce)
    --hang-at R:S     rank R hangs in step S after its forward pass, in a C call that holds
                      the GIL (the others wait in a collective until their hang watchdog)

Launched by ``LocalLauncher`` or srun (rank, world and port from the environment); every rank
takes part in gathering the full weights and optimizer state at the end, and rank 0 writes them
to ``--out``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import kempner_resilience as kr  # noqa: E402
from kempner_resilience.core.log import configure  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from fsdp_job import build, full_state  # noqa: E402  (the same model, mesh and data as the save tests)


def _hang_holding_the_gil() -> None:
    # PyDLL keeps the GIL across the call: no Python thread of this process runs again.
    libc = ctypes.PyDLL(None)
    mutex = ctypes.create_string_buffer(64)
    libc.pthread_mutex_init(mutex, None)
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--mesh", choices=("fsdp", "hsdp"), default="hsdp")
    p.add_argument("--out", required=True)
    p.add_argument("--kill-at")
    p.add_argument("--hang-at")
    p.add_argument("--progress")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()
    configure("INFO")
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    first = os.environ.get("KEMPNER_RESTART_COUNT", os.environ.get("SLURM_RESTART_COUNT",
                                                                   "0")) == "0"
    kill_ranks, kill_step = [], -1
    if first and args.kill_at:
        ranks, at = args.kill_at.split(":")
        kill_ranks, kill_step = [int(r) for r in ranks.split(",")], int(at)
    hang = (-1, -1)
    if first and args.hang_at:
        hang = tuple(int(v) for v in args.hang_at.split(":"))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    state = build(rank, world, args.mesh)
    model, optim, sched, data = state["model"], state["optim"], state["sched"], state["data"]
    progress = open(args.progress, "a", buffering=1) if args.progress else None
    cfg = kr.load_config(None, args.overrides)
    with kr.ResilientRun(cfg, state=state) as run:
        for step in run.steps(args.steps):
            x, y = next(data)
            optim.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if step == kill_step and rank in kill_ranks:
                os.kill(os.getpid(), signal.SIGKILL)
            if (rank, step) == hang:
                _hang_holding_the_gil()
            loss.backward()
            optim.step()
            sched.step()
            if progress is not None:
                progress.write(f"rank {rank} step {step}\n")
    full = full_state(model, optim)
    if rank == 0:
        torch.save(full, args.out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
