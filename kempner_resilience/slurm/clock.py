"""When the allocation ends, and whether the run must stop now to save before it does.

A job submitted without ``--signal``, a signal lost in a wrapper script, or a site that sends it
too late all end the same way: SIGTERM at the time limit, SIGKILL ``KillWait`` later, and the
work since the last periodic checkpoint is gone. The run can know its end time itself and stop in
time, exactly as if the warning signal had come.

The end time is read once per attempt (a requeued job is a new process with a new end time):
``SLURM_JOB_END_TIME`` (epoch seconds; newer SLURM exports it), else ``squeue -h -j ID -o %e``,
else ``scontrol show job`` — each call bounded by ``requeue.scontrol_timeout_s``, never per step;
when squeue could not reach slurmctld at all, scontrol is not asked (it would wait as long);
when slurmctld did not answer, the log says the end is unknown.
``SLURM_JOB_END_TIME`` is honoured even outside a job, so a local run can be given an end time.

Per step, ``RunClock.due`` is one comparison of ``time.monotonic()`` against a threshold that is
recomputed only when its inputs change: the end minus (the estimated emergency save + one step +
``requeue.time_limit_margin_s``).
"""

from __future__ import annotations

import math
import os
import time
from typing import Mapping

from kempner_resilience.core.log import get_logger
from kempner_resilience.slurm.scontrol import (ScontrolResult, parse_slurm_time, run_scontrol,
                                               show_job)

__all__ = ["RunClock", "job_end_time", "END_TIME_ENV"]

log = get_logger(__name__)

END_TIME_ENV = "SLURM_JOB_END_TIME"
# A step's duration decays by this factor per step towards the latest one: a slow first step
# (warm-up, compilation) or one slow step stops dominating after some hundred steps.
_STEP_DECAY = 0.98


def _from_env(env: Mapping[str, str]) -> float | None:
    raw = env.get(END_TIME_ENV, "").strip()
    try:
        value = float(raw)
    except ValueError:
        return None
    return value if value > 0 else None


def _squeue_end(job_id: str, timeout: float) -> tuple[float | None, ScontrolResult]:
    """The end squeue gives, and its call (whether slurmctld answered it)."""
    res = run_scontrol(["-h", "-j", job_id, "-o", "%e"], timeout, tool="squeue")
    lines = res.stdout.strip().splitlines() if res.ok else []
    return (parse_slurm_time(lines[0].strip()) if lines else None), res


def job_end_time(environ: Mapping[str, str] | None = None, timeout: float = 10.0) -> float | None:
    """When this job's allocation ends (epoch seconds), or None (no job, no time limit, no
    answer within ``timeout``). See the module docstring for the sources."""
    env = os.environ if environ is None else environ
    end = _from_env(env)
    if end is not None:
        return end
    job_id = (env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID") or "").strip()
    if not job_id:
        return None
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        job_id = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    end, asked = _squeue_end(job_id, timeout)
    silent = asked.unanswered
    # Unreachable: asking scontrol too would double the wait at every start of a rank. A
    # timeout is not that: a busy slurmctld may still answer scontrol's call.
    if end is None and not asked.unreachable:
        info = show_job(job_id, timeout)
        if info is not None:
            silent = False               # slurmctld answered (a job without a limit has no end)
            if info.get("TimeLimit") not in ("UNLIMITED", "Partition_Limit"):
                end = parse_slurm_time(info.get("EndTime"))
    if end is None and silent:
        why = f"squeue did not answer within {timeout:g} s" if asked.timed_out \
            else asked.stderr.strip().splitlines()[-1]
        log.warning("the allocation's end is unknown (%s): the run stops before its time "
                    "limit only on the warning signal (#SBATCH --signal)", why)
    return end


class RunClock:
    """The allocation's end on this process's monotonic clock, and the stop threshold.

    ``end_epoch`` None: no end known (``remaining`` is None, ``due`` never true).
    ``stop_enabled`` False: ``remaining`` still works, the run never stops on its own.
    """

    def __init__(self, end_epoch: float | None, *, margin_s: float = 30.0,
                 stop_enabled: bool = True) -> None:
        self.end_epoch = end_epoch
        self.margin_s = margin_s
        self.stop_enabled = stop_enabled and end_epoch is not None
        # Monotonic, so a wall-clock step (NTP) cannot trigger or suppress the stop.
        self.end = math.inf if end_epoch is None else \
            time.monotonic() + (end_epoch - time.time())
        self.save_s = 0.0
        self.step_s = 0.0
        self.threshold = math.inf
        self.fired = False
        self._update()

    def remaining(self) -> float | None:
        """Seconds until the allocation ends, or None when unknown."""
        return None if self.end_epoch is None else self.end - time.monotonic()

    def set_save_estimate(self, seconds: float) -> None:
        """The estimated emergency save (``CheckpointManager.estimate``), after each save."""
        self.save_s = max(float(seconds), 0.0)
        self._update()

    def observe_step(self, seconds: float) -> None:
        """One step's duration, measured between two boundaries (a periodic save excluded)."""
        step = self.step_s * _STEP_DECAY
        self.step_s = seconds if seconds > step else step
        self._update()

    def needed(self) -> float:
        """Seconds before the end at which the run stops: save + one step + margin."""
        return self.save_s + self.step_s + self.margin_s

    def due(self, now: float) -> bool:
        """True from the moment the run must stop to save in time (and forever after)."""
        if now >= self.threshold:
            if not self.fired:
                self.fired = True
                self._update()
                log.warning("the allocation ends in %.0f s and no stop signal came: stopping "
                            "now to save in time (estimated save %.1f s + one step %.2f s + "
                            "requeue.time_limit_margin_s %.0f s)", self.end - now, self.save_s,
                            self.step_s, self.margin_s)
            return True
        return False

    def _update(self) -> None:
        if self.fired:
            self.threshold = -math.inf     # decided: a shorter step later does not undo it
        elif self.stop_enabled:
            self.threshold = self.end - self.needed()
