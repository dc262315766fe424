"""End to end on the real cluster: the shipped sbatch template, the demo trainer, real signals.

Each test renders ``slurm/single_node.sbatch`` for the demo trainer (small: 1-2 tasks, ~60 steps),
submits it, interrupts it the way SLURM does in production (``scancel --signal=USR1``, a real
time-limit warning, a real preemption by the ``high`` partition), and checks that the emergency
checkpoint was committed, the job requeued (``scontrol show job``: Restarts, JobState), the next
run resumed from that checkpoint with ``SLURM_RESTART_COUNT`` set, and the final weights are
bitwise equal to an uninterrupted run of the same trainer (plain processes, no SLURM).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kempner_resilience.demo.compare import compare_weights
from kempner_resilience.demo.slurm_demo import DemoJob, write_job
from kempner_resilience.exitcodes import ExitCode
from slurm_fixtures import slurm_cluster, submit, wait_for, wait_job  # noqa: F401

pytestmark = [pytest.mark.slurm]

STEPS = 60


@pytest.fixture(scope="module")
def reference(reference_run):
    """The uninterrupted run's weights, per world size (``reference_run``: computed once)."""
    return lambda ranks: reference_run(ranks=ranks, steps=STEPS)


@pytest.fixture
def jobs():
    """Cancel whatever a failed test left on the shared one-node cluster."""
    made: list[DemoJob] = []
    yield made
    for job in made:
        if job.info().get("JobState") not in (None, "COMPLETED", "FAILED", "CANCELLED"):
            job.cancel()


def _new_job(jobs, tmp_path, **kw) -> DemoJob:
    job = write_job(tmp_path / "job", steps=kw.pop("steps", STEPS), **kw)
    jobs.append(job)
    return job


def _assert_resumed_and_equal(job: DemoJob, ref, first_run: dict, restarts: int = 1) -> dict:
    info = job.wait_state(timeout=180)
    log = job.log_text()
    assert info["JobState"] == "COMPLETED", log[-3000:]
    assert info["Restarts"] == str(restarts)
    assert info["ExitCode"] == "0:0"
    last = job.report(restarts)
    assert last is not None, log[-3000:]
    # The requeued run saw SLURM_RESTART_COUNT (its report is named after it; the template
    # echoes it) and resumed exactly from the emergency checkpoint.
    assert f"restart {restarts}" in log
    assert last["exit_code"] == 0
    assert last["resumed_from"] == first_run["saved_step"] > 0
    assert last["start_step"] == first_run["saved_step"]
    same, total, diff = compare_weights(ref, job.weights)
    assert not diff, f"{len(diff)} of {total} tensors differ: {diff[:5]}"
    return last


@pytest.mark.parametrize("ranks", [1, 2])
def test_usr1_checkpoints_requeues_resumes_bitwise_equal(slurm_cluster, tmp_path, reference,
                                                         jobs, ranks):
    job = _new_job(jobs, tmp_path, ranks=ranks, step_time=0.1)
    job.submit()
    job.wait_step(15, timeout=180)
    job.signal("USR1")
    first = wait_for(lambda: job.report(0), timeout=120, what="the first run's report")
    assert first["exit_code"] == ExitCode.REQUEUE, job.log_text()[-3000:]
    assert first["world_size"] == ranks
    assert first["stop_step"] == first["saved_step"] >= 15
    assert (job.checkpoints / f"step_{first['saved_step']:09d}").is_dir() or first["saved_path"]
    assert first["timings"]["requeue_s"] < 15
    # Rank 0 called scontrol requeue after the commit (its report says how long it took), and
    # SLURM acted on it: the job ran again (Restarts=1, below). Not slurmstepd's "CANCELLED ...
    # DUE TO JOB REQUEUE" line: when every rank has exited before slurmctld's kill reaches the
    # step (a fast teardown; seen in CI), there is no step left to cancel and no such line.
    _assert_resumed_and_equal(job, reference(ranks), first)


