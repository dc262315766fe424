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
from kempner_resilience.ledger import LEDGER_NAME, read_ledger
from kempner_resilience.slurm.badnodes import record_bad_nodes
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
    record_bad_nodes(job.checkpoints, [bad], reason="test: its rank hung", job_id=job.job_id)

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
    events = read_ledger(job.checkpoints / LEDGER_NAME)
    excluded = [e for e in events if e["ev"] == "exclude"]
    assert [(e["bad_nodes"], e["excluded"]) for e in excluded] == [(bad, bad)]
