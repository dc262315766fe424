"""A rank SIGKILLed under ``kempner-resilience launch``: the time from the kill to the first step
of the relaunched run, with the ranks started cold and forked warm (``launch --warm``,
``supervise/local/warm.py``), in the same run of the bench (compare the two, not the numbers with
another machine's).

Each round runs the rescue job (tests/checkpoint_helpers/rescue_job.py: a DDP MLP, 2 gloo ranks,
a 50 ms step) under the local launcher; rank 1 SIGKILLs itself in step ``--kill-at``. The bench
watches the launcher's progress files: the kill is when rank 0 reached the step before (plus
that step), the relaunch's first step when launch 2's progress file gets its first line. Also
reports the launcher's CPU seconds (its children's, warm: the zygote's and the ranks').

    python bench/warm_launch_bench.py [--kills 5]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
JOB = REPO / "tests" / "checkpoint_helpers" / "rescue_job.py"
STEP_S = 0.05


def _watch(work: Path, kill_at: int, out: dict[str, float], stop: threading.Event) -> None:
    """Timestamps: rank 0 at the step before the kill, and launch 2's first step."""
    before = f"rank 0 step {kill_at - 1}\n"
    while not stop.is_set():
        now = time.monotonic()
        if "kill" not in out:
            try:
                if before in (work / "progress.0").read_text():
                    out["kill"] = now + STEP_S
            except OSError:
                pass
        elif "first" not in out:
            try:
                if (work / "progress.1").read_text().strip():
                    out["first"] = now
                    return
            except OSError:
                pass
        time.sleep(0.005)


def one_round(warm: bool, kill_at: int) -> tuple[float, float]:
    from kempner_resilience.demo.launcher import LocalLauncher

    os.environ["KEMPNER_RESILIENCE_WARM"] = "1" if warm else "0"
    with tempfile.TemporaryDirectory(prefix="kr-warm-bench-") as tmp:
        work = Path(tmp)
        cmd = [sys.executable, str(JOB), "--steps", str(kill_at + 20), "--out",
               str(work / "w.pt"), "--step-time", str(STEP_S),
               "--set", f"checkpoint.dir={work / 'ckpt'}", "--set", "checkpoint.every_steps=10",
               "--kill-at", f"1:{kill_at}"]
        seen: dict[str, float] = {}
        stop = threading.Event()
        watcher = threading.Thread(target=_watch, args=(work, kill_at, seen, stop), daemon=True)
        watcher.start()
        cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        launches = LocalLauncher(cmd, ranks=2, workdir=work, max_launches=2,
                                 stop_timeout_s=60).run()
        cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        stop.set()
        assert [l.exit_codes[0] for l in launches] == [81, 0], [l.exit_codes for l in launches]
        cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
        return seen["first"] - seen["kill"], cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kills", type=int, default=5)
    p.add_argument("--kill-at", type=int, default=15)
    a = p.parse_args()
    rows: dict[str, list[tuple[float, float]]] = {"cold": [], "warm": []}
    for _ in range(a.kills):
        for mode in ("cold", "warm"):     # interleaved: the same load for both
            rows[mode].append(one_round(mode == "warm", a.kill_at))
            print(f"{mode}: kill -> first step {rows[mode][-1][0]:.2f} s, "
                  f"CPU {rows[mode][-1][1]:.1f} s", flush=True)
    print("\n| start | kill -> first relaunched step: median | max | CPU per job (median) |")
    print("|---|---|---|---|")
    for mode, r in rows.items():
        t = [x for x, _ in r]
        print(f"| {mode} | {statistics.median(t):.2f} s | {max(t):.2f} s | "
              f"{statistics.median(c for _, c in r):.1f} s |")


if __name__ == "__main__":
    main()
