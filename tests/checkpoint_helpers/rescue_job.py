"""The demo job (``kempner_resilience.demo.train``'s state: a DDP MLP with dropout, Adam, a step
LR schedule, a shuffled data iterator, per-rank RNG streams) under ResilientRun, with ways for
one rank to fail in the first launch only (``KEMPNER_RESTART_COUNT`` 0), as a real failure
would, once:

    --kill-at R:S         rank R SIGKILLs itself in step S after its forward pass: the others are
                          waiting in the gradient all-reduce
    --kill-in-optim R:S   with --optim-collective, rank R SIGKILLs itself inside its optimizer
                          step S: the others fail inside optimizer.step()
    --kill-after-step R:S rank R SIGKILLs itself in step S after its optimizer step, before the
                          step's boundary: the others are past the all-reduce it fed, one
                          boundary ahead of anything it sent
    --hang-at R:S         rank R hangs in step S in a C call that holds the GIL
    --wait-forever R:S    rank R waits in step S before its forward pass without end, the GIL free
                          (as NCCL leaves a rank in a collective whose peer is gone: gloo would
                          fail it), in every launch: its hang watchdog decides
    --stall-until-claim R:S
                          rank R stalls in step S before its forward pass (a sleep: the GIL is
                          free, as in a data-loader or NFS stall) until a rescue claim appears
                          in the checkpoint directory, then 0.05 s more, and goes on
    --slow-rescue-write T the rescue's checkpoint writer sleeps T s before writing its data
                          (slow storage), in every launch
    --optim-collective    every optimizer step starts with an all-reduce on its own gloo group
                          (as an optimizer that syncs a global norm would), in every launch
    --ballast-mb N        an extra replicated module holding N MB (a rescue that takes a while)
    --no-ddp-unsynced     no DDP, and each rank's model seeded differently: not replicas
    --raise-at R:S        rank R raises RuntimeError in step S, in every launch (a bug)
    --exit-at R:S         rank R calls sys.exit(0) in step S, in every launch (it leaves the
                          loop early)
    --break-at R:S        rank R breaks out of ``run.steps`` in step S, in every launch (it
                          leaves the loop early and ends its script normally)

The first launch is the one with none of ``KEMPNER_RESTART_COUNT``, ``SLURM_RESTART_COUNT`` (a
plain ``srun`` job's requeue) and ``KEMPNER_RESILIENCE_IN_JOB_RESTART`` (the srun step loop's
relaunch in place) above 0.

Launched by ``LocalLauncher`` (rank, world and port from the environment, ``--progress``
appended); rank 0 writes the final weights to ``--out``.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import kempner_resilience as kr  # noqa: E402
from kempner_resilience.demo.train import build  # noqa: E402
from kempner_resilience.core.log import configure  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402


def _at(text: str | None) -> tuple[int, int]:
    if not text:
        return -1, -1
    r, s = text.split(":")
    return int(r), int(s)


def _hang_holding_the_gil() -> None:
    # PyDLL keeps the GIL across the call: no Python thread of this process runs again.
    libc = ctypes.PyDLL(None)
    mutex = ctypes.create_string_buffer(64)
    libc.pthread_mutex_init(mutex, None)
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)


def _stall_until_claim(ckpt_dir: str) -> None:
    # Bounded: a rescue claims within seconds of the hang watchdog firing, or never will.
    end = time.monotonic() + 120.0
    while time.monotonic() < end and not list(Path(ckpt_dir).glob(".rescue/*/claim")):
        time.sleep(0.001)
    time.sleep(0.05)


def _slow_rescue_writes(seconds: float) -> None:
    from kempner_resilience.rescue import save

    class SlowWriter(save.ChecksummingWriter):
        def write_data(self, plan, planner):
            time.sleep(seconds)
            return super().write_data(plan, planner)

    save.ChecksummingWriter = SlowWriter


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--progress")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--step-time", type=float, default=0.0)
    p.add_argument("--kill-at")
    p.add_argument("--kill-in-optim")
    p.add_argument("--kill-after-step")
    p.add_argument("--hang-at")
    p.add_argument("--stall-until-claim")
    p.add_argument("--wait-forever")
    p.add_argument("--slow-rescue-write", type=float, default=0.0)
    p.add_argument("--optim-collective", action="store_true")
    p.add_argument("--ballast-mb", type=int, default=0)
    p.add_argument("--no-ddp-unsynced", action="store_true")
    p.add_argument("--raise-at")
    p.add_argument("--exit-at")
    p.add_argument("--break-at")
    args = p.parse_args()
    configure("INFO")
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    first = all(os.environ.get(v, "0") in ("", "0") for v in (
        "KEMPNER_RESTART_COUNT", "SLURM_RESTART_COUNT", "KEMPNER_RESILIENCE_IN_JOB_RESTART"))
    bug, leave, forever = _at(args.raise_at), _at(args.exit_at), _at(args.wait_forever)
    early = _at(args.break_at)
    kill, kill_optim, kill_after, hang, stall = (
        _at(a) if first else (-1, -1)
        for a in (args.kill_at, args.kill_in_optim, args.kill_after_step, args.hang_at,
                  args.stall_until_claim))
    if args.slow_rescue_write:
        _slow_rescue_writes(args.slow_rescue_write)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    if args.no_ddp_unsynced:
        state = build(rank, world, seed=rank, ddp=False)
    else:
        state = build(rank, world)
    if args.ballast_mb:
        ballast = nn.Module()
        ballast.weight = nn.Parameter(torch.zeros(args.ballast_mb << 18), requires_grad=False)
        state["ballast"] = ballast
    model, optim, sched, data = state["model"], state["optim"], state["sched"], state["data"]
    step_now = [-1]
    if args.optim_collective:
        group = dist.new_group(backend="gloo")

        def sync(*_args: object) -> None:
            if (rank, step_now[0]) == kill_optim:
                os.kill(os.getpid(), signal.SIGKILL)
            dist.all_reduce(torch.ones(1), group=group)

        optim.register_step_pre_hook(sync)
    progress = open(args.progress, "a", buffering=1) if args.progress else None
    cfg = kr.load_config(None, args.overrides)
    with kr.ResilientRun(cfg, state=state) as run:
        for step in run.steps(args.steps):
            step_now[0] = step
            if (rank, step) == bug:
                raise RuntimeError(f"a bug on rank {rank} at step {step}")
            if (rank, step) == leave:
                sys.exit(0)
            if (rank, step) == early:
                break
            if (rank, step) == forever:
                while True:
                    time.sleep(1.0)
            if (rank, step) == hang:
                _hang_holding_the_gil()
            if (rank, step) == stall:
                _stall_until_claim(cfg.checkpoint.dir)
            x, y = next(data)
            optim.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if (rank, step) == kill:
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            optim.step()
            sched.step()
            if (rank, step) == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
            if args.step_time:
                time.sleep(args.step_time)
            if progress is not None:
                progress.write(f"rank {rank} step {step}\n")
    if rank == 0:
        inner = getattr(model, "module", model)
        torch.save({"model": inner.state_dict(), "optim": optim.state_dict()}, args.out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # All work is on disk: skip torch's interpreter finalisation, which once aborted a rank of
    # the 4-rank reference run under full-suite load ("terminate called without an active
    # exception", gloo teardown) after it had finished and written everything.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
