"""The public value types of the checkpoint subsystem: what a save returns and what it raises."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kempner_resilience.core.startup import StartupError

__all__ = ["CheckpointError", "CheckpointCommitted", "CheckpointCorrupt", "CheckpointDamaged",
           "CheckpointDirError", "CheckpointInfo", "LineageDamagedError", "SavePeerLost",
           "StateMismatchError", "describe_error", "is_damage"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, found or loaded. The message names the problem and the fix."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint's files do not match its manifest (checksum, size, owner) or cannot be parsed."""


class CheckpointDamaged(CheckpointCorrupt):
    """The bytes on disk prove the checkpoint damaged: a checksum that does not match, a file
    shorter or longer than its manifest says, a file the manifest lists that is gone. Not a
    permission, an I/O error or a state that does not fit (those may pass): a checkpoint that
    fails with this at resume is set aside (``checkpoint/quarantine.py``)."""


class CheckpointCommitted(CheckpointError):
    """A save was pointed at a directory that holds a committed checkpoint. Refused before any
    byte is written: writing over it would destroy the checkpoint it holds."""


def is_damage(err: BaseException | None) -> bool:
    """Whether ``err`` (or, for DCP's ``CheckpointException``, any rank's failure in it) is a
    ``CheckpointDamaged``."""
    if isinstance(err, CheckpointDamaged):
        return True
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict):
        for f in failures.values():
            cause = f[0] if isinstance(f, tuple) and f else getattr(f, "exc", f)
            if isinstance(cause, CheckpointDamaged):
                return True
    return False


class CheckpointDirError(CheckpointError, StartupError):
    """``checkpoint.dir`` cannot hold checkpoints (missing parent, not a directory, not writable,
    full), found at start: uncaught in a script, the process exits with 78 (CONFIG)."""


class StateMismatchError(CheckpointError, StartupError):
    """The checkpoint and the live state do not hold the same entries (a layer or ``state`` key
    removed or added since it was written): resuming would silently drop saved state or cannot
    fill new state. Refused on every rank alike, and never by falling back to an older
    checkpoint (it would not match either, or match by chance); uncaught in a script, the
    process exits with 78 (CONFIG). ``checkpoint.allow_partial_resume`` opts in."""


class LineageDamagedError(CheckpointError, StartupError):
    """Every checkpoint the run could resume from was found damaged and set aside
    (``checkpoint/quarantine.py``): starting again at step 0 under the same run would quietly
    drop the training they held, so the run refuses to start, on every rank alike, and keeps
    refusing while set-aside checkpoints of its lineage exist. ``checkpoint.resume: false``
    starts a new lineage on purpose; uncaught in a script, the process exits with 78 (CONFIG).
    ``set_aside`` lists the directories, where they lie now."""

    def __init__(self, message: str, set_aside: list[Path] | None = None) -> None:
        super().__init__(message)
        self.set_aside = list(set_aside or [])


class SavePeerLost(RuntimeError):
    """A save's collective failed because another rank is gone, or timed out waiting for one
    that does not answer (paused, frozen). Not a failed save (the storage is fine, and no later
    save could succeed without that rank): it is never a ``CheckpointError``, never counted
    among ``checkpoint.max_failed_saves``, and propagates out of the save like any lost peer in
    a training collective (``faults.is_peer_failure`` recognises it: ``peer_failure``). The
    collective's own error is its ``__cause__``."""

    peer_failure = True


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint.

    ``step`` is the number of completed training steps it holds: resuming from it continues with
    step index ``step``. ``committed_at`` is wall-clock time (``time.time()``) of the commit,
    ``nbytes`` the total size of its data files, ``save_seconds`` how long the save took (the
    caller-blocked part for async saves is in ``blocked_seconds``).
    """

    step: int
    path: Path
    reason: str
    committed_at: float
    nbytes: int
    world_size: int = 1
    save_seconds: float = field(default=0.0, compare=False)
    blocked_seconds: float = field(default=0.0, compare=False)


def describe_error(err: BaseException | None) -> str | None:
    """One line per cause. DCP wraps each rank's exception (with a traceback) in a
    ``CheckpointException`` whose ``failures`` map rank -> (exception, frames) or exception."""
    if err is None:
        return None
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and type(err).__name__ == "CheckpointException":
        causes = [f[0] if isinstance(f, tuple) and f else getattr(f, "exc", f)
                  for _, f in sorted(failures.items())]
        return "; ".join(f"rank {r}: {type(c).__name__}: {c}"
                         for r, c in zip(sorted(failures), causes))[-4000:]
    return f"{type(err).__name__}: {err}"[-4000:]
