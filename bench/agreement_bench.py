"""Per-step cost of ResilientRun.steps() (stop agreement + heartbeat) against a plain loop.

Two measurements, each against a baseline run in the same process:
1. micro: an empty loop body, ``for step in run.steps(N)`` vs ``for step in range(N)``: the
   per-step overhead in microseconds (1 process; and 2 gloo ranks, where it includes one
   TCPStore lookup per step).
2. fake training: 2 gloo ranks, each step a ~50 ms "compute" (sleep) plus an all_reduce, run
   alternately with and without run.steps(); the overhead as a percentage of the step.
Targets: 2-rank overhead <= 0.5 % of a 50 ms step; single process <= 20 us/step.

    python bench/agreement_bench.py [--steps 200] [--step-ms 50]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import kempner_resilience as kr
from kempner_resilience.demo.launcher import free_port

CFG = ["watchdog.hang_timeout_s=600"]


def micro(n: int) -> tuple[float, float]:
    """(plain loop us/step, run.steps() us/step) for an empty body."""
    t0 = time.perf_counter()
    for _ in range(n):
        pass
    plain = (time.perf_counter() - t0) / n * 1e6
    with kr.ResilientRun(kr.load_config(overrides=CFG)) as run:
        t0 = time.perf_counter()
        for _ in run.steps(n):
            pass
        ours = (time.perf_counter() - t0) / n * 1e6
    return plain, ours


def fake_training(steps: int, step_s: float, use_run: bool) -> float:
    """Seconds per step for `steps` steps of sleep(step_s) + an all_reduce."""
    t = torch.ones(1024)
    if use_run:
        with kr.ResilientRun(kr.load_config(overrides=CFG)) as run:
            dist.barrier()
            t0 = time.perf_counter()  # entering/leaving the run is start-up cost, not per step
            for _ in run.steps(steps):
                time.sleep(step_s)
                dist.all_reduce(t)
            took = time.perf_counter() - t0
    else:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(steps):
            time.sleep(step_s)
            dist.all_reduce(t)
        took = time.perf_counter() - t0
    return took / steps


def worker(rank: int, port: int, args: argparse.Namespace, out: "mp.Queue") -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    plain_us, ours_us = micro(args.micro_steps)
    base, with_run = [], []
    for _ in range(args.rounds):  # alternate to cancel drift of a noisy shared machine
        base.append(fake_training(args.steps, args.step_ms / 1000, False))
        with_run.append(fake_training(args.steps, args.step_ms / 1000, True))
    if rank == 0:
        out.put((plain_us, ours_us, base, with_run))
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--micro-steps", type=int, default=20000)
    args = p.parse_args()

    plain, ours = micro(args.micro_steps * 5)
    print(f"single process: plain loop {plain:.2f} us/step, run.steps() {ours:.2f} us/step, "
          f"overhead {ours - plain:.2f} us/step (target <= 20)")

    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, args, q)) for r in (0, 1)]
    for pr in procs:
        pr.start()
    plain2, ours2, base, with_run = q.get(timeout=1800)
    for pr in procs:
        pr.join()
    print(f"2 ranks, empty body: plain {plain2:.2f} us/step, run.steps() {ours2:.2f} us/step, "
          f"overhead {ours2 - plain2:.2f} us/step")
    b, w = statistics.median(base), statistics.median(with_run)
    print(f"2 ranks, {args.step_ms:.0f} ms step + all_reduce, median of {args.rounds} rounds x "
          f"{args.steps} steps: plain {b * 1e3:.3f} ms/step, run.steps() {w * 1e3:.3f} ms/step")
    print("  per-round overhead: " + ", ".join(f"{(wr / br - 1) * 100:+.2f}%"
                                                 for br, wr in zip(base, with_run)))
    print(f"  micro overhead as share of the step: {(ours2 - plain2) / (b * 1e6) * 100:.3f}% "
          f"(target <= 0.5%)")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
