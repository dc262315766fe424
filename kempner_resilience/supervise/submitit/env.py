"""A submitit task, set up before the submitted function runs: the rank variables (from
SLURM's, or the local executor's ``SUBMITIT_LOCAL_*``), the resolved config in a file that
``$KEMPNER_RESILIENCE_CONFIG`` names, and its signals taken over so that ``ResilientRun``
handles them: submitit's preemption handler checkpoints and requeues from inside the handler,
mid-step, and it ignores SIGTERM. ``SignalTakeover`` replaces both.
"""

from __future__ import annotations

import os
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Mapping

from kempner_resilience.config import ResilienceConfig, normalize_signal
from kempner_resilience.core.fileio import write_atomic
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.startup import record_early_signal

__all__ = ["setup_rank_env", "setup_local_env", "preempt_when_controller_dies", "count_start",
           "write_config_file", "OUTER_JOB_VARS", "SignalTakeover", "in_submitit_job",
           "in_local_task", "preempt_signal"]

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
    from kempner_resilience.supervise.local.warm import parent_death

    parent = os.getppid()
    ask = parent_death(preempt_signal())
    if ask is not None:
        ask()
        if os.getppid() != parent:       # it died before the request: act now
            os.kill(os.getpid(), preempt_signal())


def _task_file(folder: str, name: str) -> Path:
    """``name`` in the job's submitit ``folder``, else in the temporary directory."""
    return (Path(folder) if folder and Path(folder).is_dir() else Path(tempfile.gettempdir())) / name


def count_start(env: Mapping[str, str], job_id: str, rank: str) -> int:
    """Earlier starts of this task of this local job; records this one."""
    path = _task_file(env.get("SUBMITIT_FOLDER", "").replace("%j", job_id), f"{job_id}_{rank}_kr_starts")
    try:
        before = len(path.read_text().splitlines()) if path.exists() else 0
        with open(path, "a") as f:
            f.write(f"{time.time():.3f}\n")
    except OSError as e:   # the count only feeds the restart budget and the ledger
        log.warning("cannot count this task's starts in %s (%s): taken as the first", path, e)
        return 0
    return before


def write_config_file(cfg: ResilienceConfig) -> str:
    """The resolved ``cfg`` in this task's file, for ``$KEMPNER_RESILIENCE_CONFIG``; its path."""
    import yaml

    env = os.environ
    job = env.get("SLURM_JOB_ID") or env.get("SUBMITIT_LOCAL_JOB_ID") or "local"
    path = _task_file(env.get("SUBMITIT_FOLDER", ""),
                      f"{job}_{env.get('SLURM_PROCID', env.get('RANK', '0'))}_resilience.yaml")
    # Read by this task's own processes and rewritten at every start: whole, not fsynced.
    write_atomic(path, yaml.safe_dump(cfg.to_dict(), sort_keys=False), durable=False)
    return str(path)


# ------------------------------------------------------------------------- signals

def preempt_signal() -> int:
    """submitit's preemption signal (``$SUBMITIT_PREEMPT_SIGNAL``, default ``SIGUSR2``)."""
    name = os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")
    return int(getattr(signal, normalize_signal(name)))


def in_local_task() -> bool:
    """True in a task that submitit's local executor started."""
    return os.environ.get("SUBMITIT_EXECUTOR") == "local" and "SUBMITIT_LOCAL_GLOBALID" in os.environ


def in_submitit_job() -> bool:
    """True in a job process that submitit started, under SLURM or its local executor."""
    return bool(os.environ.get("SUBMITIT_FOLDER")) and (bool(os.environ.get("SLURM_JOB_ID"))
                                                        or in_local_task())


class SignalTakeover:
    """Replaces submitit's job-process handlers for the preemption signal and SIGTERM.

    The preemption signal is the run's inside a ``ResilientRun``, kept for the run to replay
    before one, ignored after the function returned. SIGTERM: ignored as submitit does, or
    with ``sigterm="stop"`` the default action outside a run and the run's STOP inside one.
    """

    def __init__(self, preempt_signum: int, sigterm: str = "ignore") -> None:
        self.preempt = preempt_signum
        self.sigterm = sigterm
        self.pending: int | None = None
        self._done = threading.Event()
        self._previous: dict[int, Any] = {}

    def install(self) -> "SignalTakeover":
        term = self.preempt != signal.SIGTERM
        self._previous = {s: signal.getsignal(s) for s in (self.preempt, signal.SIGTERM)[:1 + term]}
        signal.signal(self.preempt, self._on_preempt)
        if term:
            signal.signal(signal.SIGTERM, self._on_term_ignored if self.sigterm == "ignore"
                          else signal.SIG_DFL)
        previous = self._previous[self.preempt]
        log.debug("took over %s and SIGTERM from %s", signal.Signals(self.preempt).name,
                  getattr(previous, "__qualname__", previous))
        return self

    def finish(self) -> None:
        """The function returned (or raised). In a submitit job our handlers stay, so a late
        signal cannot make submitit requeue a finished job; elsewhere the old ones come back."""
        self._done.set()
        if not in_submitit_job() and threading.current_thread() is threading.main_thread():
            for s, prev in self._previous.items():
                signal.signal(s, prev if prev is not None else signal.SIG_DFL)

    # handlers (main thread, between bytecodes)

    def _on_preempt(self, signum: int, frame: Any) -> None:
        from kempner_resilience.stop.signals import active_handlers

        if active_handlers():
            return  # chained from ResilientRun's handler: the run handles it
        if self._done.is_set():
            log.warning("%s after the training function returned: ignored (the result is "
                        "being written)", signal.Signals(signum).name)
            return
        if self.pending is not None:
            return
        self.pending = signum
        log.warning("%s before the training entered ResilientRun: it is handled as soon as "
                    "the run starts", signal.Signals(signum).name)
        # The run's ShutdownHandler replays it, so the stop comes at the run's first step
        # boundary with its deadline counted from now. A thread that re-sent the signal once
        # a run was active woke too late on a loaded machine: several steps ran first.
        record_early_signal(signum)

    def _on_term_ignored(self, signum: int, frame: Any) -> None:
        log.warning("SIGTERM ignored, as submitit does (its preemption signal is %s; "
                    "pass sigterm='stop' to act on SIGTERM)", signal.Signals(self.preempt).name)
