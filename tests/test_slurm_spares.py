"""Spare nodes and the relaunch in place on the multi-node SLURM cluster (issue 23, template
``multi_node``): 3 nodes, 2 training (2 DDP ranks each, gloo) and 1 spare, periodic checkpoints
every 50 steps. A training node killed (every process SIGKILLed, slurmd too) at a random step
between two saves: the survivors rescue the last step boundary, ``kempner-resilience srun``
ends the old step at once, records the dead node and starts a new step on the survivor plus the
spare. The job stays RUNNING with the same id and no requeue, loses at most one step and ends
bitwise equal to an uninterrupted run. With ``SlurmdTimeout=300`` (production's) as well: the
relaunch never waits for SLURM to notice the death.
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kempner_resilience.checkpoint import layout
from kempner_resilience.demo.compare import compare_weights
from kempner_resilience.demo.slurm_demo import DemoJob, wait_until, write_job
from kempner_resilience.slurm.badnodes import bad_nodes
from slurm_fixtures import multinode_cluster, multinode_jobs, slow_death  # noqa: F401
from kempner_resilience.core.runpaths import RunPaths

pytestmark = [pytest.mark.slurm]

RANKS, NODES, SPARES = 4, 2, 1
STEPS, EVERY = 130, 50
STEP_TIME = 0.05


@pytest.fixture(scope="module")
def reference(reference_run) -> Path:
    """The uninterrupted run: 4 plain DDP processes, no SLURM, no checkpoints."""
    return reference_run(ranks=RANKS, steps=STEPS)


def _submit(cluster, tmp_path: Path, jobs, *, hang_timeout_s: float = 30,
            train_args: tuple[str, ...] = (), name: str = "job", rank_files: bool = False,
            **options) -> DemoJob:
    """The demo job; its ranks start warm (the trainer is each task's command) unless
    ``rank_files`` wraps each in a shell that writes its exit status."""
    env = dict(cluster.env, PATH=f"{Path(sys.executable).parent}:{cluster.env.get('PATH', '')}")
    job = write_job(tmp_path / name, ranks=RANKS, nodes=NODES, spares=SPARES, steps=STEPS,
                    step_time=STEP_TIME, every_steps=EVERY, rank_files=rank_files, env=env,
                    sets=[f"watchdog.hang_timeout_s={hang_timeout_s}"],
                    train_args=list(train_args), **options)
    jobs[0].append(job)
    job.submit()
    return job


def _steps_completed(job: DemoJob, run: str) -> int:
    text = job.progress.read_text().split(f"# run {run}\n", 1)[1].split("# run ")[0]
    return 1 + max(int(s) for s in re.findall(r"^rank \d+ step (\d+)$", text, re.M))


def _kill_a_training_node_and_finish(cluster, job: DemoJob, jobs, reference: Path) -> str:
    kill_at = random.randint(EVERY + 3, 2 * EVERY - 5)
    job.wait_step(kill_at, timeout=240)
    job_id = job.job_id
    batch_node, dead, spare = job.hosts()            # krnode1 runs the batch script
    jobs[1].append(dead)
    cluster.kill_node(dead)
    # The training ends in the same job: rank 0 of the relaunched step writes the weights.
    wait_until(lambda: "srun exited with" in job.log_text(), 240,
               f"job {job_id}'s batch script ending")
    assert "srun exited with 0" in job.log_text(), job.log_text()[-4000:]
    info = job.info()
    assert info.get("JobId") == job_id and info.get("Restarts") == "0", info
    assert job.report("0.1") is not None and job.report(1) is None and \
        job.report("1.0") is None, job.log_text()[-4000:]

    same, total, diff = compare_weights(reference, job.weights)
    assert not diff, f"{len(diff)} of {total} tensors differ after a kill at {kill_at}"
    resumed = job.report("0.1")["resumed_from"]
    completed = _steps_completed(job, "0.0")
    committed = {e.step: e.manifest for e in layout.scan(RunPaths(job.checkpoints)) if e.committed}
    if committed.get(resumed, {}).get("reason") == "rescue":
        assert completed - resumed <= 1, (completed, resumed)
    else:   # a clean fallback to the periodic save (the dead ranks were behind the survivors)
        assert resumed == EVERY, (resumed, job.log_text()[-3000:])
    # The relaunch ran on the survivor and the spare, never on the dead node again.
    assert bad_nodes(RunPaths(job.checkpoints)) == {dead}
    assert f"--nodelist={batch_node},{spare}" in job.log_text(), job.log_text()[-3000:]
    return dead


def test_a_node_killed_between_saves_is_replaced_by_the_spare_in_the_same_job_bitwise(
        multinode_cluster, tmp_path, reference, multinode_jobs):
    job = _submit(multinode_cluster, tmp_path, multinode_jobs)
    _kill_a_training_node_and_finish(multinode_cluster, job, multinode_jobs, reference)
    info = job.wait_state(timeout=120)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", info


def test_the_relaunch_does_not_wait_for_slurm_to_notice_the_dead_node(
        slow_death, tmp_path, reference, multinode_jobs):
    job = _submit(slow_death, tmp_path, multinode_jobs)
    dead = _kill_a_training_node_and_finish(slow_death, job, multinode_jobs, reference)
    # SLURM still had not noticed: the node is not DOWN, the training was over all the same.
    state = subprocess.run(["sinfo", "-h", "-n", dead, "-o", "%t"], capture_output=True,
                           text=True, env=slow_death.env, timeout=30).stdout.strip()
    assert "down" not in state, state



def test_a_rank_hung_with_the_gil_held_gets_its_node_excluded_and_the_spare_takes_over_bitwise(
        multinode_cluster, tmp_path, reference, multinode_jobs):
    # Rank 2 (krnode2) hangs inside step 60 in a C call that keeps the GIL: its backstop ends it
    # with HANG; the others' hang watchdogs fire too (they say so: note_hang_seen), rescue and
    # exit with HANG as well, or with PEER_LOST once rank 2 is gone. Either way krnode2 is the
    # one kept out, although srun may report the survivors' node first.
    hang_at = 60
    job = _submit(multinode_cluster, tmp_path, multinode_jobs, hang_timeout_s=8, rank_files=True,
                  train_args=("--hang-at", str(hang_at), "--hang-rank", "2", "--hang-holds-gil",
                              "--hang-marker", str(tmp_path / "hang.done")))
    info = job.wait_state(timeout=300)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "0", job.log_text()[-4000:]
    same, total, diff = compare_weights(reference, job.weights)
    assert not diff, f"{len(diff)} of {total} tensors differ after a hang at {hang_at}"
    assert job.rank_exit("0.0", 2) == 42
    assert bad_nodes(RunPaths(job.checkpoints)) == {"krnode2"}
    assert job.report("0.1") is not None and job.report("0.1")["resumed_from"] in (hang_at,
                                                                                    EVERY)
    assert "--nodelist=krnode1,krnode3" in job.log_text(), job.log_text()[-3000:]


def test_the_readme_usage_relaunches_in_place_ends_completed_and_keeps_its_bad_nodes_to_itself(
        slow_death, tmp_path, reference, multinode_jobs):
    # The README's usage (issue 29): the script sets checkpoint.dir in code; `sbatch --spares 1`
    # is given no --set, and the job is submitted from a directory whose ./checkpoints is not
    # the run's. The ranks tell `kempner-resilience srun` which run it supervises.
    job = _submit(slow_death, tmp_path, multinode_jobs, name="a", config_in_script=True,
                  submit_dir=tmp_path)
    own = job.sbatch_args[:job.sbatch_args.index("--")]
    [loop] = [line for line in job.script.read_text().splitlines()
              if line.startswith("kempner-resilience srun")]
    assert "--set" not in own and "--set" not in loop.split(" -- ")[0], loop
    dead = _kill_a_training_node_and_finish(slow_death, job, multinode_jobs, reference)
    # Over within a minute of its training, although SLURM has not noticed the dead node yet.
    info = job.wait_state(timeout=60)
    assert info["JobState"] == "COMPLETED", (info, job.log_text()[-3000:])
    # Nothing was guessed into the submit directory; the job's channel went with the job.
    assert not (tmp_path / "checkpoints").exists()
    assert not (tmp_path / ".kempner-resilience").exists()

    # A second run from the same directory, on the node the first one lost (back up now): it
    # has no bad node of its own, so it trains on the first two nodes.
    slow_death.restart_node(dead)
    multinode_jobs[1].remove(dead)
    other = _submit(slow_death, tmp_path, multinode_jobs, name="b", config_in_script=True,
                    submit_dir=tmp_path)
    info = other.wait_state(timeout=240)
    assert info["JobState"] == "COMPLETED", other.log_text()[-3000:]
    assert bad_nodes(RunPaths(other.checkpoints)) == set()
    assert bad_nodes(RunPaths(job.checkpoints)) == {dead}
    nodes = other.hosts()
    assert f"--nodelist={nodes[0]},{nodes[1]}" in other.log_text(), other.log_text()[-3000:]


def test_a_job_wide_usr1_reaching_warm_ranks_both_ways_is_one_stop_that_requeues_and_resumes_bitwise(
        multinode_cluster, tmp_path, reference, multinode_jobs):
    # What --signal=USR1@lead does: every step of the job gets it, the standby's (where the
    # warm ranks live) and the training step's (their shims, which pass it on).
    job = _submit(multinode_cluster, tmp_path, multinode_jobs)
    job.wait_step(30, timeout=240)
    assert "standby: warm ranks" in job.log_text(), job.log_text()[-3000:]
    job.signal("USR1")
    first = wait_until(lambda: job.report("0.0"), 120, "the signalled run's report")
    assert first["exit_code"] == 75, job.log_text()[-4000:]
    stops = re.findall(r"\[rank (\d)\] stopping at step (\d+)", job.log_text())
    assert {r for r, _ in stops} == {"0", "1", "2", "3"} and len({s for _, s in stops}) == 1, stops
    assert "second SIG" not in job.log_text()
    info = job.wait_state(timeout=300)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", job.log_text()[-3000:]
    _, total, diff = compare_weights(reference, job.weights)
    assert not diff, f"{len(diff)} of {total} tensors differ after the requeue"
