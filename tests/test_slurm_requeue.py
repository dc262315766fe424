"""requeue_job against fake and real scontrol; the policy's requeue (scheduler_decision): the
restart budget and the ledger."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from kempner_resilience.config import RequeueConfig
from kempner_resilience.exitcodes import ExitCode, Verdict
from kempner_resilience.slurm import (
    RestartLedger,
    SlurmJob,
    requeue_job,
    scheduler_decision,
)
from kempner_resilience.slurm.requeue import REQUESTED
from kempner_resilience.core.runpaths import RunPaths
from slurm_fixtures import job_info, slurm_cluster, submit, wait_for, wait_job  # noqa: F401

PROBES = Path(__file__).resolve().parent / "cluster"


# ----------------------------------------------------------------- fake scontrol on PATH

@pytest.fixture
def fake_scontrol(tmp_path, monkeypatch):
    """Install ``body`` as the only ``scontrol`` on PATH; returns the call log path."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    calls = tmp_path / "calls"

    def install(body: str | None) -> Path:
        if body is not None:
            exe = bindir / "scontrol"
            exe.write_text(f"#!/bin/bash\necho \"$@\" >> {calls}\n{body}\n")
            exe.chmod(0o755)
        # With a fake, the system dirs stay on PATH (for sleep, touch) behind it; without one,
        # PATH is only the empty dir, so no scontrol is found at all.
        monkeypatch.setenv("PATH", str(bindir) + ("" if body is None else ":/usr/bin:/bin"))
        return calls

    return install


JOB = SlurmJob(job_id="4242")


def test_requeue_reports_missing_scontrol_with_fix(fake_scontrol):
    fake_scontrol(None)
    res = requeue_job(JOB, RequeueConfig())
    assert not res.ok and res.verdict is Verdict.SCONTROL_FAILED
    assert "not found" in res.message and "container" in res.message
    assert res.attempts == 1  # a missing binary is not retried


def test_requeue_retries_once_after_nonzero_exit(fake_scontrol):
    calls = fake_scontrol('echo "scontrol: error: Socket timed out on send/recv" >&2; exit 1')
    res = requeue_job(JOB, RequeueConfig(retries=1))
    assert not res.ok and res.attempts == 2 and res.returncode == 1
    assert "Socket timed out" in res.message and "Fix:" in res.message
    assert calls.read_text().splitlines() == ["requeue 4242", "requeue 4242"]


def test_requeue_succeeds_on_retry_after_transient_failure(fake_scontrol, tmp_path):
    marker = tmp_path / "failed_once"
    fake_scontrol(f'if [ ! -e {marker} ]; then touch {marker}; exit 1; fi; exit 0')
    res = requeue_job(JOB, RequeueConfig(retries=1))
    assert res.ok and res.attempts == 2 and res.verdict is Verdict.REQUEUED


def test_requeue_hang_times_out_and_kills_the_hung_process(fake_scontrol, tmp_path):
    pids = tmp_path / "pids"
    # A child of the wrapper that would outlive it: it must be killed with the process group.
    fake_scontrol(f"sleep 30 & echo $! >> {pids}; wait")
    res = requeue_job(JOB, RequeueConfig(scontrol_timeout_s=0.5, retries=1))
    assert not res.ok and res.attempts == 2 and res.returncode is None
    assert "no answer" in res.message and "scontrol_timeout_s" in res.message
    hung = [int(p) for p in pids.read_text().split()]
    assert len(hung) == 2
    # SIGKILL to the process group is delivered asynchronously: allow the kernel a moment.
    end = time.monotonic() + 5.0
    while any(_alive(pid) for pid in hung) and time.monotonic() < end:
        time.sleep(0.02)
    assert not any(_alive(pid) for pid in hung), "the hung scontrol's child was left running"


