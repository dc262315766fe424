"""The run as its loop and its shutdown see it: the frozen parts and the progress, together.

``RunState`` is frozen too; it only pairs the two, and says what follows from both: the step a
requeue comes back to, and rank 0's word to a supervisor (``supervise/channel.py``) after the
set-up, after every commit and, with its exit code, when the run ended; without a supervisor,
each rank's word about how it ended (``supervise/endings.py``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from kempner_resilience.exitcodes import Ending, ExitCode
from kempner_resilience.runstate.parts import RunParts
from kempner_resilience.runstate.progress import Progress
from kempner_resilience.supervise.rank import has_supervisor, report_now
from kempner_resilience.supervise.endings import RankEnding, note_ending

_LEASE_LOST = Ending.LEASE_LOST.value
_LEFT_EARLY = Ending.LEFT_EARLY.value

if TYPE_CHECKING:
    from kempner_resilience.checkpoint.info import CheckpointInfo

__all__ = ["RunState"]


@dataclass(frozen=True)
class RunState:
    """``parts``: built at set-up, never changed; ``progress``: what the run has done."""

    parts: RunParts
    progress: Progress

    @property
    def rank(self) -> int:
        return self.parts.agreement.rank

    @property
    def step(self) -> int:
        return self.progress.step

    def committed_step(self) -> int | None:
        """The step a requeue comes back to: this process's newest commit, else the resumed
        checkpoint's; None without either."""
        info = self.progress.last_saved or self.parts.resumed_from
        return None if info is None else int(info.step)

    def saved(self, info: CheckpointInfo) -> None:
        """This process committed ``info`` (a periodic, manual, emergency or rescue save): the
        step a requeue comes back to, and the supervisor is told."""
        self.progress.saved(info)
        self.tell_supervisor()

    def tell_supervisor(self, code: int | None = None) -> None:
        """Rank 0 under a supervisor: which run this is (its resolved checkpoint.dir, run id,
        requeue settings), its committed step and, once it ended, its exit code. Never raises;
        nothing without a supervisor or without checkpoints."""
        parts = self.parts
        if parts.supervisor is None or parts.ckpt is None:
            return
        report_now(parts.supervisor, parts.ckpt.paths.root, run_id=parts.run_id,
                   committed=self.committed_step(), code=code,
                   requeue=asdict(parts.config.requeue))

    def note_ending(self, kind: str, code: int) -> None:
        """With no supervisor: how this rank ended (``kind``, an ``Ending`` value, and its
        exit ``code``), where rank 0 reads it before it requeues after losing this rank, and
        the other survivors that rank 0 is deciding (``supervise/endings.py``). Under a
        supervisor its exit code says it. Never raises; nothing without checkpoints (nothing
        to requeue to) or in one process."""
        parts = self.parts
        # A rank that left run.steps early says so under a supervisor too: its exit code (0)
        # tells the supervisor, but only this word tells its peers which rank and step.
        if parts.ckpt is None or parts.attempt_token is None \
                or (has_supervisor() and kind != _LEFT_EARLY):
            return
        # A run another run took checkpoint.dir over from writes nothing there any more (its
        # lease says so on rank 0; every rank's code says so): the directory is the new
        # holder's, and this run's ending is nobody's to read.
        if kind == _LEASE_LOST or int(code) == int(ExitCode.LEASE_LOST) or parts.ckpt.lease_lost:
            return
        note_ending(parts.ckpt.paths, parts.attempt_token,
                    RankEnding(self.rank, kind, int(code), self.step))
