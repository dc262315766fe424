"""The processes a launch of ranks left behind: found through /proc and ended, bounded in time.

A rank's script may start processes of its own (a data server, a ``subprocess.Popen`` it never
waits for, a daemon that calls ``setsid``). Killing the rank leaves them running, re-parented to
init, and a relaunch then starts a second set beside them. SLURM ends every process of a job
step when the step ends (its cgroup); a local launcher has to do the same itself. A process is
the launch's when either holds:

- its session is a rank's (each rank is started in a session of its own): every descendant
  that did not call ``setsid``, whether it kept the environment or not;
- its environment carries the launch's mark (``KEY=VALUE``, unique to the launcher): a
  descendant that left the session with ``setsid`` or a double fork still inherits it.

Both hold only for processes started after the launch (their start time in /proc), so a pid or
session id reused by an unrelated process is never taken for one. Only /proc of this host is
read, the environment only of processes that started after the launch (another user's cannot be
read: as for ``kill``, a launcher ends only what it may).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Iterable

__all__ = ["clock_ticks_now", "strays", "end_strays"]

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def clock_ticks_now() -> int | None:
    """Now, in /proc's start-time units (clock ticks since boot); None without /proc."""
    try:
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return int(uptime * _TICKS) - 1     # /proc/uptime is rounded: never after a start


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, session id, start time) of ``pid``; None if unknown."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2:].split()
    try:
        return fields[0].decode(), int(fields[3]), int(fields[19])
    except (IndexError, ValueError):
        return None


def _carries(pid: int, mark: bytes) -> bool:
    try:
        return mark in b"\0" + Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def strays(sessions: Iterable[int], mark: tuple[str, str] | None,
           since: int | None) -> list[int]:
    """The live processes of this host in one of ``sessions`` or carrying ``mark`` in their
    environment (``(KEY, VALUE)``), started at or after ``since`` (clock ticks since boot;
    None: no process qualifies, the start cannot be told). This process is never one."""
    if since is None:
        return []
    sids = set(sessions)
    needle = None if mark is None else f"\0{mark[0]}={mark[1]}\0".encode()
    me = os.getpid()
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit() or int(name) == me:
            continue
        pid = int(name)
        st = _stat(pid)
        if st is None or st[0] in ("Z", "X") or st[2] < since:
            continue
        if st[1] in sids or (needle is not None and _carries(pid, needle)):
            found.append(pid)
    return found


def end_strays(sessions: Iterable[int], mark: tuple[str, str] | None, since: int | None,
               timeout_s: float = 2.0) -> list[int]:
    """SIGKILL every process ``strays`` finds, again until none is left (a process may fork as
    it is found) or ``timeout_s`` has passed; the pids ended."""
    sessions = list(sessions)
    ended: list[int] = []
    deadline = time.monotonic() + timeout_s
    while True:
        killed = []
        for pid in strays(sessions, mark, since):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except (ProcessLookupError, PermissionError):
                pass
        ended.extend(p for p in killed if p not in ended)
        if not killed or time.monotonic() > deadline:
            return ended
        time.sleep(0.02)      # a killed process shows as a zombie (skipped) a moment later
