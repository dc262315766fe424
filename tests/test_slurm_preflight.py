"""preflight: each launch mistake becomes a finding that names the fix."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from kempner_resilience.config import ResilienceConfig, load_config
from kempner_resilience.slurm import Finding, format_findings, preflight
from slurm_fixtures import slurm_cluster, submit, wait_job  # noqa: F401

GOOD_SCRIPT = "#!/bin/bash\n#SBATCH --time=10\n#SBATCH --signal=USR1@120\nsrun python t.py\n"


def fake_slurm_env(tmp_path: Path, *, script: str = GOOD_SCRIPT, requeue: str = "1",
                   **env: str) -> dict[str, str]:
    """An srun task's environment whose PATH holds a fake scontrol answering for job 5."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (tmp_path / "script").write_text(script)
    exe = bindir / "scontrol"
    exe.write_text(f"""#!/bin/bash
case "$1" in
  show) echo "JobId=5 JobName=t JobState=RUNNING Requeue={requeue} Restarts=0 \
TimeLimit=00:10:00 EndTime=2030-01-01T00:00:00 Partition=low" ;;
  write) cat {tmp_path / 'script'} ;;
  *) exit 1 ;;
esac
""")
    exe.chmod(0o755)
    base = {"PATH": f"{bindir}:/usr/bin:/bin", "SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0",
            "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_OPEN_MODE": "a"}
    return base | env


def codes(findings: list[Finding]) -> set[str]:
    return {f.code for f in findings}


def test_well_launched_srun_task_has_no_findings(tmp_path):
    assert preflight(ResilienceConfig(), fake_slurm_env(tmp_path)) == []


def test_batch_only_signal_spec_is_an_error_for_srun_tasks(tmp_path):
    env = fake_slurm_env(tmp_path, script=GOOD_SCRIPT.replace("USR1@120", "B:USR1@120"))
    [f] = [f for f in preflight(None, env) if f.code == "signal-batch-only"]
    assert f.level == "error" and "B:" in f.message and "--signal=USR1@120" in f.fix


def test_missing_signal_is_reported(tmp_path):
    env = fake_slurm_env(tmp_path, script="#!/bin/bash\n#SBATCH --time=10\nsrun python t.py\n")
    assert "no-signal" in codes(preflight(None, env))


def test_signal_from_sbatch_env_overrides_the_script(tmp_path):
    env = fake_slurm_env(tmp_path, SBATCH_SIGNAL="B:USR1@60")
    assert "signal-batch-only" in codes(preflight(None, env))


def test_torchrun_parent_is_reported(tmp_path):
    env = fake_slurm_env(tmp_path, TORCHELASTIC_RUN_ID="abc", TORCHELASTIC_RESTART_COUNT="0")
    [f] = [f for f in preflight(None, env) if f.code == "torchrun"]
    assert "srun" in f.fix and "SIGUSR1" in f.message


def test_nccl_proxy_dump_signal_clash_is_reported(tmp_path):
    env = fake_slurm_env(tmp_path, NCCL_PROXY_DUMP_SIGNAL="10")  # SIGUSR1
    assert "nccl-dump-signal" in codes(preflight(None, env))
    env["NCCL_PROXY_DUMP_SIGNAL"] = "28"  # SIGWINCH: not ours
    assert "nccl-dump-signal" not in codes(preflight(None, env))


def test_nccl_clash_is_reported_outside_slurm_too():
    assert "nccl-dump-signal" in codes(preflight(None, {"NCCL_PROXY_DUMP_SIGNAL": "12"}))


