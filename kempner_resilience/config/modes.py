"""The enums of the configuration's mode keys (``signals.actions``, ``watchdog.exit_mode``,
``checkpoint.staging``, ``checkpoint.direct_io``): one value per allowed spelling, each
commented with what it does. ``schema`` declares the keys; the modules that act on a mode
import its enum from ``kempner_resilience.config``."""

from __future__ import annotations

import enum

__all__ = ["Action", "DirectIOMode", "ExitMode", "StagingMode"]


class Action(str, enum.Enum):
    """What a shutdown signal asks for."""

    REQUEUE = "requeue"  # emergency checkpoint, then requeue the job (exit code REQUEUE)
    STOP = "stop"  # emergency checkpoint, then stop for good (130/143, or STOPPED)
    OFF = "off"  # not handled by us: the signal keeps whatever handler it had

    def __str__(self) -> str:
        return self.value


class ExitMode(str, enum.Enum):
    """How a run that ended leaves (see ``kempner_resilience.shutdown.exit``)."""

    AUTO = "auto"    # raise in IPython/interactive sessions, exit in SLURM/launched ranks
    EXIT = "exit"    # the process ends with the run: exit bounded, slow finalisation skipped
    RAISE = "raise"  # the caller lives on after SystemExit: nothing stays armed

    def __str__(self) -> str:
        return self.value


class StagingMode(str, enum.Enum):
    """Host buffers that device (CUDA) state is copied through on its way to and from disk."""

    PINNED = "pinned"      # page-locked: fast, asynchronous copies (~1 s per GiB to allocate)
    PAGEABLE = "pageable"  # ordinary memory, allocated and touched once, reused
    OFF = "off"            # no staging: a fresh .cpu() copy per tensor at every save

    def __str__(self) -> str:
        return self.value


class DirectIOMode(str, enum.Enum):
    """Whether checkpoint files are written past the page cache (``checkpoint/directio.py``)."""

    AUTO = "auto"  # O_DIRECT where checkpoint.dir's filesystem takes it, buffered elsewhere
    ON = "on"      # O_DIRECT or a start-up error (78): never a silent page-cache save
    OFF = "off"    # through the page cache (no O_DIRECT buffers held)

    def __str__(self) -> str:
        return self.value
