"""A node's death with a spare node, template ``multi_node_torchrun``: the time from the kill to
the first step of the training relaunched in the same job, split into its parts.
Target: at most 60 s on the 2-core test machines.

On the namespace SLURM cluster (``tests/cluster/multinode_cluster.sh``, needs root; started when
not running; hold ``/tmp/kr-slurm.lock``): 3 nodes, 2 training (2 gloo DDP workers each under a
``kempner-resilience torchrun`` agent) and 1 standby agent. Each round submits the demo job
(``sbatch --spares 1``), kills a training node that is not the rendezvous host at a random
step between two periodic saves, and reads the parts from the run ledger:

* ``rescue``: kill -> the survivors' rescue committed (detection included: their collective
  fails at once when the node's sockets close);
* ``relaunch``: -> the relaunched workers' ``start`` event (the workers exit, the agents'
  decision, the dead agent dropped from the rendezvous (at once, its ranks named by the
  survivors' workers; else once its heartbeat is two ``keep_alive`` intervals old), the new
  rendezvous round with the standby, process start, Python and torch imports);
* ``load``: -> the checkpoint loaded (``resume``); ``first_step``: -> the training loop runs.

* ``completed_after_last_step``: the training's last step -> SLURM says COMPLETED.

    flock /tmp/kr-slurm.lock python bench/torchrun_spares_bench.py [--kills 5]
        [--slurmd-timeout 300]
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))
from spares_bench import SCRIPT, cluster_env  # noqa: E402  (bench/ is this script's path)
STEPS, EVERY = 130, 50


def _workers_on(node: str, job) -> bool:
    """Whether one of the job's workers runs on ``node`` (by the pids the workers wrote: a warm
    worker's /proc shows its zygote's command line)."""
    pids = subprocess.run(["ip", "netns", "pids", node], capture_output=True,
                          text=True).stdout.split()
    ranks = job.worker_ranks()
    return any(int(p) in ranks for p in pids if p.isdigit())


def one_kill(env: dict[str, str], work: Path) -> dict[str, float]:
    from kempner_resilience.demo.slurm_demo import write_job
    from kempner_resilience.core.ledger import read_ledger
    from kempner_resilience.core.runpaths import RunPaths

    job = write_job(work, ranks=4, nodes=2, spares=1, steps=STEPS, step_time=0.05,
                    every_steps=EVERY, env=env, torchrun=True,
                    sets=["watchdog.hang_timeout_s=30"])
    job.submit()
    try:
        job.wait_step(5, timeout=300)
        nodes = job.hosts()
        victim = [n for n in nodes[1:] if _workers_on(n, job)][-1]
        job.wait_step(random.randint(EVERY + 3, 2 * EVERY - 5), timeout=300)
        killed = time.time()
        subprocess.run(["bash", str(SCRIPT), "kill-node", victim[len("krnode"):]], check=True,
                       timeout=60, stdout=subprocess.DEVNULL)
        info = job.wait_state(timeout=400)
        completed_t = time.time()
        if info.get("JobState") != "COMPLETED" or info.get("Restarts") != "0":
            raise RuntimeError(f"job ended {info}: {job.log_text()[-2000:]}")
        evs = read_ledger(RunPaths(job.checkpoints).ledger)
        first: dict[str, float] = {}
        for e in evs:
            if e["t"] >= killed - 1.0:   # the rescue may be stamped before our clock read
                first.setdefault(e["ev"], e["t"])
        if not {"rescue", "start", "resume", "loop"} <= set(first):
            raise RuntimeError(f"ledger after the kill at {killed:.3f}: "
                               f"{[(e['ev'], e['t']) for e in evs]}")
        parts = {"rescue": first["rescue"] - killed,
                 "relaunch": first["start"] - first["rescue"],
                 "load": first["resume"] - first["start"],
                 "first_step": first["loop"] - first["resume"]}
        parts["total"] = first["loop"] - killed
        # The training's last step -> SLURM says COMPLETED (the dead node's agent step).
        parts["completed_after_last_step"] = completed_t - job.progress.stat().st_mtime
        return parts
    finally:
        subprocess.run(["bash", str(SCRIPT), "restart-node", victim[len("krnode"):]],
                       timeout=120, stdout=subprocess.DEVNULL)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--slurmd-timeout", type=int, default=5)
    args = ap.parse_args()
    env = cluster_env(args.slurmd_timeout)
    rows = []
    for i in range(args.kills):
        with tempfile.TemporaryDirectory(prefix="kr-trun-spares-") as d:
            parts = one_kill(env, Path(d) / "job")
        rows.append(parts)
        print(json.dumps({"kill": i + 1, **{k: round(v, 2) for k, v in parts.items()}}),
              flush=True)
    keys = rows[0].keys()
    print("median: " + ", ".join(
        f"{k} {sorted(r[k] for r in rows)[len(rows) // 2]:.1f} s" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
