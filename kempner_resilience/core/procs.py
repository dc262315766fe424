"""The package's one /proc reader. Is a process of this host still the one that was recorded?
For the markers other processes leave (the rescue's claim, the directory lease): a pid alone can
be reused, and a killed process that its parent has not reaped yet still answers
``kill(pid, 0)``. Which processes a launcher's child started (``children``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable

__all__ = ["process_start", "pid_alive", "thread_states", "children", "descendants"]


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:
        return b""


def _fields(raw: bytes) -> list[bytes]:
    """The fields of a /proc stat line after the command name (which may hold spaces): the
    state first; [] if unknown."""
    return raw[raw.rfind(b")") + 2:].split()


def _stat(pid: int) -> list[bytes]:
    return _fields(_read(f"/proc/{pid}/stat"))


def thread_states(prefix: bytes) -> list[bytes]:
    """The states (``R``, ``S``, ...) of this process's threads whose name starts with
    ``prefix`` (a name torch gives its threads); [] without /proc."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return []
    states = []
    for tid in tids:
        raw = _read(f"/proc/self/task/{tid}/stat")
        fields = _fields(raw)
        if fields and raw[raw.find(b"(") + 1:raw.rfind(b")")].startswith(prefix):
            states.append(fields[0])
    return states


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


def children(pids: Iterable[int]) -> list[int]:
    """The processes whose parent is one of ``pids``, from every /proc/<pid>/stat (a thread's
    own ``children`` file lists only what that thread started)."""
    wanted = set(pids)
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    found = []
    for entry in entries:
        fields = _stat(int(entry)) if entry.isdigit() else []
        if len(fields) > 1 and fields[1].isdigit() and int(fields[1]) in wanted:
            found.append(int(entry))
    return found


def descendants(root: int) -> list[int]:
    """Every process below ``root``, each after its parent."""
    order, level = [], [root]
    while level:
        level = children(level)
        order += level
    return order
