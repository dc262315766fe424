"""On the real cluster: a job submitted WITHOUT ``--signal`` and with a 2-minute limit saves on
its own before the limit, requeues, resumes bitwise, and ``report`` accounts for its wall time.

The run reads its end time (``SLURM_JOB_END_TIME`` or ``squeue``) at start and stops once the
time left falls below the estimated save + one step + ``requeue.time_limit_margin_s``: 75 s here
instead of the default 30 s, so the stop comes ~40 s into the 2 minutes instead of ~90 s (the same
behaviour, a shorter test). Uninterrupted, the job needs ~80 s, so without that stop SLURM would
kill it at the limit and the work since the last periodic checkpoint would be lost (and nothing
would requeue it).
"""

from __future__ import annotations

import os
import subprocess

import pytest

from kempner_resilience.demo.compare import compare_weights
from kempner_resilience.demo.slurm_demo import run_reference, write_job
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.core.goodput import PARTS, analyze_dir
from kempner_resilience.core.ledger import read_ledger
from slurm_fixtures import slurm_cluster, wait_for  # noqa: F401

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

STEPS = 36


def test_job_without_signal_saves_before_its_time_limit_requeues_and_resumes_bitwise(
        slurm_cluster, tmp_path):
    ref = run_reference(tmp_path / "reference", ranks=1, steps=STEPS)
    job = write_job(tmp_path / "job", ranks=1, steps=STEPS, step_time=2.0, every_steps=100,
                    time_limit="2", job_name=f"kr-timelimit-{os.getpid()}",
                    sets=["requeue.time_limit_margin_s=75"])
    lines = job.script.read_text().splitlines()
    job.script.write_text("\n".join(l for l in lines if "--signal" not in l) + "\n")
    assert "--signal" not in job.script.read_text()
    job.submit()
    try:
        first = wait_for(lambda: job.report(0), timeout=420, poll=0.5,
                         what="the first run to stop on its own before the time limit")
        assert first["exit_code"] == ExitCode.REQUEUE, job.log_text()[-3000:]
        assert 0 < first["saved_step"] == first["stop_step"] < STEPS
        job.wait_state({"PENDING", "RUNNING", "COMPLETING", "COMPLETED"}, restarts=1,
                       timeout=60)
        # The requeued run gets 2 minutes again; give it room to finish in one go.
        subprocess.run(["scontrol", "update", f"JobId={job.job_id}", "TimeLimit=10"],
                       capture_output=True, timeout=30)
        info = job.wait_state(timeout=240)
        assert info["JobState"] == "COMPLETED", job.log_text()[-3000:]
        assert info["Restarts"] == "1"
        last = job.report(1)
        assert last["resumed_from"] == first["saved_step"]
        same, total, diff = compare_weights(ref, job.weights)
        assert not diff, f"{len(diff)} of {total} tensors differ: {diff[:5]}"
    finally:
        if job.info().get("JobState") not in (None, "COMPLETED", "FAILED", "CANCELLED"):
            job.cancel()
    events = read_ledger(job.checkpoints / "ledger.jsonl")
    stop = next(e for e in events if e["ev"] == "stop")
    assert stop["signal"] == "time-limit" and stop["step"] == first["stop_step"]
    g = analyze_dir(job.checkpoints)
    assert [a.job_id for a in g.attempts] == [job.job_id, job.job_id]
    assert [a.exit_code for a in g.attempts] == [ExitCode.REQUEUE, 0]
    assert abs(sum(g.parts[p] for p in (*PARTS, "queue")) - g.wall_s) < 1.0
    assert sum(a.kept_steps for a in g.attempts) == STEPS
