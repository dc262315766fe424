"""The configuration's errors: each names the key path, the bad value and the fix.

A message stays readable whatever the value was: values are shown through ``shown`` (a short
``repr``), and each problem's line is cut to ``MAX_LINE`` characters, so a 25 MB string in a
config never becomes a 25 MB error message (nor the time and memory to build one).
"""

from __future__ import annotations

import reprlib
from typing import Any

from kempner_resilience.core.startup import StartupError

__all__ = ["ConfigError", "ConfigFileNotFoundError", "shown", "cut", "MAX_LINE"]

MAX_LINE = 500          # characters of one problem's line

_repr = reprlib.Repr()
_repr.maxstring = 80
_repr.maxother = 80
_repr.maxlong = 40
_repr.maxlist = _repr.maxtuple = _repr.maxdict = _repr.maxset = 6
_repr.maxlevel = 3


def shown(value: Any) -> str:
    """``repr(value)``, shortened (``'aaaa...aaaa'``, ``[1, 2, ...]``): what a message shows."""
    return _repr.repr(value)


def cut(text: str, limit: int = MAX_LINE) -> str:
    """``text``, or its start and end around a note of how much was cut."""
    if len(text) <= limit:
        return text
    tail = 60
    return f"{text[:limit - tail]} ... [{len(text) - limit:,} characters cut] ... {text[-tail:]}"


class ConfigError(ValueError, StartupError):
    """A configuration problem. ``problems`` holds one ``(key_path, message)`` per mistake.

    Uncaught in a script, it ends the process with exit code 78 (CONFIG) and this message.
    """

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None) -> None:
        self.problems = [(cut(path, 200), cut(msg)) for path, msg in problems]
        self.source = source
        head = f"invalid configuration in {cut(source, 300)}" if source else \
            "invalid configuration"
        lines = [f"{path}: {msg}" if path else msg for path, msg in self.problems]
        super().__init__(head + ":\n  " + "\n  ".join(lines))

    def prefixed(self, prefix: str) -> "ConfigError":
        return ConfigError(
            [(f"{prefix}.{p}" if p else prefix, m) for p, m in self.problems], self.source
        )


class ConfigFileNotFoundError(FileNotFoundError, StartupError):
    """The config file does not exist (exit code 78 when uncaught in a script)."""
