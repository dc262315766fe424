"""What ``check-resume`` checks: the command, the ranks, the steps, the interrupts, validated.

Kept apart from the checking itself (``check.py``), which reads checkpoints with torch: a wrong
command line is answered without loading it.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from kempner_resilience.stop.rehearsal import PlannedStop, min_gap

__all__ = ["CheckOptions"]


@dataclass(frozen=True)
class CheckOptions:
    """What to check: the command every rank runs and how the two runs go."""

    command: tuple[str, ...]
    ranks: int = 1
    steps: int = 10
    interrupt_at: tuple[int, ...] = (3, 7)
    signal_name: str = "SIGUSR1"
    kill_rank: int | None = None          # SIGKILL this rank at the interrupts instead
    timeout_s: float = 120.0              # per run
    max_steps: int = 300                  # how far a run may go to cross an epoch end
    workdir: Path | None = None           # kept; None: a temporary one, removed when exact
    config: Mapping[str, Any] = field(default_factory=dict)   # the user's resolved config

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("give the command every rank runs (after `--`)")
        if self.ranks < 1:
            raise ValueError(f"--ranks {self.ranks}: give 1 or more")
        if self.steps < 2:
            raise ValueError(f"--steps {self.steps}: give 2 or more")
        if not self.interrupt_at:
            raise ValueError("--interrupt-at: give at least one step")
        gap = min_gap(self.ranks)
        marks = [0, *self.interrupt_at, self.steps]
        if any(b - a < gap for a, b in zip(marks, marks[1:])):
            raise ValueError(f"--interrupt-at {','.join(map(str, self.interrupt_at))}: give "
                             f"increasing steps, at least {gap} apart, after step 0 and "
                             f"{gap} before --steps {self.steps} (with {self.ranks} ranks a stop "
                             f"is agreed {gap - 1} steps after the signal)")
        self.signum                        # raises ValueError for an unknown name
        if self.kill_rank is not None and not 0 <= self.kill_rank < self.ranks:
            raise ValueError(f"--kill-rank {self.kill_rank}: give a rank between 0 and "
                             f"{self.ranks - 1}")
        if self.kill_rank is not None and self.ranks < 2:
            raise ValueError("--kill-rank needs --ranks 2 or more (survivors to rescue)")
        if self.max_steps < self.steps:
            raise ValueError(f"--max-steps {self.max_steps}: give at least --steps "
                             f"{self.steps} (how far a run may go to cross an epoch end)")
        if self.timeout_s <= 0:
            raise ValueError(f"--timeout {self.timeout_s}: give a positive number of seconds")

    @property
    def signum(self) -> int:
        name = self.signal_name.upper()
        try:
            return int(signal.Signals[name if name.startswith("SIG") else f"SIG{name}"])
        except KeyError:
            raise ValueError(f"--signal {self.signal_name}: not a signal name") from None

    def interrupts(self) -> list[PlannedStop]:
        if self.kill_rank is not None:
            return [PlannedStop(s, signal.SIGKILL, self.kill_rank) for s in self.interrupt_at]
        return [PlannedStop(s, self.signum) for s in self.interrupt_at]
