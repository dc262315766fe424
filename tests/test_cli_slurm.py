"""`kempner-resilience doctor` and `kempner-resilience sbatch`, run as the installed command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slurm_fixtures import slurm_cluster, submit, wait_job  # noqa: F401

CLI = str(Path(sys.executable).parent / "kempner-resilience")


def run(*args: str, env: dict[str, str] | None = None, cwd=None) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items()
            if not k.startswith("SLURM_") and k not in ("NCCL_PROXY_DUMP_SIGNAL",
                                                          "KEMPNER_RESILIENCE_CONFIG")}
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120,
                          env={**base, **(env or {})}, cwd=cwd)


def test_help_lists_doctor_and_sbatch():
    proc = run("--help")
    assert proc.returncode == 0 and "doctor" in proc.stdout and "sbatch" in proc.stdout
    for verb in ("doctor", "sbatch"):
        proc = run(verb, "--help")
        assert proc.returncode == 0, proc.stderr
        assert "--config" in proc.stdout and "--set" in proc.stdout


def test_doctor_outside_slurm_is_info_only_and_exits_0():
    proc = run("doctor")
    assert proc.returncode == 0, proc.stderr
    assert "[not-slurm]" in proc.stdout and "not running under SLURM" in proc.stdout
    assert "--signal=USR1@120" in proc.stdout  # what a batch script for this config needs
    assert "Traceback" not in proc.stderr


def test_doctor_flags_the_nccl_signal_clash_and_uses_config_and_save_seconds():
    proc = run("doctor", "--set", "signals.grace_s=30", "--save-seconds", "200",
               env={"NCCL_PROXY_DUMP_SIGNAL": "10"})  # SIGUSR1
    assert proc.returncode == 0  # a warning, not an error
    assert "[nccl-dump-signal]" in proc.stdout and "WARN" in proc.stdout
    assert "--signal=USR1@225" in proc.stdout  # 200 s save + 5 s margin + 20 s requeue/teardown


def test_doctor_errors_are_one_line_without_traceback(tmp_path):
    proc = run("doctor", "--set", "signals.grace_s=-1")
    assert proc.returncode == 78 and "signals.grace_s" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run("doctor", "--config", str(tmp_path / "missing.yaml"))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    proc = run("doctor", "--save-seconds", "-3")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr


def test_sbatch_renders_to_stdout_with_command_after_double_dash():
    proc = run("sbatch", "--job-name", "llm", "--time", "2-00:00:00", "--nodes", "2",
               "--ntasks-per-node", "4", "--gpus-per-node", "4", "--extra", "partition=gpu",
               "--extra", "exclusive", "--", "python", "train.py", "--name", "a b")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    for line in ("#SBATCH --job-name=llm", "#SBATCH --time=2-00:00:00", "#SBATCH --nodes=2",
                 "#SBATCH --ntasks-per-node=4", "#SBATCH --gpus-per-node=4",
                 "#SBATCH --signal=USR1@120", "#SBATCH --requeue", "#SBATCH --open-mode=append",
                 "#SBATCH --partition=gpu", "#SBATCH --exclusive",
                 "srun --kill-on-bad-exit=1 python train.py --name 'a b'"):
        assert line in lines, line
    assert "several nodes" in proc.stdout  # --nodes 2 picked the multi_node template


def test_sbatch_writes_a_file_with_config_and_save_seconds(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("signals:\n  grace_s: 200\n")
    out = tmp_path / "job.sbatch"
    proc = run("sbatch", "--config", str(cfg), "--array", "0-7", "--output", str(out),
               "--", "python", "train.py")
    assert proc.returncode == 0, proc.stderr
    text = out.read_text()
    assert "#SBATCH --signal=USR1@220" in text.splitlines()
    assert "#SBATCH --array=0-7" in text.splitlines()
    assert f"export KEMPNER_RESILIENCE_CONFIG={cfg}" in text.splitlines()
    assert os.access(out, os.X_OK) and "sbatch " + str(out) in proc.stderr
    proc = run("sbatch", "--save-seconds", "300", "--lead-time", "400")
    assert "#SBATCH --signal=USR1@400" in proc.stdout.splitlines()


@pytest.mark.parametrize("args, words", [
    (["--template", "job_array"], "array"),
    (["--template", "single_node", "--nodes", "3"], "multi_node"),
    (["--ntasks-per-node", "0"], "ntasks_per_node"),
    (["--extra", "=x"], "--extra"),
    (["--template", "nope"], "invalid choice"),
    (["--set", "checkpoint.every_steps=-1"], "checkpoint.every_steps"),
])
def test_sbatch_errors_are_one_line_without_traceback(args, words):
    proc = run("sbatch", *args)
    assert proc.returncode != 0
    assert words in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.slurm
def test_sbatch_output_is_accepted_by_sbatch_and_doctor_runs_inside_the_job(slurm_cluster,
                                                                            tmp_path):
    script = tmp_path / "job.sbatch"
    proc = run("sbatch", "--time", "00:05:00", "--ntasks-per-node", "1", "--log",
               str(tmp_path / "job.out"), "--output", str(script), "--", CLI, "doctor")
    assert proc.returncode == 0, proc.stderr
    job = submit(str(script), cwd=tmp_path)
    info = wait_job(job, timeout=120)
    log = (tmp_path / "job.out").read_text()
    assert info["JobState"] == "COMPLETED", log
    # Inside a job launched by the rendered script the signal reaches the task, the job can
    # requeue itself and the log appends: nothing for doctor to warn about.
    assert "[not-slurm]" not in log
    for code in ("signal-batch-only", "no-signal", "not-srun-task", "no-requeue",
                 "log-truncate", "torchrun"):
        assert f"[{code}]" not in log, log
    assert "srun exited with 0" in log


def test_demo_slurm_without_a_cluster_is_a_clear_error(tmp_path):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "sinfo").write_text("#!/bin/sh\necho 'slurm_load_partitions: Unable to contact "
                                  "slurm controller (connect failure)' >&2\nexit 1\n")
    (bindir / "sbatch").write_text("#!/bin/sh\nexit 1\n")
    for f in bindir.iterdir():
        f.chmod(0o755)
    proc = run("demo", "--slurm", "--workdir", str(tmp_path / "w"),
               env={"PATH": f"{bindir}:/usr/bin:/bin"})
    assert proc.returncode == 1
    assert "no SLURM cluster" in proc.stderr and "Unable to contact" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run("demo", "--slurm", "--workdir", str(tmp_path / "w"), env={"PATH": "/nonexistent"})
    assert proc.returncode == 1 and "not on PATH" in proc.stderr
