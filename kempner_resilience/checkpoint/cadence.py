"""Periodic saves: when the next one is due (every ``every_steps`` steps, or ``every_minutes``
since the last save, the minutes agreed across ranks without a wait inside a step), and how
many failed in a row (``checkpoint.max_failed_saves`` of them stop the run)."""

from __future__ import annotations

import time

from kempner_resilience.checkpoint.comm import Comm, PendingMax
from kempner_resilience.checkpoint.info import CheckpointError
from kempner_resilience.config import CheckpointConfig

__all__ = ["Cadence"]


class Cadence:
    """The periodic-save clock of one manager; ``comm`` is its foreground group."""

    def __init__(self, config: CheckpointConfig, comm: Comm) -> None:
        self._config = config
        self._comm = comm
        self.last_step = -1
        self._last_time = time.monotonic()
        self._pending: PendingMax | None = None
        self.failed = 0               # periodic saves failed in a row (the same on every rank)
        self.last_failure = ""

    def due(self, step: int) -> bool:
        """Is a periodic save of ``step`` due? The same answer on every rank: collective when
        ``every_minutes`` is set and the group is distributed (call it at every step)."""
        cfg = self._config
        due = cfg.every_steps > 0 and step % cfg.every_steps == 0
        if cfg.every_minutes > 0:
            # Clocks differ across ranks: agree through an all-reduce started at the previous
            # step (``step_done``) and read now, so no rank waits on it inside a step.
            if self._comm.distributed:
                due = due or (self._pending is not None and self._pending.result() > 0)
            else:
                due = due or self._minutes_due()
        return due and step != self.last_step

    def step_done(self) -> None:
        """Start the all-reduce that the next ``due`` reads."""
        if self._config.every_minutes > 0 and self._comm.distributed:
            self._pending = self._comm.max_async(1.0 if self._minutes_due() else 0.0)

    def saved(self, step: int) -> None:
        """``step`` is saved (or its async save started): the clock starts again. (A commit
        resets ``failed``: ``committed``.)"""
        self.last_step = step
        self._last_time = time.monotonic()

    def committed(self) -> None:
        """A save committed: no failure in a row any more."""
        self.failed = 0

    def retry_later(self) -> None:
        """A periodic save failed: the next one is due a full interval from now."""
        self._last_time = time.monotonic()

    def _minutes_due(self) -> bool:
        return time.monotonic() - self._last_time >= self._config.every_minutes * 60

    def save_failed(self, err: BaseException) -> None:
        """Count a failed periodic save (``err`` says why)."""
        self.failed += 1
        self.last_failure = str(err)

    def check_failures(self) -> None:
        """CheckpointError once ``max_failed_saves`` periodic saves in a row have failed."""
        n, limit = self.failed, self._config.max_failed_saves
        if n >= limit:
            raise CheckpointError(
                f"{n} periodic checkpoints in a row failed (checkpoint.max_failed_saves={limit}), "
                f"the last with: {self.last_failure} Fix the cause and restart the job; it "
                "resumes from the newest committed checkpoint.")
