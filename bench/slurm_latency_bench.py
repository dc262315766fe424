"""Signal-to-exit latency on the real SLURM cluster (not a test).

    python bench/slurm_latency_bench.py [--runs 3] [--ranks 1] [--step-time 0.1]
    python bench/slurm_latency_bench.py --nodes 2 [--ranks 4] [--victim other|batch]

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

With ``--nodes 2`` it runs on the multi-node test cluster (tests/cluster/multinode_cluster.sh,
started when needed): the same USR1 row for ``--ranks`` (default 4) gloo ranks of the
``multi_node`` template on 2 nodes, then a node-kill row: after a periodic checkpoint one node
of the job dies (every process SIGKILLed; ``--victim other``: the node without the batch script
and rank 0, ``batch``: the one with them), and from the kill (t=0):

  gone       the surviving node's trainer processes all exited (polled every 50 ms)
  down       SLURM shows the dead node DOWN
  running    the requeued job RUNNING again (Restarts=1), on the other nodes
  resumed    its first training step done (resumed from the newest committed checkpoint)
"""

from __future__ import annotations

import argparse
import json
import os
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
KILL_COLS = ["step", "resume_at", "gone", "down", "running", "resumed"]
MULTINODE = ROOT / "tests/cluster/multinode_cluster.sh"


def ensure_cluster() -> None:
    try:
        check_cluster()
    except ClusterError:
        print("starting the test cluster: tests/cluster/slurm_cluster.sh start", flush=True)
        subprocess.run(["bash", str(ROOT / "tests/cluster/slurm_cluster.sh"), "start"],
                       check=True, timeout=600)
        check_cluster()


def ensure_multinode() -> dict[str, str]:
    """Start the multi-node test cluster (idempotent); returns the environment its clients
    need (SLURM_CONF)."""
    subprocess.run(["bash", str(MULTINODE), "start"], check=True, timeout=600)
    out = subprocess.run(["bash", str(MULTINODE), "env"], check=True, capture_output=True,
                         text=True, timeout=30).stdout
    return dict(os.environ, SLURM_CONF=out.strip().removeprefix("export SLURM_CONF="))


def _trainer_pids(node: str, workdir: Path) -> list[int]:
    pids = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True,
                          timeout=15).stdout.split()
    found = []
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv[0].endswith(b"python") and str(workdir).encode() in b" ".join(argv):
            found.append(int(pid))
    return found


def _running(pid: int) -> bool:
    try:
        return "\nState:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def kill_run(work: Path, ranks: int, step_time: float, at_step: int, victim: str,
             env: dict[str, str]) -> dict[str, float]:
    """One node-kill run on the multi-node cluster; seconds after the kill."""
    job = write_job(work, ranks=ranks, nodes=2, steps=at_step + 40, step_time=step_time,
                    job_name="kr-bench", train_args=["--no-ddp"], env=env)
    job.submit()
    dead = None
    try:
        job.wait_step(at_step, timeout=300)
        nodes = job.hosts()
        dead = nodes[0] if victim == "batch" else nodes[1]
        survivors = [p for n in nodes if n != dead for p in _trainer_pids(n, work)]
        row: dict[str, float] = {"step": float(job.last_step() or 0)}
        t0 = time.time()
        subprocess.run(["bash", str(MULTINODE), "kill-node", dead.removeprefix("krnode")],
                       check=True, timeout=60, capture_output=True)
        row["gone"] = wait_until(lambda: not any(_running(p) for p in survivors) and time.time(),
                                 120, "surviving ranks gone", poll=0.05) - t0
        row["down"] = wait_until(lambda: subprocess.run(
            ["sinfo", "-h", "-n", dead, "-o", "%T"], capture_output=True, text=True,
            env=env).stdout.startswith("down") and time.time(), 120, "node DOWN", 0.1) - t0
        wait_until(lambda: job.info().get("JobState") == "RUNNING"
                   and job.info().get("Restarts") == "1", 180, "job running again", poll=0.1)
        row["running"] = time.time() - t0
        wait_until(lambda: job.steps_done_in_run(1) is not None, 180, "first resumed step",
                   poll=0.05)
        row["resumed"] = time.time() - t0
        job.wait_state(timeout=300)
        report = job.report(1) or {}
        row["resume_at"] = float(report.get("resumed_from") or -1)
        return row
    finally:
        job.cancel()
        if dead is not None:
            subprocess.run(["bash", str(MULTINODE), "restart-node", dead.removeprefix("krnode")],
                           timeout=120, capture_output=True)


