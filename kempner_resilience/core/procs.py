"""Is a process of this host still the one that was recorded? For the markers other processes
leave (the rescue's claim, the directory lease): a pid alone can be reused, and a killed process
that its parent has not reaped yet still answers ``kill(pid, 0)``."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["process_start", "pid_alive"]


def _stat(pid: int) -> list[bytes]:
    """The fields of /proc/<pid>/stat after the command name (which may hold spaces): the
    state first; [] if unknown."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return []
    return raw[raw.rfind(b")") + 2:].split()


def process_start(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot, /proc), None if unknown."""
    fields = _stat(pid)
    return fields[19].decode() if len(fields) > 19 else None


def pid_alive(pid: int, start: str | None = None) -> bool:
    """Whether process ``pid`` of this host lives (and is the one that started at ``start``)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = _stat(pid)
    if fields and fields[0] in (b"Z", b"X"):
        return False                   # dead, not yet reaped by its parent (srun, a launcher)
    if start is not None and len(fields) > 19 and fields[19].decode() != start:
        return False                   # the pid was reused
    return True
