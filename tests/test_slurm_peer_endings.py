"""A plain user sbatch, no supervisor: ``srun python train.py`` on 2 tasks of the single-node
cluster. Nothing outside the ranks decides; rank 0 requeues after a rescued failure, now from
its peers' recorded endings through the one policy (``supervise/endings.py``):

- rank 1 raises (a deterministic bug): rank 0 leaves with 1 too, the job is never requeued,
  it ends FAILED with exit code 1 (before: 81, requeued until the restart budget);
- rank 1 SIGKILLed: it recorded nothing, counts as killed, the job is requeued once and
  resumes, ending bitwise equal to an uninterrupted run.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import RESCUE_JOB, assert_bitwise_equal, env, free_port
from slurm_fixtures import slurm_cluster, submit, wait_job  # noqa: F401

pytestmark = [pytest.mark.slurm]

STEPS, EVERY = 24, 4


def _script(work: Path, *extra: str) -> str:
    job = " ".join([sys.executable, str(RESCUE_JOB), "--steps", str(STEPS), "--out",
                    str(work / "weights.pt"), "--set", f"checkpoint.dir={work / 'ckpt'}",
                    "--set", f"checkpoint.every_steps={EVERY}", *extra])
    # The sbatch template's lines, with RANK & co. set for the plain script from srun's.
    return f"""#!/bin/bash
#SBATCH -n 2
#SBATCH -N 1
#SBATCH -t 10
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH -o {work}/job.out
export MASTER_ADDR=127.0.0.1 MASTER_PORT=$((20000 + SLURM_JOB_ID % 12000))
export WORLD_SIZE=$SLURM_NTASKS
srun --kill-on-bad-exit=1 bash -c 'RANK=$SLURM_PROCID LOCAL_RANK=$SLURM_LOCALID exec {job}'
exit $?
"""


def _reference(work: Path) -> Path:
    """The same job, uninterrupted, as 2 plain processes."""
    work.mkdir()
    port = str(free_port())
    cmd = [sys.executable, str(RESCUE_JOB), "--steps", str(STEPS), "--out",
           str(work / "weights.pt"), "--set", f"checkpoint.dir={work / 'ckpt'}",
           "--set", f"checkpoint.every_steps={EVERY}"]
    procs = [subprocess.Popen(cmd, cwd=work, env=env(
        RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
        MASTER_PORT=port), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for r in range(2)]
    assert [p.wait(timeout=240) for p in procs] == [0, 0]
    return work / "weights.pt"


def test_plain_srun_rank_1_raising_ends_the_job_with_1_never_requeued(slurm_cluster, tmp_path):
    job = submit(_script(tmp_path, "--raise-at", "1:9"), cwd=tmp_path)
    info = wait_job(job, timeout=240)
    log = (tmp_path / "job.out").read_text()
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "1:0", (info, log)
    assert info.get("Restarts") == "0", (info, log)
    assert "not requeued" in log and "rank 1: error 1" in log, log


def test_plain_srun_rank_1_sigkilled_is_requeued_and_resumes_bitwise(slurm_cluster, tmp_path):
    ref = _reference(tmp_path / "ref")
    work = tmp_path / "job"
    work.mkdir()
    job = submit(_script(work, "--kill-at", "1:9"), cwd=work)
    info = wait_job(job, timeout=360)
    log = (work / "job.out").read_text()
    assert info["JobState"] == "COMPLETED" and info.get("Restarts") == "1", (info, log)
    assert_bitwise_equal(torch.load(work / "weights.pt", weights_only=True),
                         torch.load(ref, weights_only=True))
