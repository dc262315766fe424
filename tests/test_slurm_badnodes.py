"""A node recorded bad is never used again by the run, even once SLURM shows it IDLE.

On the multi-node cluster (3 idle nodes, so SLURM would normally start the requeued job on the
node it just left): the demo trainer, one rank on one node, has its node recorded in
``bad-nodes.json`` (what the failure detection does for a node whose rank died or hung), then
gets SIGUSR1. Its ordinary requeue path (save, ``scontrol requeue``) adds the node to the job's
``ExcNodeList`` once the job is pending, and the job runs again elsewhere while that node sits
IDLE.
"""

from __future__ import annotations

import subprocess

import pytest

from kempner_resilience.demo.slurm_demo import write_job
from kempner_resilience.core.ledger import read_ledger
from kempner_resilience.slurm.badnodes import record_bad_nodes
from kempner_resilience.core.runpaths import RunPaths
from kempner_resilience.slurm.env import expand_hostlist
from slurm_fixtures import multinode_cluster, multinode_jobs  # noqa: F401

pytestmark = [pytest.mark.slurm]


def _state(cluster, node: str) -> str:
    res = subprocess.run(["sinfo", "-h", "-n", node, "-o", "%T"], capture_output=True,
                         text=True, timeout=15, env=cluster.env)
    return res.stdout.strip()


def test_a_requeued_job_never_runs_on_a_recorded_bad_node_although_it_is_idle(
        multinode_cluster, multinode_jobs, tmp_path):
    job = write_job(tmp_path / "job", ranks=1, nodes=1, steps=40, step_time=0.1,
                    env=multinode_cluster.env)
    multinode_jobs[0].append(job)
    job.submit()
    job.wait_step(4, timeout=180)
    first = job.hosts()
    assert len(first) == 1
    bad = first[0]
    record_bad_nodes(RunPaths(job.checkpoints), [bad], reason="test: its rank hung",
                     job_id=job.job_id)

    job.signal("USR1")
    # Running again (not COMPLETING: that is still the first run, on its old node).
    info = job.wait_state({"RUNNING", "COMPLETED"}, restarts=1, timeout=180)
    # The exclusion landed while the job was pending, and it held.
    assert bad in expand_hostlist(info.get("ExcNodeList", "")), info.get("ExcNodeList")
    again = expand_hostlist(info.get("NodeList", ""))
    assert again and bad not in again, (bad, again)
    # ... although SLURM had the bad node IDLE to give (it is no longer in use by anyone).
    assert _state(multinode_cluster, bad) == "idle"

    done = job.wait_state({"COMPLETED", "FAILED"}, timeout=240)
    assert done["JobState"] == "COMPLETED", job.log_text()[-3000:]
    assert bad not in expand_hostlist(done.get("NodeList", ""))
    events = read_ledger(RunPaths(job.checkpoints).ledger)
    excluded = [e for e in events if e["ev"] == "exclude"]
    assert [(e["bad_nodes"], e["excluded"]) for e in excluded] == [(bad, bad)]


_REQUEUE = r'''
import os, signal, sys
signal.signal(signal.SIGTERM, lambda *a: None)   # as ResilientRun's handler: record, go on
from kempner_resilience.config import RequeueConfig
from kempner_resilience.slurm.badnodes import bad_nodes
from kempner_resilience.slurm.requeue import requeue_job
from kempner_resilience.slurm.env import SlurmJob
from kempner_resilience.core.runpaths import RunPaths
# From the batch step (as the relaunch glue would): SLURM SIGKILLs it at once on the requeue.
r = requeue_job(SlurmJob.from_env(), RequeueConfig(), exclude=bad_nodes(RunPaths(sys.argv[1])),
                min_nodes=2)
open(sys.argv[2], "w").write(f"{r.ok} {','.join(r.excluded)} {r.exclude_error}")
'''


