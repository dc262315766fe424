"""How long the next save will take, from saves measured in this process (or recorded in the
checkpoint we resumed from).

A save has a fixed part (planning, collectives, the commit, fsyncs of small files) and a part
proportional to the bytes this rank writes. Both are measured per save: ``write_s`` is the time
spent writing this rank's files, ``elapsed_s`` the whole save. The next save of the same state
costs about what the last ones did; when the state grew, the write part grows with it.

Nothing is extrapolated from bytes/second over a whole save: a rank that writes a few KiB (DDP
deduplicates replicated tensors onto rank 0) in a 0.9 s save has a "rate" of a few KiB/s, and
dividing the full state size by that predicted a 2-minute save for a 1-second one.

Without any measurement the estimate has no evidence behind it (``Estimate.measured`` is False):
callers then try the save rather than refuse it; the deadline watchdog is the backstop.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

__all__ = ["Estimate", "SaveEstimator"]

# Used only to say something before any save was measured (a slow shared filesystem).
FALLBACK_BYTES_PER_S = 100 * 2**20
FALLBACK_OVERHEAD_S = 2.0
# Measured saves vary by tens of percent from one to the next on a shared disk.
SAFETY = 1.25


@dataclass(frozen=True)
class Estimate:
    """Seconds a save should take; ``measured`` says whether saves were measured to get it."""

    seconds: float
    measured: bool


@dataclass(frozen=True)
class _Sample:
    elapsed_s: float      # the whole save on this rank
    write_s: float        # of which: writing this rank's files (scales with the state)
    state_nbytes: int     # the state's size at that save


class SaveEstimator:
    """Keeps the last few measured saves of this rank and predicts the next one."""

    def __init__(self, keep: int = 3) -> None:
        self._samples: deque[_Sample] = deque(maxlen=keep)

    @property
    def measured(self) -> bool:
        return bool(self._samples)

    def record(self, elapsed_s: float, write_s: float, state_nbytes: int) -> None:
        """One finished save: its total time, its writing time and the state size it held."""
        if elapsed_s <= 0:
            return
        write_s = min(max(write_s, 0.0), elapsed_s)
        self._samples.append(_Sample(elapsed_s, write_s, max(state_nbytes, 1)))

    def seed(self, save_seconds: float, state_nbytes: int) -> None:
        """A save recorded in a checkpoint's manifest (a previous attempt of this job): its
        time is all counted as writing, so it scales with the state, never shrinks with it."""
        if not self._samples and save_seconds > 0:
            self._samples.append(_Sample(save_seconds, save_seconds, max(state_nbytes, 1)))

    def estimate(self, state_nbytes: int) -> Estimate:
        """The next save of a state of ``state_nbytes`` on this rank."""
        if not self._samples:
            return Estimate(state_nbytes / FALLBACK_BYTES_PER_S + FALLBACK_OVERHEAD_S, False)
        # The median of the recent saves: the first save of a run also builds DCP's plan and
        # touches fresh memory, and one slow save on a shared disk should not dominate.
        predictions = [
            (s.elapsed_s - s.write_s) + s.write_s * max(state_nbytes / s.state_nbytes, 1.0)
            for s in self._samples]
        return Estimate(SAFETY * statistics.median(predictions), True)

    def remaining(self, nbytes: int, started_ago_s: float) -> Estimate:
        """What is left of a save of ``nbytes`` that started ``started_ago_s`` seconds ago."""
        est = self.estimate(nbytes)
        return Estimate(max(est.seconds - started_ago_s, 0.0), est.measured)
