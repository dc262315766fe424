"""Per-step cost of remaining-time tracking and the run ledger, single process.

1. ``run.steps()`` with an empty body: without an end time (the clock inert), and with one far in
   the future (``SLURM_JOB_END_TIME``: every boundary compares ``time.monotonic()`` with the stop
   threshold and measures the step), against a plain ``range`` loop; microseconds per step.
2. One ledger event (one ``write()`` of one JSON line with ``O_APPEND``), microseconds: the
   ledger writes only at events (start, resume, saves, stop, exit), never per step.
Target: no measurable change to the guard overhead, <= 20 us per step.

    python bench/clock_ledger_bench.py [--steps 200000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import kempner_resilience as kr
from kempner_resilience.core.ledger import Ledger

CFG = ["watchdog.hang_timeout_s=600"]


def loop_us(n: int, end_time: float | None) -> tuple[float, float]:
    """(plain us/step, run.steps() us/step)."""
    os.environ.pop("SLURM_JOB_END_TIME", None)
    if end_time is not None:
        os.environ["SLURM_JOB_END_TIME"] = str(int(end_time))
    t0 = time.perf_counter()
    for _ in range(n):
        pass
    plain = (time.perf_counter() - t0) / n * 1e6
    with kr.ResilientRun(kr.load_config(overrides=CFG), exit_mode="raise") as run:
        assert (run.time_remaining() is None) == (end_time is None)
        t0 = time.perf_counter()
        for _ in run.steps(n):
            pass
        ours = (time.perf_counter() - t0) / n * 1e6
    os.environ.pop("SLURM_JOB_END_TIME", None)
    return plain, ours


def ledger_us(n: int) -> float:
    with tempfile.TemporaryDirectory() as d:
        ledger = Ledger(os.path.join(d, "ledger.jsonl"), run_id="20261123-120000-abcdef12")
        ledger.event("start", t0=time.time())
        t0 = time.perf_counter()
        for i in range(n):
            ledger.event("save", step=i, reason="periodic", blocking_s=0.1234, bytes=123456789,
                         bw_mib_s=1234.5)
        took = (time.perf_counter() - t0) / n * 1e6
        ledger.close()
        size = os.path.getsize(os.path.join(d, "ledger.jsonl")) / (n + 1)
    print(f"ledger: {took:.1f} us per event, {size:.0f} bytes per save event")
    return took


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200_000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    off, on = [], []
    for _ in range(args.rounds):       # alternate: a shared machine drifts
        plain, ours = loop_us(args.steps, None)
        off.append(ours - plain)
        plain, ours = loop_us(args.steps, time.time() + 86400)
        on.append(ours - plain)
    print(f"steps() overhead, no end time:   median {statistics.median(off):.2f} us/step "
          f"(rounds: {', '.join(f'{x:.2f}' for x in off)})")
    print(f"steps() overhead, with end time: median {statistics.median(on):.2f} us/step "
          f"(rounds: {', '.join(f'{x:.2f}' for x in on)})")
    print(f"time tracking costs {statistics.median(on) - statistics.median(off):+.2f} us/step")
    ledger_us(20_000)


if __name__ == "__main__":
    main()