def test_a_job_with_a_spare_gives_it_up_rather_than_pend_forever_on_too_few_good_nodes(
        multinode_cluster, tmp_path):
    # 2 training nodes + 1 spare on a 3-node partition, one node bad: the requeued job can only
    # run on the 2 left, so it asks for 2 (its spare given up) and runs there.
    import sys
    from pathlib import Path

    from slurm_fixtures import submit, wait_job

    ckpt, out = tmp_path / "ckpt", tmp_path / "requeue.txt"
    ckpt.mkdir()
    record_bad_nodes(RunPaths(ckpt), ["krnode1"], reason="test", job_id=None)
    (tmp_path / "req.py").write_text(_REQUEUE)
    root = Path(__file__).resolve().parents[1]
    script = (f"#!/bin/bash\n#SBATCH -N 3 --requeue -o {tmp_path}/job.out\n"
              f'echo "$SLURM_RESTART_COUNT $SLURM_JOB_NODELIST" >> {tmp_path}/runs\n'
              f'[ "${{SLURM_RESTART_COUNT:-0}}" = 0 ] || exit 0\n'
              f"cd {root} && PYTHONPATH={root} {sys.executable} {tmp_path}/req.py {ckpt} {out}"
              f" 2> {tmp_path}/req.err\n"
              "sleep 60\n")
    job = submit(script, cwd=tmp_path, env=multinode_cluster.env)
    info = wait_job(job, {"COMPLETED", "FAILED"}, timeout=120, env=multinode_cluster.env)
    # (the batch step was SIGKILLed right after the requeue: its python wrote nothing after)
    assert not out.exists() or out.read_text().startswith("True krnode1"), out.read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", \
        (tmp_path / "req.err").read_text()[-3000:]
    assert "krnode1" in expand_hostlist(info.get("ExcNodeList", "")), info.get("ExcNodeList")
    assert info.get("NumNodes") == "2", info.get("NumNodes")
    runs = (tmp_path / "runs").read_text().splitlines()
    assert len(runs) == 2 and "krnode1" in expand_hostlist(runs[0].split()[-1])
    assert expand_hostlist(runs[1].split()[-1]) == ["krnode2", "krnode3"], runs


_REQUEUE_RESIZED = r'''
import signal, sys
signal.signal(signal.SIGTERM, lambda *a: None)   # as ResilientRun's handler: record, go on
from kempner_resilience.slurm.badnodes import requeue_excluding
# (SLURM SIGKILLs the batch step right after the requeue: nothing after this line runs.)
requeue_excluding(sys.argv[1], [sys.argv[2]])
'''


def test_a_job_slurm_shrank_after_its_node_went_down_is_requeued_not_left_held(
        multinode_cluster, tmp_path):
    # A --no-kill job whose node goes down keeps running on the rest: SLURM resizes it, and
    # slurmctld 22.05 without accounting then refuses every update of it for as long as it runs
    # ("the DB index is being set"), a release included. A requeue that held the job for its
    # exclusion would leave it held for good; it must run again.
    import sys
    from pathlib import Path

    from slurm_fixtures import job_info, submit, wait_for, wait_job

    (tmp_path / "req.py").write_text(_REQUEUE_RESIZED)
    root = Path(__file__).resolve().parents[1]
    script = (f"#!/bin/bash\n#SBATCH -N 2 --no-kill --requeue -o {tmp_path}/job.out\n"
              f'echo "${{SLURM_RESTART_COUNT:-0}} $SLURM_JOB_NODELIST" >> {tmp_path}/runs\n'
              f'[ "${{SLURM_RESTART_COUNT:-0}}" = 0 ] || exit 0\n'
              "srun --ntasks-per-node=1 sleep 120 &\n"
              "until scontrol show -o job $SLURM_JOB_ID | grep -q ResizeTime=; do sleep 0.2; done\n"
              f"cd {root} && PYTHONPATH={root} {sys.executable} {tmp_path}/req.py "
              f"$SLURM_JOB_ID $(cat {tmp_path}/down) 2> {tmp_path}/req.err\n"
              "sleep 120\n")
    job = submit(script, cwd=tmp_path, env=multinode_cluster.env)
    info = wait_job(job, {"RUNNING"}, timeout=60, env=multinode_cluster.env)
    down = expand_hostlist(info["NodeList"])[1]
    (tmp_path / "down").write_text(down)
    scontrol = ["scontrol", "update", f"NodeName={down}"]
    try:
        subprocess.run([*scontrol, "State=DOWN", "Reason=kr-test"], check=True, timeout=15,
                       env=multinode_cluster.env)
        seen = set()                 # every (state, reason) the job shows until it ends
        done = wait_for(lambda: _until_ended(job, multinode_cluster, seen), 90,
                        what=f"job {job} ended")
    finally:
        if job_info(job, multinode_cluster.env).get("JobState") not in (None, "COMPLETED"):
            subprocess.run(["scancel", job], timeout=15, env=multinode_cluster.env)
        subprocess.run([*scontrol, "State=RESUME"], timeout=15, env=multinode_cluster.env)
        wait_for(lambda: _state(multinode_cluster, down) == "idle", 30, what=f"{down} idle")

    assert done["JobState"] == "COMPLETED" and done["Restarts"] == "1", \
        (tmp_path / "req.err").read_text()[-3000:]
    assert not [r for r in seen if "held" in r[1].lower()], seen
    runs = (tmp_path / "runs").read_text().splitlines()
    assert len(runs) == 2, runs


def _until_ended(job: str, cluster, seen: set) -> dict | None:
    from slurm_fixtures import job_info
    info = job_info(job, cluster.env)
    seen.add((info.get("JobState"), info.get("Reason", "")))
    return info if info.get("JobState") in ("COMPLETED", "FAILED") else None
