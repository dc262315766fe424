"""sbatch templates: one source of truth, rendering, sbatch --test-only, and a real USR1 delivery."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kempner_resilience.config import ResilienceConfig, load_config
from kempner_resilience.slurm import TEMPLATES, master_port, render_sbatch, signal_lead_time
from slurm_fixtures import slurm_cluster, submit, wait_for, wait_job  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]
PROBES = ROOT / "tests" / "cluster"


@pytest.mark.parametrize("name", TEMPLATES)
def test_package_template_is_identical_to_repo_slurm_dir(name):
    src = (ROOT / "slurm" / f"{name}.sbatch").read_bytes()
    shipped = (ROOT / "kempner_resilience" / "templates" / f"{name}.sbatch").read_bytes()
    assert src == shipped, f"run: cp slurm/{name}.sbatch kempner_resilience/templates/"


@pytest.mark.parametrize("name", TEMPLATES)
def test_templates_signal_srun_tasks_not_the_batch_shell(name):
    text = render_sbatch(template=name, array="0-3" if name == "job_array" else None)
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --signal=USR1@100" in directives  # default signals.grace_s
    assert not any("B:" in d for d in directives)
    assert "#SBATCH --requeue" in directives and "#SBATCH --open-mode=append" in directives
    assert "srun --kill-on-bad-exit=1 python train.py" in text
    commands = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    assert not any("torchrun" in c for c in commands)
    assert "{{" not in text


def test_lead_time_covers_measured_save_plus_margin():
    cfg = load_config(overrides=["signals.grace_s=60", "checkpoint.save_margin_s=10"])
    assert signal_lead_time(cfg) == 60
    assert signal_lead_time(cfg, save_seconds=95.2) == 106  # 95.2 + 10, rounded up
    assert signal_lead_time(cfg, lead_time_s=300) == 300
    assert "--signal=USR1@106" in render_sbatch(cfg, save_seconds=95.2)


def test_render_fills_options_extra_and_quotes_command():
    text = render_sbatch(ResilienceConfig(), template="multi_node", nodes=4, ntasks_per_node=8,
                         gpus_per_node=8, job_name="llm", time="2-00:00:00",
                         command=["python", "train.py", "--name", "a b"],
                         config_path="/cfg/x.yaml", extra={"partition": "kempner_h100",
                                                           "exclusive": None})
    for line in ("#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=8",
                 "#SBATCH --gpus-per-node=8", "#SBATCH --job-name=llm",
                 "#SBATCH --time=2-00:00:00", "#SBATCH --partition=kempner_h100",
                 "#SBATCH --exclusive", "export KEMPNER_RESILIENCE_CONFIG=/cfg/x.yaml",
                 "srun --kill-on-bad-exit=1 python train.py --name 'a b'"):
        assert line in text.splitlines()


def test_render_rejects_bad_arguments():
    with pytest.raises(ValueError, match="multi_node"):
        render_sbatch(nodes=2)
    with pytest.raises(ValueError, match="array"):
        render_sbatch(template="job_array")
    with pytest.raises(ValueError, match="unknown template"):
        render_sbatch(template="nope")


@pytest.mark.slurm
@pytest.mark.parametrize("name", TEMPLATES)
def test_rendered_template_passes_sbatch_test_only(slurm_cluster, tmp_path, name):
    script = tmp_path / f"{name}.sbatch"
    script.write_text(render_sbatch(template=name, array="0-1", ntasks_per_node=2,
                                    time="00:05:00", output=str(tmp_path / "x.out")))
    res = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True,
                         timeout=30)
    assert res.returncode == 0, res.stderr
    assert "to start at" in res.stderr


@pytest.mark.slurm
def test_rendered_template_delivers_usr1_to_every_srun_task(slurm_cluster, tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(
        template="single_node", ntasks_per_node=2, time="00:05:00", job_name="sigtest",
        command=[sys.executable, str(PROBES / "probe_signal.py"), str(tmp_path)],
        output=str(tmp_path / "job.out")))
    job_id = submit(str(script), cwd=tmp_path)
    wait_for(lambda: all((tmp_path / f"ready_{r}").exists() for r in (0, 1)), timeout=60,
             what="both srun tasks ready")
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True, timeout=30)
    info = wait_job(job_id, timeout=60)
    log = (tmp_path / "job.out").read_text()
    assert info["JobState"] == "COMPLETED", log
    got = [json.loads((tmp_path / f"got_{r}.json").read_text()) for r in (0, 1)]
    assert [g["signals"] for g in got] == [["SIGUSR1"], ["SIGUSR1"]]
    # The template's MASTER_PORT and setup_torch_env agree.
    assert {g["master_port"] for g in got} == {str(master_port(job_id))}
    # Launched as the template says, preflight finds nothing wrong with signal or requeue.
    assert got[0]["open_mode"] == "a"
    bad = {"signal-batch-only", "no-signal", "not-srun-task", "no-requeue", "log-truncate",
           "scontrol-missing", "torchrun", "signal-unknown"}
    assert not bad & set(got[0]["findings"]), got[0]["findings"]
    assert "srun exited with 0" in log


@pytest.mark.slurm
def test_preemption_by_high_partition_sends_the_template_signal_to_srun_tasks(
        slurm_cluster, tmp_path):
    # preempt_send_user_signal: a preempted job gets its --signal at once, before GraceTime.
    script = tmp_path / "low.sbatch"
    script.write_text(render_sbatch(
        template="single_node", ntasks_per_node=2, time="00:20:00", extra={"partition": "low"},
        command=[sys.executable, str(PROBES / "probe_signal.py"), str(tmp_path)],
        output=str(tmp_path / "low.out")))
    low = submit(str(script), cwd=tmp_path)
    wait_for(lambda: all((tmp_path / f"ready_{r}").exists() for r in (0, 1)), timeout=60,
             what="both srun tasks ready")
    high = submit(f"#!/bin/bash\n#SBATCH -p high\n#SBATCH -n 8\n#SBATCH -o {tmp_path}/high.out\n"
                  "true\n", cwd=tmp_path)  # needs the whole node: preempts the low job
    assert wait_job(high, timeout=60)["JobState"] == "COMPLETED"
    got = [json.loads((tmp_path / f"got_{r}.json").read_text()) for r in (0, 1)]
    assert [g["signals"] for g in got] == [["SIGUSR1"], ["SIGUSR1"]]
    wait_job(low, timeout=30)
