"""Several nodes: the shipped ``multi_node`` template on a real multi-node SLURM cluster.

The cluster (tests/cluster/multinode_cluster.sh) runs each slurmd in its own network and UTS
namespace, so the 4 gloo ranks of a ``-N 2 --ntasks-per-node 2`` job sit on 2 hosts with their
own names and addresses and talk over a bridge, as on a real cluster. The batch script is the
one ``kempner-resilience sbatch --template multi_node --nodes 2 --ntasks-per-node 2`` renders
for the demo trainer; the checkpoint directory is shared by every node (one filesystem).

The trainer all-reduces its gradients one parameter at a time (``--no-ddp``): that is bitwise
reproducible at any world size, so a run that was interrupted, requeued and resumed must end with
exactly the weights and optimizer state of an uninterrupted run of 4 plain processes.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kempner_resilience.checkpoint import MANIFEST_NAME
from kempner_resilience.demo.compare import compare_weights
from kempner_resilience.demo.slurm_demo import DemoJob, write_job
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.core.ledger import read_ledger
from kempner_resilience.core.runpaths import RunPaths
from slurm_fixtures import (multinode_cluster, multinode_jobs, submit,  # noqa: F401
                            wait_for, wait_job)

pytestmark = [pytest.mark.slurm]

STEPS = 40
RANKS, NODES = 4, 2
TRAIN_ARGS = ["--no-ddp"]
CLI = str(Path(sys.executable).parent / "kempner-resilience")
PROBES = Path(__file__).resolve().parent / "cluster"
# A rank whose peer died exits with this code (kempner_resilience.run.resilient: a failed collective after
# a peer's death; rank 0 requeues when a committed checkpoint exists).
PEER_LOST = int(getattr(ExitCode, "PEER_LOST", 81))
HANG = int(ExitCode.HANG)
# Codes with a documented meaning a batch script can act on (not 0, not Python's own 1 or 2).
DOCUMENTED = {int(c) for c in ExitCode} - {0, 1, 2}


@pytest.fixture(scope="module")
def reference(reference_run) -> Path:
    """The uninterrupted run: 4 plain processes, no SLURM, no checkpoints."""
    return reference_run(ranks=RANKS, steps=STEPS, train_args=tuple(TRAIN_ARGS))


def _new_job(cluster, multinode_jobs, tmp_path: Path, **kw) -> DemoJob:
    job = write_job(tmp_path / "job", ranks=RANKS, nodes=NODES, steps=STEPS,
                    train_args=TRAIN_ARGS, env=cluster.env, **kw)
    multinode_jobs[0].append(job)
    return job


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return re.search(r"^State:\s+[ZX]", status, re.M) is None


def _committed_steps(root: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1].split(".")[0]) for p in root.glob("step_*")
                  if (p / MANIFEST_NAME).exists())


def _last_step_per_rank(job: DemoJob, restart: int) -> dict[int, int]:
    text = job.progress.read_text().split(f"# run {restart}\n", 1)[1].split("# run ")[0]
    last: dict[int, int] = {}
    for rank, step in re.findall(r"^rank (\d+) step (\d+)$", text, re.M):
        last[int(rank)] = max(last.get(int(rank), -1), int(step))
    return last


def _usr1_stops_every_rank_at_one_committed_step(job: DemoJob) -> dict:
    """``scancel --signal=USR1``; returns rank 0's report of the first run, checked."""
    job.signal("USR1")
    first = wait_for(lambda: job.report(0), timeout=120, what="the first run's report")
    assert first["exit_code"] == ExitCode.REQUEUE, job.log_text()[-3000:]
    assert first["world_size"] == RANKS
    assert first["stop_step"] == first["saved_step"] >= 12
    # Every rank wrote its shard into the shared directory before rank 0 committed.
    saved = Path(first["saved_path"])
    assert (saved / MANIFEST_NAME).exists()
    assert sorted(int(p.name.split("_")[2]) for p in saved.glob("__*_*.distcp")) == \
        list(range(RANKS))
    # All 4 ranks stopped at the same step boundary, on both nodes.
    assert _last_step_per_rank(job, 0) == {r: first["stop_step"] - 1 for r in range(RANKS)}
    # Rank 0 requeued after the commit (its ledger says so; its log line may be lost: srun
    # stops relaying the tasks' output once the requeue cancels the step).
    assert first["timings"].get("requeue_s") is not None, first
    assert any(e["ev"] == "requeue" for e in read_ledger(RunPaths(job.checkpoints).ledger))
    return first


