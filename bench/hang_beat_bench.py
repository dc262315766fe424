"""Per-beat cost of the hang watchdog, single process, microseconds.

``HangWatchdog.beat()`` runs at every step boundary. Most beats only store a timestamp; one
every ``rearm_every_s`` (0.5 s) moves the deadline of the Python thread and of the GIL-free
backstop. Measured: the plain beat (a tight loop: almost all beats take the cheap path), and the
forced beat (``beat(force=True)``, what ``busy()`` and every re-arm pay). Target: the
backstop's re-arm stays about 1 us.

    python bench/hang_beat_bench.py [--beats 200000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from kempner_resilience.stop.watchdog import HangWatchdog


def per_call_us(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--beats", type=int, default=200_000)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    wd = HangWatchdog(600.0).start()
    backstop = wd._backstop
    try:
        plain = [per_call_us(wd.beat, args.beats) for _ in range(args.rounds)]
        forced = [per_call_us(lambda: wd.beat(force=True), args.beats // 10)
                  for _ in range(args.rounds)]
        arm = [per_call_us(lambda: backstop.arm(600.0), args.beats) for _ in range(args.rounds)]
    finally:
        wd.stop()
    print(f"backstop: {type(backstop).__name__}")
    print(f"beat():            {statistics.median(plain):.3f} us (median of {args.rounds})")
    print(f"beat(force=True):  {statistics.median(forced):.3f} us")
    print(f"backstop.arm():    {statistics.median(arm):.3f} us")


if __name__ == "__main__":
    main()
