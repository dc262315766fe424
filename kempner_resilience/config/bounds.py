"""The allowed range of a numeric config key, declared once per field in the schema.

Every number the package reads from a config ends up in a timer, a deadline, a thread count or a
loop: NaN makes every comparison false (a grace period that never ends, a handler that raises),
infinity overflows a timer, 10**12 threads exhaust the host. So each numeric field declares a
``Range`` (``field(metadata=_help(..., bounds=Range(...)))``) and the serializer checks it for
every way a config is made: a YAML file, ``--set``/``overrides``, a mapping, or the dataclasses
built in Python. The range is also rendered into ``configs/default.yaml`` and docs/config.md.
"""

from __future__ import annotations

import math
import reprlib
from dataclasses import dataclass

__all__ = ["Range"]


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(float(x))


@dataclass(frozen=True)
class Range:
    """``lo <= value <= hi`` (``lo < value`` when ``lo_open``); ``unit`` is for messages and docs,
    ``note`` says what the low end means (e.g. "0 turns it off")."""

    lo: float
    hi: float
    lo_open: bool = False
    unit: str = ""
    note: str = ""

    def text(self) -> str:
        """``>= 1 and <= 256`` or ``> 0 and <= 86400 seconds``."""
        unit = f" {self.unit}" if self.unit else ""
        return f"{'>' if self.lo_open else '>='} {_num(self.lo)} and <= {_num(self.hi)}{unit}"

    def problem(self, value: int | float) -> str | None:
        """Why ``value`` (an int or float, never a bool) is not allowed, or None."""
        note = f" ({self.note})" if self.note else ""
        shown = reprlib.repr(value)  # 10**400 is shown shortened
        if isinstance(value, float) and not math.isfinite(value):
            return f"{shown} is not a finite number; must be {self.text()}{note}"
        low = value <= self.lo if self.lo_open else value < self.lo
        if self.lo == 0 and value < 0:
            return f"{shown} is negative; must be {self.text()}{note}"
        if low or value > self.hi:
            return f"{shown} is not allowed; must be {self.text()}{note}"
        return None