def _assert_completed_bitwise(job: DemoJob, reference: Path, resumed_from: int,
                              extra_requeues_ok: bool = False) -> None:
    info = job.wait_state(timeout=240)
    assert info["JobState"] == "COMPLETED", job.log_text()[-3000:]
    assert info["ExitCode"] == "0:0"
    restarts = int(info["Restarts"])
    # extra_requeues_ok: a later attempt may itself stop and requeue (each through a committed
    # checkpoint); the run must still end bitwise equal. Seen once under full-suite load with
    # torchrun (open: why the resumed attempt requeued again).
    assert restarts == 1 or (extra_requeues_ok and restarts > 1), info
    second = job.report(1)
    assert second is not None, job.log_text()[-3000:]
    assert second["world_size"] == RANKS
    assert second["resumed_from"] == second["start_step"] == resumed_from
    last = job.report(restarts)
    assert last is not None and last["exit_code"] == 0, job.log_text()[-3000:]
    same, total, diff = compare_weights(reference, job.weights)
    assert not diff, f"{len(diff)} of {total} tensors differ: {diff[:5]}"


def test_multi_node_job_script_is_what_kempner_resilience_sbatch_renders(multinode_cluster,
                                                                        tmp_path, multinode_jobs):
    job = _new_job(multinode_cluster, multinode_jobs, tmp_path)
    proc = subprocess.run([CLI, *job.sbatch_args], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == job.script.read_text()
    assert job.sbatch_args[:7] == ["sbatch", "--template", "multi_node", "--job-name", "kr-demo",
                                   "--time", "00:10:00"]
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=2", "#SBATCH --requeue"):
        assert line in proc.stdout.splitlines()


def test_usr1_to_4_ranks_on_2_nodes_checkpoints_requeues_resumes_bitwise_equal(
        multinode_cluster, tmp_path, reference, multinode_jobs):
    job = _new_job(multinode_cluster, multinode_jobs, tmp_path, step_time=0.1)
    job.submit()
    job.wait_step(12, timeout=180)
    nodes = job.hosts()
    assert len(set(nodes)) == NODES, nodes
    # Each node ran its own 2 ranks: rank placement came from srun, MASTER_ADDR from the list.
    placed = multinode_cluster.trainers(job.workdir, nodes)
    assert {node for node, _ in placed.values()} == set(nodes), placed
    first = _usr1_stops_every_rank_at_one_committed_step(job)
    _assert_completed_bitwise(job, reference, first["saved_step"])
    assert len(set(job.hosts())) == NODES


def test_torchrun_template_usr1_to_4_workers_on_2_nodes_checkpoints_requeues_resumes_bitwise(
        multinode_cluster, tmp_path, reference, multinode_jobs):
    # multi_node_torchrun: one `kempner-resilience torchrun` agent per node (the srun task), 2
    # workers each. SLURM signals only the agents (proctrack/cgroup: slurmstepd's children);
    # each agent sends the USR1 on, once, to its workers.
    env = dict(multinode_cluster.env,
               PATH=f"{Path(sys.executable).parent}:{multinode_cluster.env.get('PATH', '')}")
    job = write_job(tmp_path / "job", ranks=RANKS, nodes=NODES, steps=STEPS, step_time=0.1,
                    train_args=TRAIN_ARGS, env=env, torchrun=True)
    multinode_jobs[0].append(job)
    assert ('kempner-resilience srun --agents -- "${TORCHRUN[@]}" ' + sys.executable +
            " -u -m kempner_resilience.demo.train") in job.script.read_text()
    job.submit()
    job.wait_step(12, timeout=180)
    nodes = job.hosts()
    assert len(set(nodes)) == NODES, nodes
    placed = multinode_cluster.torchrun_workers(job, nodes)
    assert sorted(placed) == list(range(RANKS)), placed
    assert sorted(placed.values()) == sorted(nodes * (RANKS // NODES)), placed
    first = _usr1_stops_every_rank_at_one_committed_step(job)
    _assert_completed_bitwise(job, reference, first["saved_step"],
                              extra_requeues_ok=True)
    log = job.log_text()
    # Every worker heard the USR1 exactly once, from its node's agent.
    for rank in range(RANKS):
        assert len(re.findall(rf"\[rank {rank}\] SIGUSR1 received", log)) == 1, log[-3000:]
    assert len(re.findall(r"agent on \S+: SIGUSR1 forwarded to 2 worker", log)) == NODES


@pytest.mark.parametrize("victim", ["batch_node", "other_node"])
def test_node_killed_mid_run_leaves_no_rank_behind_and_job_resumes_from_last_commit(
        multinode_cluster, tmp_path, reference, multinode_jobs, victim):
    # Periodic checkpoints every 5 steps; the node dies after the one at step 20 is committed.
    # "batch_node" holds the batch script, srun and ranks 0-1 (SLURM's node failure must
    # requeue the job); "other_node" holds ranks 2-3 (rank 0 survives and may requeue).
    # The fallback path, rescue off (the rescue under the same kill: tests/test_slurm_rescue.py).
    job = _new_job(multinode_cluster, multinode_jobs, tmp_path, step_time=0.2, rank_files=True,
                   sets=["watchdog.hang_timeout_s=20", "rescue.enabled=false"])
    job.submit()
    # Who runs where, found early: at step 22 the kill must follow at once, well before the
    # last step (under load the /proc scan takes a while).
    job.wait_step(8, timeout=180)
    nodes = job.hosts()
    dead = nodes[0] if victim == "batch_node" else nodes[1]
    ranks = multinode_cluster.trainers(job.workdir, nodes)
    assert sorted(ranks) == list(range(RANKS)), ranks
    survivors = {r: pid for r, (node, pid) in ranks.items() if node != dead}
    assert len(survivors) == RANKS // NODES
    job.wait_step(22, timeout=180)
    multinode_jobs[1].append(dead)
    multinode_cluster.kill_node(dead)
    assert job.steps_done_in_run(0) < STEPS - 1, "the kill came after the run's last step"

    # No rank is left behind: the surviving node's ranks notice and exit (a failed collective,
    # else the hang watchdog, else SLURM's SIGTERM once the node is DOWN).
    wait_for(lambda: not any(_alive(pid) for pid in survivors.values()), timeout=60,
             what="the surviving ranks to exit")
    committed = _committed_steps(job.checkpoints)
    assert committed and committed[-1] >= 20
    # SLURM (node failure, --requeue) or rank 0 requeued the job; it ran again on the remaining
    # nodes and resumed from the newest committed checkpoint, never from a partial directory.
    _assert_completed_bitwise(job, reference, committed[-1])
    assert dead not in job.hosts()

    # The survivors exited with a documented code and a one-line cause, not a traceback.
    codes = {r: job.rank_exit(0, r) for r in survivors}
    for r in survivors:
        err = job.rank_stderr(0, r)
        assert "Traceback" not in err, f"rank {r} (exit {codes[r]}):\n{err[-2000:]}"
    # 81 when a survivor's collective failed first, 143 when SLURM's SIGTERM for the dead node's
    # job came first (the killed node's TCP peers may never send a reset); both are bounded exits.
    assert all(c in DOCUMENTED for c in codes.values()), codes
    assert set(codes.values()) <= {PEER_LOST, 128 + signal.SIGTERM, HANG}, codes


def test_array_task_on_2_nodes_requeues_only_itself(multinode_cluster, tmp_path):
    env = multinode_cluster.env
    # Each array task spans 2 nodes; its rank 0 (task 1 only, first run only) requeues
    # ${SLURM_ARRAY_JOB_ID}_${SLURM_ARRAY_TASK_ID}, the other rank just notes its node.
    task = (f'if [ "$SLURM_PROCID" = 0 ]; then exec {sys.executable} '
            f'{PROBES / "probe_requeue.py"} {tmp_path} 1; else hostname > '
            f'{tmp_path}/host_${{SLURM_ARRAY_TASK_ID}}_${{SLURM_RESTART_COUNT:-0}}; fi')
    script = f"""#!/bin/bash
#SBATCH --time=2
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --requeue
#SBATCH --array=0-1
#SBATCH --open-mode=append
#SBATCH --output={tmp_path}/job_%A_%a.out
srun bash -c '{task}'
"""
    arr = submit(script, cwd=tmp_path, env=env)
    t1 = wait_job(f"{arr}_1", timeout=120, env=env)
    t0 = wait_job(f"{arr}_0", timeout=60, env=env)
    assert t1["JobState"] == "COMPLETED" and t1["Restarts"] == "1"
    assert t0["JobState"] == "COMPLETED" and t0["Restarts"] == "0"
    assert t0["NumNodes"] == t1["NumNodes"] == "2"
    req = json.loads((tmp_path / f"run_{arr}_1_0.json").read_text())
    assert req["requeue_id"] == f"{arr}_1" and req["result"]["ok"]
    assert (tmp_path / f"run_{arr}_1_1.json").exists() and (tmp_path / "host_1_1").exists()
    assert sorted(p.name for p in tmp_path.glob(f"run_{arr}_0_*.json")) == [f"run_{arr}_0_0.json"]
    assert not (tmp_path / "host_0_1").exists()
