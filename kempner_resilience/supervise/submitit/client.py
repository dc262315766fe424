"""The client side of a submitit job: the executor, preempting it, waiting for its result."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

from kempner_resilience.core.log import get_logger

__all__ = ["make_executor", "interrupt", "wait", "is_local_job"]

# One logger for the whole integration: users filter their logs on it.
log = get_logger("kempner_resilience.supervise.submitit.jobs")


def make_executor(folder: str | os.PathLike[str], *, timeout_min: int = 60,
                  **params: Any) -> Any:
    """A submitit ``AutoExecutor`` for SLURM. ``timeout_min`` > 10: with 10 or less submitit
    calls every interrupt a time-out."""
    import submitit

    if timeout_min <= 10:
        log.warning("timeout_min=%s <= 10: submitit treats every interrupt of such a job as "
                    "a time-out", timeout_min)
    executor = submitit.AutoExecutor(folder=str(folder), cluster="slurm")
    executor.update_parameters(timeout_min=timeout_min, **params)
    return executor


def is_local_job(job: Any) -> bool:
    """A job of submitit's local executor (its controller is a child process of ours)."""
    try:
        from submitit.local.local import LocalJob
    except ImportError:
        return False
    return isinstance(job, LocalJob)


def interrupt(job: Any) -> None:
    """Send the preemption signal to every task of ``job``, as SLURM does: the tasks checkpoint
    and requeue. For a local job it goes to the tasks (submitit's ``_interrupt()`` would send
    it to the local controller, which dies of it)."""
    if is_local_job(job):
        from kempner_resilience.supervise.submitit.local import interrupt_tasks

        interrupt_tasks(job)
    else:
        job._interrupt()


_TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED",
             "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"}


def _job_ids(job: Any) -> tuple[str, list[Any]]:
    subs = list(getattr(job, "_sub_jobs", []) or [])
    return str(job.job_id), subs or [job]


def wait(job: Any, timeout: float | None = None, poll: float = 0.5) -> Any:
    """Wait until ``job`` has written its result, through any number of requeues; returns it.
    ``RuntimeError`` (with the log's tail) when it ended without one: ``job.result()`` alone
    would wait forever for a job that died. ``TimeoutError`` after ``timeout`` s."""
    from kempner_resilience.slurm import show_job

    deadline = None if timeout is None else time.monotonic() + timeout
    job_id, tasks = _job_ids(job)
    local = is_local_job(job)
    ended_since: float | None = None
    last = ""
    while True:
        if all(t.paths.result_pickle.exists() for t in tasks):
            return job
        if local:
            _check_local(job, tasks)
        state = "" if local else (show_job(job_id, timeout=10.0) or {}).get("JobState", "")
        last = state or last
        if state in _TERMINAL:
            # The tasks may still be writing their pickles: give them a moment.
            ended_since = ended_since or time.monotonic()
            if time.monotonic() - ended_since > 15.0:
                raise RuntimeError(f"job {job_id} ended ({state}) without a result:\n"
                                   + _log_tail(job))
        else:
            ended_since = None
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"job {job_id} has no result after {timeout} s (state "
                               f"{last or 'unknown'}):\n" + _log_tail(job))
        time.sleep(poll)


def _check_local(job: Any, tasks: list[Any]) -> None:
    """Raise when a local job's controller has ended without every result (it waits for all
    its tasks first, so nothing more will come)."""
    proc = getattr(job, "_process", None)
    code = None if proc is None else proc.poll()
    if proc is not None and code is None:
        return
    if all(t.paths.result_pickle.exists() for t in tasks):
        return
    if proc is None:
        why = "its controller is not a child of this process (another session?)"
    elif code < 0:
        why = (f"its controller was killed by {signal.Signals(-code).name} (submitit's "
               "_interrupt() does that; krs.interrupt(job) preempts the tasks instead); its "
               "tasks got the preemption signal and checkpoint on their own")
    else:
        why = "its tasks exited without a result (a task's exit code is in its log)"
    raise RuntimeError(f"local job {job.job_id} ended without a result: {why}; resubmit it to "
                       "resume from its newest checkpoint:\n" + _log_tail(job))


def _log_tail(job: Any, lines: int = 30) -> str:
    out = []
    for t in _job_ids(job)[1][:2]:
        for path in (t.paths.stdout, t.paths.stderr):
            try:
                text = Path(path).read_text(errors="replace").splitlines()
            except OSError:
                continue
            out.append(f"--- {path}\n" + "\n".join(text[-lines:]))
    return "\n".join(out) or "(no log)"
