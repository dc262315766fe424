"""The demo's training job: a small real model trained under ResilientRun.

An MLP with dropout, Adam, a step LR schedule and a seeded shuffling data iterator, trained with
DDP over gloo when there are several ranks (``--no-ddp``: the gradients are all-reduced one
parameter at a time instead, in the same order every step; ``--hsdp S``: ``fully_shard`` on a
``("replicate", "shard")`` mesh with S ranks per replica group, HSDP). Everything that influences the
result (weights, optimizer moments, scheduler, data position, every RNG stream) goes through the
checkpoint, so an interrupted-and-resumed run ends bitwise equal to an uninterrupted one.

Run one rank per process: ``python -m kempner_resilience.demo.train --steps 40 --out w.pt``.
Rank and world come from RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT, or from SLURM's srun
variables. Prints one ``step N loss L`` line per step on rank 0 (``--quiet`` turns it off).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import sys
import time
from typing import Any

# Before torch: a SIGUSR1 that arrives while torch loads is then recorded, not fatal (see
# kempner_resilience.core.startup). Scripts copied from this one keep the order.
import kempner_resilience as kr
from kempner_resilience.core.log import configure

import torch
import torch.distributed as dist
import torch.nn as nn

__all__ = ["ShuffledBatches", "build", "allreduce_grads", "main"]


class ShuffledBatches:
    """Endless batches of a synthetic regression set, reshuffled each epoch from ``seed``.

    The order depends only on (seed, epoch), so ``state_dict`` needs just the position.
    Each rank reads its own slice of every shuffled epoch, like DistributedSampler.
    """

    def __init__(self, n: int = 512, dim: int = 16, batch: int = 16, seed: int = 0,
                 rank: int = 0, world: int = 1) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randn(n, dim, generator=g)
        self.y = (self.x @ torch.randn(dim, 1, generator=g)).tanh() + 0.1 * torch.randn(
            n, 1, generator=g)
        self.batch, self.seed, self.rank, self.world = batch, seed, rank, world
        self.epoch, self.pos = 0, 0
        self._order = self._make_order()

    def _make_order(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 100003 + self.epoch)
        return torch.randperm(len(self.x), generator=g)[self.rank::self.world]

    def __iter__(self) -> "ShuffledBatches":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pos + self.batch > len(self._order):
            self.epoch, self.pos = self.epoch + 1, 0
            self._order = self._make_order()
        idx = self._order[self.pos:self.pos + self.batch]
        self.pos += self.batch
        return self.x[idx], self.y[idx]

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.epoch, self.pos, self.seed = int(sd["epoch"]), int(sd["pos"]), int(sd["seed"])
        self._order = self._make_order()


def build(rank: int = 0, world: int = 1, hidden: int = 64, seed: int = 0, ddp: bool = True,
          hsdp: int = 0) -> dict[str, Any]:
    """Model, optimizer, scheduler and data for one rank, all seeded. ``ddp=False`` leaves the
    model unwrapped (the caller all-reduces the gradients: ``allreduce_grads``); ``hsdp=S``
    shards it with ``fully_shard`` over S ranks per replica group (ranks placed node by node:
    a ``("replicate", "shard")`` mesh whose rows are the nodes when S is the ranks per node)."""
    torch.manual_seed(seed)
    model: nn.Module = nn.Sequential(nn.Linear(16, hidden), nn.ReLU(), nn.Dropout(0.1),
                                     nn.Linear(hidden, hidden), nn.ReLU(), nn.Dropout(0.1),
                                     nn.Linear(hidden, 1))
    if hsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world // hsdp, hsdp),
                                mesh_dim_names=("replicate", "shard"))
        for layer in (model[0], model[3], model[6]):
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    elif world > 1 and ddp:
        model = nn.parallel.DistributedDataParallel(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=7, gamma=0.7)
    data = ShuffledBatches(seed=seed, rank=rank, world=world)
    # Per-rank RNG streams differ on purpose (dropout masks differ per rank, as in real runs).
    torch.manual_seed(seed + 1000 * (rank + 1))
    return {"model": model, "optim": optim, "sched": sched, "data": data}


def allreduce_grads(model: nn.Module, world: int) -> None:
    """Average the gradients over the ranks, one all-reduce per parameter.

    The summation order of each all-reduce depends only on the tensor and the world size, so it
    is the same in every step of every run, resumed or not: results stay bitwise reproducible at
    any world size. (DDP rebuilds its gradient buckets after a process's first step, so a
    resumed process reduces that step in another layout, which with 3 or more ranks can change
    the sums' last bits.)
    """
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world)


def _init_distributed() -> tuple[int, int]:
    if "SLURM_PROCID" in os.environ and "RANK" not in os.environ:
        from kempner_resilience.slurm import SlurmJob, setup_torch_env

        job = SlurmJob.from_env()
        if job is not None:
            setup_torch_env(job)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    return rank, world


def _hang_forever(hold_gil: bool = False) -> None:
    # A C call that never returns (self-deadlock on a mutex), as a stuck NCCL kernel would;
    # through PyDLL the GIL stays held across it, as in a C extension that never releases it.
    libc = ctypes.PyDLL(None) if hold_gil else ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)
    libc.pthread_mutex_init(mutex, None)
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kempner_resilience.demo.train",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="total training steps")
    p.add_argument("--config", "-c", help="YAML config")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--step-time", type=float, default=0.0,
                   help="extra seconds per step, to make the run slow enough to interrupt")
    p.add_argument("--out", help="rank 0 writes the final model weights here (torch.save)")
    p.add_argument("--hang-at", type=int, default=-1,
                   help="hang inside this step, once (see --hang-marker), to show the hang "
                        "watchdog")
    p.add_argument("--hang-marker", default="hang.done",
                   help="file created when the hang happens; no hang while it exists")
    p.add_argument("--hang-rank", type=int, default=-1,
                   help="only this rank hangs (default: every rank that gets there first)")
    p.add_argument("--hang-holds-gil", action="store_true",
                   help="hang in a C call that keeps the GIL: no Python thread runs again")
    p.add_argument("--progress", help="append 'step N' lines here as steps complete")
    p.add_argument("--no-ddp", action="store_true",
                   help="all-reduce the gradients one parameter at a time instead of wrapping "
                        "the model in DDP (bitwise reproducible at any world size)")
    p.add_argument("--hsdp", type=int, default=0, metavar="S",
                   help="shard the model with fully_shard (FSDP2) over S ranks per replica "
                        "group (HSDP) instead of DDP")
    p.add_argument("--run-files", metavar="DIR",
                   help="the demo job's bookkeeping: rank 0's run report goes to "
                        "DIR/report.<launch>.json, rank 0 writes '# run <launch>' to "
                        "--progress before this launch's steps, and each rank its pid to "
                        "DIR/worker.<launch>.<rank>; <launch> is SLURM's restart "
                        "count, or with --named-launches <requeues>.<relaunches in place>")
    p.add_argument("--named-launches", action="store_true")
    p.add_argument("--quiet", action="store_true")
    return p.parse_args(argv)


def _mark_launch(args: argparse.Namespace) -> None:
    """What the demo job's shell line did before the trainer started, done here so a worker
    can be this module run by Python directly (a torchrun agent forks such a worker warm)."""
    from kempner_resilience.supervise.channel import launch_name

    launch = launch_name() if args.named_launches else \
        (os.environ.get("SLURM_RESTART_COUNT") or "0")
    os.environ["KEMPNER_RESILIENCE_REPORT"] = os.path.join(args.run_files,
                                                           f"report.{launch}.json")
    rank = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0"))
    with open(os.path.join(args.run_files, f"worker.{launch}.{rank}"), "w") as f:
        f.write(f"{os.getpid()}\n")
    if args.progress and rank == "0":
        with open(args.progress, "a") as f:
            f.write(f"# run {launch}\n")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.run_files:
        _mark_launch(args)
    configure("WARNING" if args.quiet else "INFO")
    rank, world = _init_distributed()
    cfg = kr.load_config(args.config, args.overrides)
    state = build(rank, world, ddp=not args.no_ddp, hsdp=args.hsdp)
    model, optim, sched, data = state["model"], state["optim"], state["sched"], state["data"]
    loss_fn = nn.MSELoss()
    progress = open(args.progress, "a", buffering=1) if args.progress else None
    with kr.ResilientRun(cfg, state=state) as run:
        if run.resumed_from is not None and rank == 0 and not args.quiet:
            print(f"resumed at step {run.start_step}", flush=True)
        for step in run.steps(args.steps):
            if step == args.hang_at and not os.path.exists(args.hang_marker) and \
                    args.hang_rank in (-1, rank):
                if rank == max(args.hang_rank, 0):
                    open(args.hang_marker, "w").close()
                _hang_forever(args.hang_holds_gil)
            if args.step_time:
                # The stand-in for a step's compute: before the gradient all-reduce, where a
                # real step spends its time (a node that dies mid-step dies there too).
                time.sleep(args.step_time)
            x, y = next(data)
            optim.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            if world > 1 and args.no_ddp:
                allreduce_grads(model, world)
            optim.step()
            sched.step()
            if progress is not None:
                progress.write(f"rank {rank} step {step}\n")
            if rank == 0 and not args.quiet:
                print(f"step {step} loss {loss.item():.6f}", flush=True)
    if args.out and args.hsdp:
        # The full weights and optimizer state, gathered from the shards (every rank takes part).
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_model_state_dict,
                                                             get_optimizer_state_dict)
        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = {"model": get_model_state_dict(model, options=opts),
                "optim": get_optimizer_state_dict(model, optim, options=opts)}
        if rank == 0:
            torch.save(full, args.out)
    elif args.out and rank == 0:
        inner = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
        torch.save({"model": inner.state_dict(), "optim": optim.state_dict()}, args.out)
    if world > 1:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
