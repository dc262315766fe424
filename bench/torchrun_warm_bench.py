"""A worker SIGKILLed under ``kempner-resilience torchrun``: the time from the kill to the first
step of the relaunched workers, started cold and forked warm (``KEMPNER_RESILIENCE_WARM=1``,
``supervise/torchrun/agent.py``), rounds interleaved in the same run of the bench (compare
the two, not the numbers with another machine's).

Each round runs one agent (``--standalone``, ``--nproc-per-node=2``, ``--max-restarts=1``) of
the demo trainer (gloo DDP, a 50 ms step). Once rank 1 logged step ``--kill-at`` the bench
SIGKILLs rank 1's worker; the relaunch's first step is the first progress line written after
the kill (the old rank 0 cannot finish a step without its peer). The local stand-in for
``bench/torchrun_spares_bench.py``'s node death, which needs the SLURM cluster.

    python bench/torchrun_warm_bench.py [--rounds 3] [--kill-at 20]
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
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from helpers import node_pids, worker_pids  # noqa: E402


def one_round(warm: bool, kill_at: int) -> float:
    """Seconds from the kill to the relaunched workers' first step."""
    with tempfile.TemporaryDirectory(prefix="kr-twarm-bench-") as tmp:
        work = Path(tmp)
        progress = work / "progress"
        env = {**os.environ, "KEMPNER_RESILIENCE_WARM": "1" if warm else "0",
               "KEMPNER_RESILIENCE_FORWARD_SIGNALS": "yes", "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        agent = subprocess.Popen(
            [sys.executable, "-m", "kempner_resilience.cli", "torchrun", "--standalone",
             "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.2",
             "--no-python", sys.executable, "-m", "kempner_resilience.demo.train",
             "--steps", "100000", "--step-time", "0.05", "--progress", str(progress),
             "--set", f"checkpoint.dir={work / 'ckpt'}", "--set", "checkpoint.every_steps=50"],
            stdout=subprocess.DEVNULL, stderr=open(work / "agent.err", "w"),
            stdin=subprocess.DEVNULL, cwd=work, start_new_session=True, env=env)
        try:
            mark = f"rank 1 step {kill_at}\n"
            while not (progress.exists() and mark in progress.read_text()):
                if agent.poll() is not None:
                    raise SystemExit((work / "agent.err").read_text()[-3000:])
                time.sleep(0.005)
            size = progress.stat().st_size
            kill = time.monotonic()
            os.kill(max(worker_pids(agent.pid)), signal.SIGKILL)
            while progress.stat().st_size == size:
                if time.monotonic() - kill > 120:
                    raise SystemExit((work / "agent.err").read_text()[-3000:])
                time.sleep(0.005)
            return time.monotonic() - kill
        finally:
            for pid in node_pids(agent.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            agent.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kill-at", type=int, default=20)
    a = ap.parse_args()
    rows: dict[str, list[float]] = {"cold": [], "warm": []}
    for _ in range(a.rounds):
        for mode in ("cold", "warm"):     # interleaved: the same load for both
            rows[mode].append(one_round(mode == "warm", a.kill_at))
            print(f"{mode}: {rows[mode][-1]:.2f} s", flush=True)
    print(f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}")
    for mode, times in rows.items():
        print(f"{mode}: kill -> first relaunched step: median {statistics.median(times):.2f} s, "
              f"max {max(times):.2f} s ({', '.join(f'{t:.2f}' for t in times)})")


if __name__ == "__main__":
    main()