def test_twice_interrupted_job_reports_three_attempts_whose_parts_add_up(slurm_cluster, tmp_path,
                                                                          reference, jobs):
    # USR1 in the first and in the second run: two requeues on the real cluster, then `report`
    # (the CLI, as a user runs it) on the checkpoint directory.
    job = _new_job(jobs, tmp_path, ranks=1, step_time=0.1)
    job.submit()
    job.wait_step(10, timeout=180)
    job.signal("USR1")
    first = wait_for(lambda: job.report(0), timeout=120, what="the first run's report")
    assert first["exit_code"] == ExitCode.REQUEUE, job.log_text()[-3000:]
    wait_for(lambda: (job.steps_done_in_run(1) or 0) >= first["saved_step"] + 10, timeout=180,
             what="the second run to make progress")
    job.signal("USR1")
    second = wait_for(lambda: job.report(1), timeout=120, what="the second run's report")
    assert second["exit_code"] == ExitCode.REQUEUE and second["resumed_from"] == \
        first["saved_step"], job.log_text()[-3000:]
    _assert_resumed_and_equal(job, reference(1), second, restarts=2)

    cli = Path(sys.executable).parent / "kempner-resilience"
    out = subprocess.run([str(cli), "report", str(job.checkpoints), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    g = json.loads(out.stdout)
    assert [a["exit_code"] for a in g["attempts"]] == [ExitCode.REQUEUE, ExitCode.REQUEUE, 0]
    assert [a["restart_count"] for a in g["attempts"]] == [0, 1, 2]
    assert abs(sum(g["parts_s"].values()) - g["wall_s"]) < 1.0
    assert sum(a["kept_steps"] for a in g["attempts"]) == STEPS
    assert 0 < g["goodput"] <= 1
    text = subprocess.run([str(cli), "report", str(job.checkpoints)], capture_output=True,
                          text=True, timeout=60).stdout
    assert "3 attempt(s)" in text and "goodput" in text


def test_time_limit_warning_checkpoints_requeues_resumes(slurm_cluster, tmp_path, reference,
                                                         jobs):
    # --time=2 with --signal=USR1@60: SLURM checks limits every 30 s, so the warning lands 30-60 s
    # into the run (60-90 s before the end). Uninterrupted the job would need ~75 s.
    job = _new_job(jobs, tmp_path, ranks=1, step_time=1.2, time_limit="2", lead_time_s=60)
    assert "#SBATCH --signal=USR1@60" in job.script.read_text().splitlines()
    job.submit()
    t_start = time.monotonic()
    first = wait_for(lambda: job.report(0), timeout=150, poll=0.5,
                     what="the time-limit warning to stop the first run")
    t_warn = time.monotonic() - t_start
    assert first["exit_code"] == ExitCode.REQUEUE, job.log_text()[-3000:]
    assert 0 < first["saved_step"] < STEPS
    # Time limits do not requeue by themselves: only our `scontrol requeue` brought it back.
    job.wait_state({"PENDING", "RUNNING", "COMPLETING", "COMPLETED"}, restarts=1, timeout=60)
    # The requeued run gets the same 2 minutes; give it room so its own warning does not
    # requeue it again (that would work too, just slower).
    subprocess.run(["scontrol", "update", f"JobId={job.job_id}", "TimeLimit=10"],
                   capture_output=True, timeout=30)
    _assert_resumed_and_equal(job, reference(1), first)
    assert t_warn < 115


def test_preemption_by_high_partition_checkpoints_and_resumes(slurm_cluster, tmp_path,
                                                              reference, jobs):
    job = _new_job(jobs, tmp_path, ranks=1, step_time=0.15, partition="low")
    job.submit()
    job.wait_step(10, timeout=180)
    # Needs the whole node: slurmctld preempts the low job (USR1 at once with
    # preempt_send_user_signal, SIGTERM after GraceTime) and requeues it (PreemptMode=REQUEUE).
    high = submit(f"#!/bin/bash\n#SBATCH -p high\n#SBATCH -n 8\n#SBATCH -o {tmp_path}/high.out\n"
                  "true\n", cwd=tmp_path)
    first = wait_for(lambda: job.report(0), timeout=120, what="the preempted run's report")
    assert first["saved_step"] is not None and first["saved_step"] >= 10
    # USR1 first: checkpoint and our own requeue (75); had SIGTERM come first: stop (143) and
    # SLURM's preemption requeue. Either way the checkpoint is committed before the exit.
    assert first["exit_code"] in (ExitCode.REQUEUE, ExitCode.SIGTERM,
                                  ExitCode.REQUEUE_FAILED), first
    assert wait_job(high, timeout=120)["JobState"] == "COMPLETED"
    _assert_resumed_and_equal(job, reference(1), first)


def test_restart_budget_exhausted_ends_with_no_requeue_and_stays_ended(slurm_cluster, tmp_path,
                                                                       jobs):
    job = _new_job(jobs, tmp_path, ranks=1, step_time=0.1, sets=["requeue.max_restarts=1"])
    job.submit()
    job.wait_step(10, timeout=180)
    job.signal("USR1")
    first = wait_for(lambda: job.report(0), timeout=120, what="the first run's report")
    assert first["exit_code"] == ExitCode.REQUEUE
    job.wait_state({"RUNNING"}, restarts=1, timeout=120)
    wait_for(lambda: (job.steps_done_in_run(1) or 0) >= first["saved_step"] + 5, timeout=120,
             what="the second run making progress")
    job.signal("USR1")
    second = wait_for(lambda: job.report(1), timeout=120, what="the second run's report")
    assert second["exit_code"] == ExitCode.NO_REQUEUE, job.log_text()[-3000:]
    assert second["resumed_from"] == first["saved_step"]
    assert second["saved_step"] > first["saved_step"]  # the work is still saved
    info = job.wait_state(timeout=60)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == f"{int(ExitCode.NO_REQUEUE)}:0"
    assert "restart budget exhausted" in job.log_text()
    time.sleep(8)  # longer than a requeue takes to show up here
    info = job.info()
    assert info["JobState"] == "FAILED" and info["Restarts"] == "1"
    assert job.report(2) is None
    assert f"srun exited with {int(ExitCode.NO_REQUEUE)}" in job.log_text()


def test_demo_slurm_tells_the_story_through_the_template(slurm_cluster, tmp_path):
    cli = str(Path(sys.executable).parent / "kempner-resilience")
    proc = subprocess.run([cli, "demo", "--slurm", "--ranks", "1", "--steps", "30",
                           "--interrupt-at", "10", "--step-time", "0.1", "--workdir",
                           str(tmp_path / "demo")], capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "scancel --signal=USR1" in out and "SLURM requeued job" in out
    assert "exit REQUEUE (75)" in out and "resumed at step" in out
    assert "bitwise IDENTICAL" in out


def test_hang_under_slurm_is_detected_requeued_by_rank_0_and_resumed(slurm_cluster, tmp_path,
                                                                    reference, jobs):
    # Periodic checkpoints every 5 steps; the first run hangs inside step 22 (a C call that never
    # returns). The hang watchdog dumps stacks, rank 0 requeues (a committed checkpoint exists),
    # and the process exits with HANG; the requeued run resumes from step 20.
    job = _new_job(jobs, tmp_path, ranks=1, step_time=0.05,
                   sets=["watchdog.hang_timeout_s=4"],
                   train_args=["--hang-at", "22", "--hang-marker", tmp_path / "hang.done"])
    job.submit()
    info = job.wait_state(timeout=240)
    log = job.log_text()
    assert info["JobState"] == "COMPLETED", log[-3000:]
    assert info["Restarts"] == "1"
    assert "hang detected" in log
    # Rank 0 asked for the requeue (nothing else requeues a hung job). Its own log lines about it
    # may be lost (srun stops relaying output once the requeue cancels the step); SLURM's not.
    assert "DUE TO JOB REQUEUE" in log
    second = job.report(1)
    assert second is not None and second["resumed_from"] == 20, log[-3000:]
    same, total, diff = compare_weights(reference(1), job.weights)
    assert not diff, f"{len(diff)} of {total} tensors differ: {diff[:5]}"
