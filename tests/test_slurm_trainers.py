"""The trainer adapters' batch-script paths on the real cluster: Accelerate's launcher and
torchrun (the Hugging Face Trainer) as one ``srun`` task per node with our agent, Lightning as
one ``srun`` task per rank (it takes SLURM's environment). A USR1 to the job's tasks, what
``--signal=USR1@lead`` sends (``scancel --signal=USR1``: every step task, not the batch shell),
stops every rank at one step; rank 0 requeues, the job runs again, resumes, and ends bitwise
equal to an uninterrupted run of the same script on 2 plain ranks.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import require
from slurm_fixtures import (TERMINAL_STATES, job_info, slurm_cluster, submit,  # noqa: F401
                            wait_for, wait_job)
from trainers_helpers import SCRIPTS, assert_same_final, committed_steps, run_to_end

pytestmark = [pytest.mark.slurm]

STEPS = 30
PY = sys.executable


def _args(work: Path, *extra: str) -> list[str]:
    return ["--steps", str(STEPS), "--out", str(work / "final.pt"), "--progress",
            str(work / "progress"), *extra]


def _accelerate(work: Path, *extra: str) -> list[str]:
    return [PY, "-m", "kempner_resilience.cli", "accelerate", "launch", "--cpu",
            "--num_processes", "2", "--main_process_port", "0",
            str(SCRIPTS / "accelerate_train.py"), *_args(work, *extra)]


def _torchrun(work: Path, *extra: str) -> list[str]:
    return [PY, "-m", "kempner_resilience.cli", "torchrun", "--standalone",
            "--nproc-per-node=2", str(SCRIPTS / "hf_train.py"), *_args(work, *extra)]


def _lightning_reference(work: Path) -> list[str]:
    return [PY, "-m", "kempner_resilience.cli", "torchrun", "--standalone",
            "--nproc-per-node=2", str(SCRIPTS / "lightning_train.py"),
            *_args(work, "--step-s", "0")]


def _job(work: Path, tasks: int, command: list[str]) -> str:
    """A batch script as the docs write it: requeue allowed, the log appended, the run's
    config in the environment, ``command`` under srun (``tasks`` tasks on one node)."""
    (work / "resilience.yaml").write_text(
        f"checkpoint:\n  dir: {work / 'ckpt'}\n  every_steps: 0\nwatchdog:\n  hang_timeout_s: 0\n")
    cpus = 2 // tasks
    return f"""#!/bin/bash
#SBATCH -N 1
#SBATCH --ntasks-per-node={tasks}
#SBATCH -c {cpus}
#SBATCH -t 10
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --signal=USR1@60
#SBATCH -o {work}/job.out
export KEMPNER_RESILIENCE_CONFIG={work}/resilience.yaml PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cd {work}
echo "restart ${{SLURM_RESTART_COUNT:-0}}"
srun --kill-on-bad-exit=1 {' '.join(command)}
rc=$?
echo "srun exited with $rc"
exit $rc
"""


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """Each library's uninterrupted run on 2 plain ranks, computed once."""
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            work = tmp_path_factory.mktemp(f"{name}_reference")
            launch = {"accelerate": lambda w: _accelerate(w, "--step-s", "0"),
                      "hf": lambda w: _torchrun(w, "--step-s", "0"),
                      "lightning": _lightning_reference}[name]
            code, out = run_to_end(work, launch(work))
            assert code == 0, out[-4000:]
            made[name] = work / "final.pt"
        return made[name]
    return get


def _wait_for_step(work: Path, job: str, step: int) -> None:
    """Until rank 0 started ``step``; fails with the job's log if the job ended first."""
    def reached() -> bool:
        progress = work / "progress"
        if progress.exists() and f"rank 0 step {step}\n" in progress.read_text():
            return True
        if job_info(job).get("JobState") in TERMINAL_STATES:
            log = work / "job.out"
            raise AssertionError(f"job {job} ended before step {step}: "
                                 f"{log.read_text()[-4000:] if log.exists() else ''}")
        return False
    wait_for(reached, timeout=180, poll=0.2, what=f"rank 0 at step {step}")


def _usr1_requeues_and_resumes(work: Path, job_text: str, reference: Path,
                               during=None) -> str:
    """Submit, USR1 the job's tasks at step 8, and check the requeued job's end: completed
    after one restart, resumed from the stop's checkpoint, bitwise equal to ``reference``.
    ``during(job_id)`` runs while the first run trains. The job's log."""
    job = submit(job_text, cwd=work)
    try:
        _wait_for_step(work, job, 8)
        if during is not None:
            during(job)
        subprocess.run(["scancel", "--signal=USR1", job], check=True, timeout=30)
        info = wait_job(job, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=300)
    finally:
        subprocess.run(["scancel", job], timeout=30, check=False)
    log = (work / "job.out").read_text()
    assert info["JobState"] == "COMPLETED", log[-4000:]
    assert info["Restarts"] == "1", log[-4000:]
    # The stop's checkpoint is the one the requeued run resumed from. (The ranks' last lines,
    # "exiting with REQUEUE (75)", may be cut: the requeue ends the step as they write them.)
    stopped = re.search(r"stopping at step (\d+) \(SIGUSR1, action requeue\)", log)
    assert stopped, log[-4000:]
    assert "restart 1" in log, log[-4000:]
    assert f"(step {stopped[1]}, reason emergency)" in log.split("restart 1", 1)[1], log[-4000:]
    assert "Traceback" not in log, log[-4000:]
    assert committed_steps(work), log[-4000:]
    assert_same_final(reference, work / "final.pt")
    return log


def test_accelerate_launch_under_srun_requeues_on_usr1_and_resumes_bitwise(
        slurm_cluster, tmp_path, references):
    require("accelerate")
    _usr1_requeues_and_resumes(tmp_path, _job(tmp_path, 1, _accelerate(tmp_path)),
                               references("accelerate"))


def test_the_trainer_under_torchrun_under_srun_requeues_on_usr1_and_resumes_bitwise(
        slurm_cluster, tmp_path, references):
    require("transformers")
    _usr1_requeues_and_resumes(tmp_path, _job(tmp_path, 1, _torchrun(tmp_path)),
                               references("hf"))


def test_lightning_srun_tasks_requeue_on_usr1_resume_bitwise_and_a_second_job_in_the_directory_is_refused(
        slurm_cluster, tmp_path, references):
    """Lightning's own SLURM path (one task per rank) and Lightning's issue 12369: a second
    job started from the same directory while the first trains is refused by the lease (78,
    the message names the holder), and the first job's checkpoints stay its own."""
    require("pytorch_lightning")
    hold = tmp_path / "hold"           # the first job waits at step 8 while it exists
    hold.touch()
    command = [PY, str(SCRIPTS / "lightning_train.py"), *_args(tmp_path),
               "--hold", str(hold), "--hold-at", "8"]
    second = tmp_path / "second"
    second.mkdir()

    def start_second(_first: str) -> None:
        text = _job(tmp_path, 2, command).replace(f"-o {tmp_path}/job.out",
                                                  f"-o {second}/job.out")
        job = submit(text, cwd=second)
        info = wait_job(job, timeout=180)
        log = (second / "job.out").read_text()
        hold.unlink()
        assert info["JobState"] == "FAILED", log[-4000:]
        assert "is in use by another live run" in log, log[-4000:]
        assert "srun exited with 78" in log, log[-4000:]
        assert "starting fresh" not in log and "resumed from" not in log, log[-4000:]

    _usr1_requeues_and_resumes(tmp_path, _job(tmp_path, 2, command),
                               references("lightning"), during=start_second)
