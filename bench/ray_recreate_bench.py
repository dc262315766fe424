"""A lost Ray worker group's recreation, cold against warm (``supervise/ray/parking.py``).

The driver-loop job of the tests (``tests/ray_loop_job.py``: a 2-actor policy group, a 1-actor
reference group, gloo on CPU, a 0.1 s step, a commit every 10 steps) under ``supervise_loop``;
policy rank 1 is SIGKILLed at step 13. Measured: the kill to the first step of the recreated
groups (rank 0's first ``train_step`` after the kill), in three modes, interleaved:

* ``cold``: every actor of every group a new process (``WorkerGroup(warm=False)``);
* ``warm``: the live actors parked and reborn, the killed one a new process;
* ``spare``: as ``warm``, with one spare policy actor made ahead of need.

    python bench/ray_recreate_bench.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOB = REPO / "tests" / "ray_loop_job.py"
MODES = {"cold": ["--cold"], "warm": [], "spare": ["--spares", "1"]}


def one(mode: str) -> float:
    with tempfile.TemporaryDirectory(prefix="kr-ray-recreate-") as tmp:
        work, ckpt = Path(tmp) / "work", Path(tmp) / "ckpt"
        work.mkdir()
        env = {k: v for k, v in os.environ.items() if k != "RANK"}
        with open(Path(tmp) / "driver.log", "wb") as out:
            proc = subprocess.Popen(
                [sys.executable, str(JOB), "--ckpt", str(ckpt), "--work", str(work),
                 "--steps", "20", "--sleep", "0.1", "--supervise", *MODES[mode]],
                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            try:
                while not (work / "progress").is_file() or \
                        int((work / "progress").read_text() or -1) < 13:
                    time.sleep(0.02)
                    if proc.poll() is not None:
                        raise RuntimeError((Path(tmp) / "driver.log").read_text()[-3000:])
                pid = int((work / "pids" / "policy.r1").read_text())
                killed = time.time()
                os.kill(pid, signal.SIGKILL)
                proc.wait(timeout=300)
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
        steps = [tuple(map(float, line.split())) for line in
                 (work / "steps").read_text().splitlines()]
        return min(t for _, t in steps if t > killed) - killed


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    seen: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(a.rounds):
        for mode in MODES:
            seen[mode].append(one(mode))
            print(f"round {r + 1} {mode}: {seen[mode][-1]:.2f} s", flush=True)
    print("\n| mode | kill -> first step of the recreated groups, median (min-max) |")
    print("|---|---|")
    for mode, xs in seen.items():
        print(f"| {mode} | {statistics.median(xs):.2f} s ({min(xs):.2f}-{max(xs):.2f}) |")


if __name__ == "__main__":
    main()
