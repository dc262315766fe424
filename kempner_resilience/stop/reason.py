"""Why every rank stops at an agreed step: a signal, the allocation's end, or a lost lease.

A stop is agreed through the process group's store (``agreement.py``) and carried to the
shutdown sequence as one of these, never as a signal number standing in for something else:
the time-limit stop is no signal, and the ledger's ``stop`` event says ``time-limit``, not the
signal whose action it takes (``shutdown/stages.py`` decides that action, in one place).

The reason crosses processes twice: as text in the store (``encode``/``decode``) and as one
integer in ``should_stop``'s all-reduce (``order``/``from_order``), where the largest wins on
every rank: any signal over the time limit over nothing.
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass
from typing import ClassVar

__all__ = ["StopKind", "StopReason"]


class StopKind(enum.Enum):
    """What made the ranks stop; the value is the ledger's word for the kinds without a
    signal."""

    SIGNAL = "signal"            # a shutdown signal reached some rank
    TIME_LIMIT = "time-limit"    # the allocation ends before one more step and a save fit
    LEASE_LOST = "lease-lost"    # rank 0 lost checkpoint.dir's lease to another run


@dataclass(frozen=True)
class StopReason:
    """One reason to stop: ``StopReason.signal(signum)``, ``StopReason.TIME_LIMIT`` or
    ``StopReason.LEASE_LOST``."""

    kind: StopKind
    signum: int | None = None    # SIGNAL only

    TIME_LIMIT: ClassVar["StopReason"]
    LEASE_LOST: ClassVar["StopReason"]

    def __post_init__(self) -> None:
        if (self.kind is StopKind.SIGNAL) != (self.signum is not None and self.signum > 0):
            raise ValueError(f"{self.kind.value}: a signal number with SIGNAL only, got "
                             f"{self.signum!r}")

    @classmethod
    def signal(cls, signum: int) -> "StopReason":
        return cls(StopKind.SIGNAL, int(signum))

    @property
    def word(self) -> str:
        """How the ledger, the report and the log name it: ``SIGUSR1``, ``time-limit``,
        ``lease-lost``."""
        if self.signum is None:
            return self.kind.value
        try:
            return signal.Signals(self.signum).name
        except ValueError:
            return f"signal {self.signum}"

    def encode(self) -> str:
        """The store's text: the signal's number, or the kind's word."""
        return str(self.signum) if self.signum is not None else self.kind.value

    @classmethod
    def decode(cls, text: str) -> "StopReason":
        return cls.signal(int(text)) if text.isdigit() else cls(StopKind(text))

    @property
    def order(self) -> int:
        """The all-reduce's integer (MAX wins): 0 is no reason, 1 the time limit, a signal its
        number + 1 (so signals keep their order among themselves)."""
        if self.kind is StopKind.LEASE_LOST:
            raise ValueError("a lost lease is agreed through the store, not should_stop")
        return 1 if self.signum is None else self.signum + 1

    @classmethod
    def from_order(cls, order: int) -> "StopReason | None":
        if order <= 0:
            return None
        return cls.TIME_LIMIT if order == 1 else cls.signal(order - 1)


StopReason.TIME_LIMIT = StopReason(StopKind.TIME_LIMIT)
StopReason.LEASE_LOST = StopReason(StopKind.LEASE_LOST)