def _alive(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False
    return "\nState:\tZ" not in status and "\nState:\tX" not in status


def test_requeue_of_disabled_job_names_the_sbatch_fix_and_is_not_retried(fake_scontrol):
    calls = fake_scontrol('echo "Requested operation is presently disabled for job 4242" >&2; '
                          'exit 1')
    res = requeue_job(JOB, RequeueConfig(retries=3))
    assert not res.ok and res.attempts == 1 and "#SBATCH --requeue" in res.message
    assert len(calls.read_text().splitlines()) == 1


def test_requeue_uses_array_id_for_array_tasks(fake_scontrol):
    calls = fake_scontrol("exit 0")
    job = SlurmJob(job_id="1043", array_job_id="1040", array_task_id="3")
    assert requeue_job(job, RequeueConfig()).ok
    assert calls.read_text().strip() == "requeue 1040_3"


# ----------------------------------------------------------------- restart budget

def decide_requeue(who, ledger, step, cfg):
    """The policy's requeue for ranks that stopped and asked to run again."""
    return scheduler_decision(REQUESTED, who, ledger, step, cfg)


def test_budget_allows_requeue_until_max_restarts_then_no_requeue(tmp_path):
    cfg = RequeueConfig(max_restarts=3, max_no_progress=0)
    ledger = RunPaths(tmp_path).restarts
    outcomes = [decide_requeue(rc, ledger, 100 * rc, cfg) for rc in range(5)]
    assert [d.runs_again for d in outcomes] == [True] * 3 + [False] * 2
    assert outcomes[3].verdict is Verdict.BUDGET_SPENT and "budget" in outcomes[3].why
    assert outcomes[0].verdict is Verdict.REQUEUED


def test_no_progress_over_max_no_progress_restarts_stops_using_the_ledger_on_disk(tmp_path):
    cfg = RequeueConfig(max_restarts=20, max_no_progress=2)
    path = RunPaths(tmp_path).restarts
    job = lambda rc: SlurmJob(job_id="9", restart_count=rc)  # noqa: E731
    # Each decision loads the ledger from disk, as a fresh process after a requeue would.
    assert decide_requeue(job(0), RestartLedger.load(path), 50, cfg).runs_again
    assert decide_requeue(job(1), RestartLedger.load(path), 80, cfg).runs_again  # progress
    assert decide_requeue(job(2), RestartLedger.load(path), 80, cfg).runs_again  # 1 stalled
    d = decide_requeue(job(3), RestartLedger.load(path), 80, cfg)  # 2 stalled
    assert d.verdict is Verdict.NO_PROGRESS and "no progress" in d.why
    data = json.loads(path.read_text())
    assert data["job_id"] == "9"
    assert {k: v["step"] for k, v in data["restarts"].items()} == {
        "0": 50, "1": 80, "2": 80, "3": 80}


def test_progress_resets_the_no_progress_count(tmp_path):
    cfg = RequeueConfig(max_restarts="unlimited", max_no_progress=2)
    path = RunPaths(tmp_path).restarts
    steps = [10, 10, 20, 20, 30]
    assert all(decide_requeue(rc, path, s, cfg).runs_again for rc, s in enumerate(steps))


def test_new_job_id_starts_a_fresh_ledger(tmp_path):
    cfg = RequeueConfig(max_no_progress=1)
    path = RunPaths(tmp_path).restarts
    decide_requeue(SlurmJob(job_id="1", restart_count=0), path, 5, cfg)
    decide_requeue(SlurmJob(job_id="1", restart_count=1), path, 5, cfg)  # stalled -> no
    # A fresh sbatch reusing the checkpoint dir must not inherit job 1's stall.
    assert decide_requeue(SlurmJob(job_id="2", restart_count=0), path, 5, cfg).runs_again


def test_decision_outside_slurm_counts_restarts_from_the_ledger(tmp_path):
    cfg = RequeueConfig(max_restarts=2, max_no_progress=0)
    path = RunPaths(tmp_path).restarts
    assert [decide_requeue(None, path, i, cfg).runs_again for i in range(3)] == [
        True, True, False]


def test_disabled_requeue_decides_stop(tmp_path):
    d = decide_requeue(0, None, 5, RequeueConfig(enabled=False))
    assert not d.runs_again and d.verdict is Verdict.DISABLED


def test_corrupt_ledger_is_replaced_not_fatal(tmp_path):
    path = RunPaths(tmp_path).restarts
    path.write_text("{not json")
    assert decide_requeue(0, path, 1, RequeueConfig()).runs_again
    assert json.loads(path.read_text())["restarts"]["0"]["step"] == 1


def test_the_deprecated_decide_requeue_warns_and_answers_with_the_policy_s_decision(tmp_path):
    from kempner_resilience.slurm import decide_requeue as deprecated

    with pytest.warns(DeprecationWarning, match="scheduler_decision"):
        d = deprecated(0, RunPaths(tmp_path).restarts, 5, RequeueConfig(max_restarts=0))
    assert not d.runs_again and d.verdict is Verdict.BUDGET_SPENT


# ----------------------------------------------------------------- real cluster

def _requeue_script(tmp_path: Path, extra: str = "", args: str = "") -> str:
    return f"""#!/bin/bash
#SBATCH --time=2
#SBATCH --open-mode=append
#SBATCH --output={tmp_path}/job_%j.out
{extra}
srun -n1 {sys.executable} {PROBES / 'probe_requeue.py'} {tmp_path} {args}
"""


@pytest.mark.slurm
def test_real_job_requeues_itself_and_reruns_with_restart_count_1(slurm_cluster, tmp_path):
    job_id = submit(_requeue_script(tmp_path, "#SBATCH --requeue"), cwd=tmp_path)
    info = wait_job(job_id, timeout=90)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1"
    first = json.loads((tmp_path / f"run_{job_id}_0.json").read_text())
    second = json.loads((tmp_path / f"run_{job_id}_1.json").read_text())
    assert first["result"]["ok"] and first["result"]["exit_code"] == ExitCode.REQUEUE
    assert second["job"]["restart_count"] == 1 and second["job"]["job_id"] == job_id
    assert "result" not in second


@pytest.mark.slurm
def test_real_array_task_requeues_only_itself(slurm_cluster, tmp_path):
    arr = submit(_requeue_script(tmp_path, "#SBATCH --requeue\n#SBATCH --array=0-1",
                                 args="1"), cwd=tmp_path)
    t1 = wait_job(f"{arr}_1", timeout=90)
    t0 = wait_job(f"{arr}_0", timeout=30)
    assert t1["JobState"] == "COMPLETED" and t1["Restarts"] == "1"
    assert t0["JobState"] == "COMPLETED" and t0["Restarts"] == "0"
    req = json.loads((tmp_path / f"run_{arr}_1_0.json").read_text())
    assert req["requeue_id"] == f"{arr}_1" and req["result"]["ok"]
    assert (tmp_path / f"run_{arr}_1_1.json").exists()
    assert sorted(p.name for p in tmp_path.glob(f"run_{arr}_0_*.json")) == [f"run_{arr}_0_0.json"]


@pytest.mark.slurm
def test_real_no_requeue_job_fails_to_requeue_with_clear_message(slurm_cluster, tmp_path):
    job_id = submit(_requeue_script(tmp_path, "#SBATCH --no-requeue"), cwd=tmp_path)
    info = wait_job(job_id, timeout=60)
    rec = json.loads((tmp_path / f"run_{job_id}_0.json").read_text())
    res = rec["result"]
    assert not res["ok"] and res["exit_code"] == ExitCode.REQUEUE_FAILED
    assert "presently disabled" in res["message"] and "#SBATCH --requeue" in res["message"]
    assert res["attempts"] == 1
    assert info["Restarts"] == "0" and info["ExitCode"].startswith(str(int(ExitCode.REQUEUE_FAILED)))


def test_a_job_slurm_already_requeued_counts_as_requeued(tmp_path, monkeypatch):
    # Preemption with PreemptMode=REQUEUE can requeue the job while we checkpoint.
    from kempner_resilience.config import RequeueConfig
    from kempner_resilience.slurm import requeue_job

    fake = tmp_path / "scontrol"
    fake.write_text("#!/bin/sh\necho 'scontrol: error: Job is pending execution for job 6' >&2\n"
                    "exit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    result = requeue_job("6", RequeueConfig(retries=1))
    assert result.ok
    assert result.attempts == 1
    assert "already requeued" in result.message


def test_a_restart_budget_of_0_never_requeues_as_torchrun_s_max_restarts_0(tmp_path):
    path = RunPaths(tmp_path).restarts
    d = decide_requeue(SlurmJob(job_id="1", restart_count=0), path, 10,
                       RequeueConfig(max_restarts=0))
    assert not d.runs_again and "budget" in d.why


def test_an_unlimited_restart_budget_is_written_unlimited_or_minus_1(tmp_path):
    from kempner_resilience.config import load_config

    for spelling in ("unlimited", "-1"):
        cfg = load_config(None, [f"requeue.max_restarts={spelling}"]).requeue
        assert cfg.restart_limit is None
        assert decide_requeue(SlurmJob(job_id="1", restart_count=10**5), RunPaths(tmp_path)
                              .restarts, 10**5, cfg).runs_again


def test_a_config_with_max_restarts_0_is_told_at_start_that_0_now_means_no_restart(
        tmp_path, caplog):
    import logging

    import torch
    import kempner_resilience as kr

    cfg = kr.load_config(None, [f"checkpoint.dir={tmp_path}", "requeue.max_restarts=0"])
    with caplog.at_level(logging.WARNING):
        with kr.ResilientRun(cfg, state={"model": torch.nn.Linear(2, 2)},
                             exit_mode="raise") as run:
            for _ in run.steps(1):
                pass
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "max_restarts is 0" in said and "unlimited" in said
