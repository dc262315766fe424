"""Signal-to-exit latency on the real SLURM cluster (not a test).

    python bench/slurm_latency_bench.py [--runs 3] [--ranks 1] [--step-time 0.1]

Starts the test cluster (tests/cluster/slurm_cluster.sh start) when ``sinfo`` does not answer,
then for each run submits the demo trainer through the rendered ``single_node`` template,
waits until it is training, and measures from ``scancel --signal=USR1`` (t=0):

  commit     the emergency checkpoint's MANIFEST.json written (its mtime)
  requeue    ``scontrol requeue`` returned (commit + the report's emergency_save_s-relative
             requeue_s; the report's timings are the process's own clock)
  exit       rank 0's report written (just before SystemExit) -- process leaving
  left_run   ``scontrol show job`` no longer says RUNNING (polled every 50 ms)
  running    the requeued job RUNNING again (Restarts=1)
  resumed    the requeued run's first training step done (progress file)

and prints one row per run plus the median, next to the emergency save time.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kempner_resilience.demo.slurm_demo import (  # noqa: E402
    ClusterError, check_cluster, wait_until, write_job)

COLS = ["step", "save_s", "commit", "requeue", "exit", "left_run", "running", "resumed"]


def ensure_cluster() -> None:
    try:
        check_cluster()
    except ClusterError:
        print("starting the test cluster: tests/cluster/slurm_cluster.sh start", flush=True)
        subprocess.run(["bash", str(ROOT / "tests/cluster/slurm_cluster.sh"), "start"],
                       check=True, timeout=600)
        check_cluster()


def one_run(work: Path, ranks: int, step_time: float, at_step: int) -> dict[str, float]:
    job = write_job(work, ranks=ranks, steps=at_step + 40, step_time=step_time,
                    job_name="kr-bench")
    job.submit()
    try:
        job.wait_step(at_step, timeout=300)
        t0 = job.signal("USR1")
        row: dict[str, float] = {"step": float(job.last_step() or 0)}
        left = wait_until(lambda: job.info().get("JobState") != "RUNNING" and time.time(),
                          120, "job leaving RUNNING", poll=0.05)
        row["left_run"] = left - t0
        report_path = work / "report.0.json"
        wait_until(report_path.exists, 60, "first run's report")
        report = json.loads(report_path.read_text())
        timings = report.get("timings", {})
        manifest = Path(report["saved_path"]) / "MANIFEST.json"
        row["save_s"] = timings.get("emergency_save_s", float("nan"))
        row["commit"] = manifest.stat().st_mtime - t0
        row["requeue"] = row["commit"] + timings.get("requeue_s", float("nan"))
        row["exit"] = report_path.stat().st_mtime - t0
        wait_until(lambda: job.info().get("JobState") == "RUNNING"
                   and job.info().get("Restarts") == "1", 180, "job running again", poll=0.1)
        row["running"] = time.time() - t0
        wait_until(lambda: job.steps_done_in_run(1) is not None, 180, "first resumed step",
                   poll=0.05)
        row["resumed"] = time.time() - t0
        job.wait_state(timeout=300)
        return row
    finally:
        job.cancel()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--ranks", type=int, default=1)
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--at-step", type=int, default=12)
    p.add_argument("--keep", action="store_true", help="keep the work directories")
    args = p.parse_args()
    ensure_cluster()
    rows = []
    base = Path(tempfile.mkdtemp(prefix="kr_slurm_bench_"))
    print(f"{args.runs} runs, {args.ranks} srun task(s), step {args.step_time} s; seconds after "
          "scancel --signal=USR1", flush=True)
    print("run " + " ".join(f"{c:>9}" for c in COLS), flush=True)
    for i in range(args.runs):
        row = one_run(base / f"run{i}", args.ranks, args.step_time, args.at_step)
        rows.append(row)
        print(f"{i:>3} " + " ".join(f"{row[c]:>9.3f}" for c in COLS), flush=True)
    med = {c: statistics.median(r[c] for r in rows) for c in COLS}
    print("med " + " ".join(f"{med[c]:>9.3f}" for c in COLS))
    print(f"signal->committed {med['commit']:.2f} s (emergency save itself {med['save_s']:.3f} "
          f"s; the rest is waiting for the next step boundary and the ranks' agreement), "
          f"->requeued {med['requeue']:.2f} s, ->process exit {med['exit']:.2f} s, "
          f"->job left RUNNING {med['left_run']:.2f} s, ->RUNNING again {med['running']:.1f} s, "
          f"->first resumed step {med['resumed']:.1f} s")
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
