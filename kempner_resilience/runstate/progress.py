"""What a run has done so far: the one mutable piece of its state, owned by the run.

The loop moves the step, every commit is noted (the step a requeue comes back to), the shutdown
sequence notes how long each of its steps took, what the teardown did, and how the run ended.
Nothing else is written after the set-up: the parts are frozen (``parts.py``), and the shutdown
steps return what they did for their caller to note here (``shutdown/stages.py``).

Threads: the main thread writes it, and, once it decided, the hang watchdog's thread (the hang
ending) or the signal thread (a forced exit); each write is one assignment under the GIL.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from kempner_resilience.exitcodes import Facts
from kempner_resilience.stop.teardown import CleanupResult

if TYPE_CHECKING:
    from kempner_resilience.checkpoint.info import CheckpointInfo

__all__ = ["Progress"]


class Progress:
    """The run's step, its commits, its shutdown's timings and results, and its ending."""

    def __init__(self, step: int = 0) -> None:
        self._step = step
        self._last_saved: CheckpointInfo | None = None
        self._timings: dict[str, float] = {}
        self._cleanup_results: list[CleanupResult] = []
        self._loop_end_wall: float | None = None
        self._outcome: Facts | None = None

    # ------------------------------------------------------------------ read

    @property
    def step(self) -> int:
        """Completed steps: the current step boundary."""
        return self._step

    @property
    def last_saved(self) -> CheckpointInfo | None:
        """The newest commit by this process (periodic, manual, emergency or rescue)."""
        return self._last_saved

    @property
    def timings(self) -> dict[str, float]:
        """Seconds spent resuming, in the emergency save, the requeue, the teardown, ..."""
        return self._timings

    @property
    def cleanup_results(self) -> list[CleanupResult]:
        """What the shutdown's teardown did, each cleanup in the order it ran."""
        return self._cleanup_results

    @property
    def loop_end_wall(self) -> float | None:
        """``time.time()`` when ``steps()`` ran out of steps."""
        return self._loop_end_wall

    @property
    def outcome(self) -> Facts | None:
        """How the run ended, once its ending is being recorded."""
        return self._outcome

    # ------------------------------------------------------------------ write

    def resumed(self, step: int, load_s: float) -> None:
        """The set-up resumed the run at ``step``; the load took ``load_s``."""
        self._step = step
        self._timings["resume_s"] = load_s

    def advance(self) -> int:
        """One more step completed; returns the new boundary."""
        self._step += 1
        return self._step

    def loop_ended(self, wall: float) -> None:
        self._loop_end_wall = wall

    def saved(self, info: CheckpointInfo) -> None:
        self._last_saved = info

    def took(self, name: str, seconds: float) -> None:
        """A step of the shutdown (or the resume) took ``seconds``: ``timings[name]``."""
        self._timings[name] = seconds

    def tore_down(self, results: Sequence[CleanupResult]) -> None:
        self._cleanup_results = list(results)

    def ended(self, facts: Facts) -> None:
        """The run ends with ``facts``: noted before the ending is written anywhere, so a
        second ending (a forced exit meanwhile) knows it comes too late."""
        self._outcome = facts
