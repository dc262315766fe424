"""A submitit task's environment, set up before the submitted function runs: the rank
variables (from SLURM's, or the local executor's ``SUBMITIT_LOCAL_*``) and the resolved config
in a file that ``$KEMPNER_RESILIENCE_CONFIG`` names.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any, Mapping

from kempner_resilience.config import ResilienceConfig
from kempner_resilience.core.fileio import write_atomic
from kempner_resilience.supervise.submitit.signals import preempt_signal
from kempner_resilience.core.log import get_logger

__all__ = ["setup_rank_env", "setup_local_env", "preempt_when_controller_dies", "count_start",
           "write_config_file", "OUTER_JOB_VARS"]

# One logger for the whole integration: users filter their logs on it.
log = get_logger("kempner_resilience.supervise.submitit.jobs")


def setup_rank_env() -> None:
    """The torch rank variables from SLURM's (submitit starts one task per rank with srun)."""
    if not os.environ.get("SLURM_JOB_ID"):
        return
    from kempner_resilience.slurm import setup_torch_env

    setup_torch_env()


# A local task inherits the notebook's environment: inside an allocation these would make the
# run `scontrol requeue` the allocation itself, and a stale RANK would make every task rank 0.
OUTER_JOB_VARS = ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_RESTART_COUNT")


def setup_local_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """A local executor's task: the rank variables from ``SUBMITIT_LOCAL_*``, a port from the
    job id, and ``KEMPNER_RESTART_COUNT`` (submitit's controller restarts tasks without saying
    so: from our controller's channel, else counted in a file). Returns what was set."""
    from kempner_resilience.slurm.env import master_port

    from kempner_resilience.supervise.rank import restarts_said

    env: Any = os.environ if environ is None else environ
    for key in OUTER_JOB_VARS:
        env.pop(key, None)
    job_id = env.get("SUBMITIT_LOCAL_JOB_ID", "") or str(os.getppid())
    rank = env.get("SUBMITIT_LOCAL_GLOBALID", "0")
    world = env.get("SUBMITIT_LOCAL_NTASKS", "1")
    said = restarts_said(env)
    values = {"RANK": rank, "WORLD_SIZE": world,
              "LOCAL_RANK": env.get("SUBMITIT_LOCAL_LOCALID", rank), "LOCAL_WORLD_SIZE": world,
              "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(master_port(job_id)),
              "KEMPNER_RESTART_COUNT": str(said if said is not None
                                           else count_start(env, job_id, rank))}
    env.update(values)
    log.debug("local submitit task: %s", values)
    return values


def preempt_when_controller_dies() -> None:
    """Ask for the preemption signal when the local controller dies (submitit's own
    ``job._interrupt()`` kills it): the tasks checkpoint instead of training on unseen."""
    import ctypes

    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, preempt_signal())   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:       # it died before the request: act now
        os.kill(os.getpid(), preempt_signal())


def count_start(env: Mapping[str, str], job_id: str, rank: str) -> int:
    """Earlier starts of this task of this local job; records this one."""
    folder = env.get("SUBMITIT_FOLDER", "").replace("%j", job_id)
    base = Path(folder) if folder and Path(folder).is_dir() else Path(tempfile.gettempdir())
    path = base / f"{job_id}_{rank}_kr_starts"
    try:
        before = len(path.read_text().splitlines()) if path.exists() else 0
        with open(path, "a") as f:
            f.write(f"{time.time():.3f}\n")
    except OSError as e:   # the count only feeds the restart budget and the ledger
        log.warning("cannot count this task's starts in %s (%s): taken as the first", path, e)
        return 0
    return before


def write_config_file(cfg: ResilienceConfig) -> str:
    import yaml

    folder = os.environ.get("SUBMITIT_FOLDER")
    job = os.environ.get("SLURM_JOB_ID") or os.environ.get("SUBMITIT_LOCAL_JOB_ID") or "local"
    rank = os.environ.get("SLURM_PROCID", os.environ.get("RANK", "0"))
    base = Path(folder) if folder and Path(folder).is_dir() else Path(tempfile.gettempdir())
    path = base / f"{job}_{rank}_resilience.yaml"
    # Read by this task's own processes and rewritten at every start: whole, not fsynced.
    write_atomic(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False), durable=False)
    return str(path)
