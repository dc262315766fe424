"""submitit's local executor: its job with an ``_interrupt()`` that reaches the tasks.

submitit's ``LocalJob._interrupt()`` sends the preemption signal to the local controller
process, which has no handler for it and dies; its tasks never hear of it and nothing is
checkpointed. ``submit`` gives local jobs this class instead, whose ``_interrupt()`` signals the
tasks, as SLURM does (see ``integrations/submitit.py``). Imports submitit: loaded only for a
local job.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from submitit.local.local import LocalJob, LocalJobEnvironment

from kempner_resilience.core.log import get_logger

__all__ = ["ResilientLocalJob", "interrupt_tasks", "local_task_pids"]

log = get_logger("kempner_resilience.integrations.submitit")


class ResilientLocalJob(LocalJob):  # type: ignore[misc]
    """A ``submitit.LocalJob`` whose ``_interrupt()`` preempts the tasks, not the controller."""

    def _interrupt(self) -> None:
        interrupt_tasks(self)


def interrupt_tasks(job: Any) -> None:
    """Send submitit's preemption signal (the one its ``_interrupt()`` uses) to every running
    task of the local ``job``, as SLURM sends it to every task."""
    pids = local_task_pids(job)
    if not pids:
        log.warning("local job %s has no running task to interrupt", job.job_id)
    for pid in pids:
        try:
            os.kill(pid, LocalJobEnvironment._usr_sig())
        except ProcessLookupError:
            pass


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except (OSError, ValueError):
        return []


def _is_task(pid: int) -> bool:
    try:
        return b"\0SUBMITIT_LOCAL_GLOBALID=" in b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def local_task_pids(job: Any) -> list[int]:
    """The running task processes of a local job: the controller's children (its
    grandchildren when a ``setup`` shell runs the controller) that carry a task id."""
    proc = getattr(job, "_process", None)
    if proc is None or proc.poll() is not None:
        return []
    found, level = [], [proc.pid]
    for _ in range(3):        # the shell, the controller, the tasks
        level = [c for p in level for c in _children(p)]
        found += [c for c in level if _is_task(c)]
        if found:
            return found
    return found