def test_missing_scontrol_is_reported(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    env = fake_slurm_env(tmp_path, PATH=str(empty))
    [f] = [f for f in preflight(None, env) if f.code == "scontrol-missing"]
    assert f.level == "warn" and "container" in f.message


def test_job_without_requeue_is_reported(tmp_path):
    assert "no-requeue" in codes(preflight(None, fake_slurm_env(tmp_path, requeue="0")))


def test_truncating_log_is_reported(tmp_path):
    env = fake_slurm_env(tmp_path)
    del env["SLURM_OPEN_MODE"]
    assert "log-truncate" in codes(preflight(None, env))


def test_process_started_by_batch_script_without_srun_is_reported(tmp_path):
    env = fake_slurm_env(tmp_path, SLURM_TASK_PID=str(os.getpid() + 1))
    del env["SLURM_STEP_ID"]
    assert "not-srun-task" in codes(preflight(None, env))


def test_execd_batch_shell_with_step_signal_is_reported(tmp_path):
    env = fake_slurm_env(tmp_path, SLURM_TASK_PID=str(os.getpid()))
    del env["SLURM_STEP_ID"]
    found = codes(preflight(None, env))
    assert "signal-to-steps-only" in found and "not-srun-task" not in found


def test_lead_time_shorter_than_measured_save_is_reported(tmp_path):
    # The save, its margin and the requeue/teardown (20 s) must fit in the 120 s lead (the
    # grace, 110 s, covers the save and its margin); the time-limit stop, which would cover a
    # short lead, is off.
    cfg = load_config(overrides=["checkpoint.save_margin_s=10", "signals.grace_s=110",
                                 "requeue.time_limit_stop=false"])
    env = fake_slurm_env(tmp_path)
    assert "signal-lead-short" in codes(preflight(cfg, env, save_seconds=95))
    assert "signal-lead-short" not in codes(preflight(cfg, env, save_seconds=85))


def test_unhandled_signal_is_reported(tmp_path):
    cfg = load_config(overrides=["signals.actions.SIGUSR1=off"])
    assert "signal-not-handled" in codes(preflight(cfg, fake_slurm_env(tmp_path)))


def test_outside_slurm_says_so():
    assert codes(preflight(None, {"PATH": "/usr/bin"})) == {"not-slurm"}


def test_format_findings_orders_by_severity_and_shows_fixes():
    text = format_findings([Finding("info", "a", "note"), Finding("error", "b", "bad", "do x")])
    lines = text.splitlines()
    assert lines[0].startswith("ERROR [b] bad") and "fix: do x" in lines[1]
    assert lines[-1] == "preflight: 1 error, 1 info"
    assert format_findings([]) == "preflight: no problems found"


@pytest.mark.parametrize("bad", ["B:USR1@120", "USR2@120"])
def test_findings_name_a_fix(tmp_path, bad):
    env = fake_slurm_env(tmp_path, script=GOOD_SCRIPT.replace("USR1@120", bad))
    cfg = load_config(overrides=["signals.actions.SIGUSR2=off"])
    assert all(f.fix for f in preflight(cfg, env) if f.level != "info")


@pytest.mark.slurm
def test_real_job_with_batch_only_signal_and_no_srun_gets_findings(slurm_cluster, tmp_path):
    probe = ("import json,sys; from kempner_resilience.slurm import preflight; "
             "open(sys.argv[1],'w').write(json.dumps([f.code for f in preflight()]))")
    script = f"""#!/bin/bash
#SBATCH --time=2
#SBATCH --signal=B:USR1@60
#SBATCH --no-requeue
#SBATCH --output={tmp_path}/job.out
{sys.executable} -c "{probe}" {tmp_path}/child.json
srun -n1 {sys.executable} -c "{probe}" {tmp_path}/task.json
"""
    info = wait_job(submit(script, cwd=tmp_path), timeout=60)
    assert info["JobState"] == "COMPLETED", (tmp_path / "job.out").read_text()
    child = set(json.loads((tmp_path / "child.json").read_text()))
    task = set(json.loads((tmp_path / "task.json").read_text()))
    assert {"not-srun-task", "no-requeue", "log-truncate"} <= child
    assert {"signal-batch-only", "no-requeue", "log-truncate"} <= task
    assert "not-srun-task" not in task


def test_workers_of_kempner_resilience_torchrun_are_not_warned_about_torchrun(tmp_path):
    env = fake_slurm_env(tmp_path, TORCHELASTIC_RUN_ID="abc",
                         KEMPNER_RESILIENCE_TORCHRUN_AGENT="4242")
    found = {f.code: f for f in preflight(None, env)}
    assert "torchrun" not in found
    assert found["torchrun-agent"].level == "info" and "4242" in found["torchrun-agent"].message


def test_every_finding_code_the_package_can_report_is_explained_in_troubleshooting():
    """A user who reads a finding's code finds it in docs/troubleshooting.md."""
    import ast

    from helpers import REPO

    codes = set()
    for path in (REPO / "kempner_resilience").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", "") in
                    ("Finding", "SaveBudget") and len(node.args) >= 2
                    and isinstance(node.args[1], ast.Constant)
                    and isinstance(node.args[1].value, str)):
                codes.add(node.args[1].value)
    assert len(codes) >= 15, codes                      # the scan found the findings
    doc = (REPO / "docs" / "troubleshooting.md").read_text()
    assert sorted(c for c in codes if f"| `{c}` |" not in doc) == []