def one_run(work: Path, ranks: int, step_time: float, at_step: int, nodes: int = 1,
            env: dict[str, str] | None = None) -> dict[str, float]:
    job = write_job(work, ranks=ranks, steps=at_step + 40, step_time=step_time,
                    job_name="kr-bench", nodes=nodes, env=env,
                    train_args=["--no-ddp"] if nodes > 1 else ())
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
    p.add_argument("--ranks", type=int, default=None, help="default 1, with --nodes 2: 4")
    p.add_argument("--nodes", type=int, default=1, choices=(1, 2),
                   help="2: the multi-node test cluster, plus the node-kill rows")
    p.add_argument("--victim", choices=("other", "batch"), default="other",
                   help="--nodes 2: which node of the job dies")
    p.add_argument("--step-time", type=float, default=0.1)
    p.add_argument("--at-step", type=int, default=12)
    p.add_argument("--keep", action="store_true", help="keep the work directories")
    args = p.parse_args()
    ranks = args.ranks or (4 if args.nodes > 1 else 1)
    env = None
    if args.nodes > 1:
        env = ensure_multinode()
    else:
        ensure_cluster()
    rows = []
    base = Path(tempfile.mkdtemp(prefix="kr_slurm_bench_"))
    print(f"{args.runs} runs, {ranks} srun task(s) on {args.nodes} node(s), step "
          f"{args.step_time} s; seconds after scancel --signal=USR1", flush=True)
    print("run " + " ".join(f"{c:>9}" for c in COLS), flush=True)
    for i in range(args.runs):
        row = one_run(base / f"run{i}", ranks, args.step_time, args.at_step, args.nodes, env)
        rows.append(row)
        print(f"{i:>3} " + " ".join(f"{row[c]:>9.3f}" for c in COLS), flush=True)
    med = {c: statistics.median(r[c] for r in rows) for c in COLS}
    print("med " + " ".join(f"{med[c]:>9.3f}" for c in COLS))
    print(f"signal->committed {med['commit']:.2f} s (emergency save itself {med['save_s']:.3f} "
          f"s; the rest is waiting for the next step boundary and the ranks' agreement), "
          f"->requeued {med['requeue']:.2f} s, ->process exit {med['exit']:.2f} s, "
          f"->job left RUNNING {med['left_run']:.2f} s, ->RUNNING again {med['running']:.1f} s, "
          f"->first resumed step {med['resumed']:.1f} s")
    if args.nodes > 1:
        assert env is not None
        kills = []
        print(f"node kill ({args.victim} node), after a periodic checkpoint; seconds after the "
              "kill", flush=True)
        print("run " + " ".join(f"{c:>9}" for c in KILL_COLS), flush=True)
        for i in range(args.runs):
            row = kill_run(base / f"kill{i}", ranks, args.step_time, args.at_step + 10,
                           args.victim, env)
            kills.append(row)
            print(f"{i:>3} " + " ".join(f"{row[c]:>9.3f}" for c in KILL_COLS), flush=True)
        kmed = {c: statistics.median(r[c] for r in kills) for c in KILL_COLS}
        print("med " + " ".join(f"{kmed[c]:>9.3f}" for c in KILL_COLS))
        print(f"node kill -> surviving ranks gone {kmed['gone']:.2f} s, ->node DOWN "
              f"{kmed['down']:.1f} s, ->RUNNING again {kmed['running']:.1f} s, ->first resumed "
              f"step {kmed['resumed']:.1f} s (resumed at step {kmed['resume_at']:.0f})")
    if not args.keep:
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
