"""The rescue's coordination files on the shared checkpoint directory: no collective is needed
(the process group has lost a member) and no store (it may have died with rank 0's node).

    <checkpoint.dir>/.rescue/<attempt>/
        rank<r>.step<S>     rank r's snapshot of boundary S, from r itself or from its buddy
        offered.<r>         rank r has offered every snapshot it holds (its own, its
                            predecessor's): what is missing then can only come from elsewhere
        died.<p>            rank p died without a word (its link to its buddy ended with
                            neither a goodbye nor a wake), and the buddy has offered all of p
                            it holds: nothing more of p can come
        claim               the one rank that writes the checkpoint: its JSON (rank, step, pid,
                            host, process start) written under a temporary name, then
                            hard-linked (fails if it exists; O_CREAT|O_EXCL where links are
                            not supported: ``fileio.write_atomic``); its mtime is the writer's
                            heartbeat
        done.json           the outcome: the step committed and where, or why nothing was

Each file appears whole (``fileio.write_atomic``: written under a temporary name, then renamed;
not fsynced, as no file outlives the attempt). ``<attempt>`` is a
token agreed at start, so files of an earlier attempt never count; rank 0 removes those at
start (``remove_stale``).

A claimant that died costs the others seconds, not ``rescue.budget_s`` (``claimant_gone``): on
its own host its pid (and that process's start time, against pid reuse) is checked; elsewhere
the claim's mtime, which the writer touches every ``HEARTBEAT_S``, must keep advancing.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import threading
import time
from pathlib import Path
from typing import Any

from kempner_resilience.core.fileio import write_atomic
from kempner_resilience.core.procs import pid_alive, process_start
from kempner_resilience.core.runpaths import RunPaths

__all__ = ["RescueFiles", "remove_stale", "pid_alive", "process_start"]

HEARTBEAT_S = 1.0        # how often a writer touches its claim
STALE_S = 10.0           # a claim of another host whose mtime stood still this long: writer gone
_SNAP_RE = re.compile(r"^rank(\d+)\.step(\d+)$")
_OFFERED_RE = re.compile(r"^offered\.(\d+)$")
_DIED_RE = re.compile(r"^died\.(\d+)$")


def _write_whole(path: Path, data: bytes, *, exclusive: bool = False) -> bool:
    # Not durable (no fsync): these files live for one attempt and only other processes read
    # them; a snapshot is as large as a rank's state, and the rescue's budget is seconds.
    return write_atomic(path, data, exclusive=exclusive, durable=False, mode=0o600)


class Heartbeat:
    """Touch ``path`` every ``HEARTBEAT_S`` from a daemon thread until ``stop()``: other hosts
    see the writer alive by the mtime advancing (utime needs no free space)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="kempner-rescue-heartbeat",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with contextlib.suppress(OSError):
                os.utime(self.path)

    def stop(self) -> None:
        self._stop.set()


class RescueFiles:
    """The files of one attempt's rescue in the run's directory."""

    def __init__(self, paths: RunPaths, attempt: str) -> None:
        self.dir = paths.rescue_attempt(attempt)
        self._seen: tuple[Any, float] | None = None   # the claim's (mtime, size), seen since

    def _ensure(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)

    def put(self, rank: int, step: int, payload: bytes) -> None:
        """Offer rank ``rank``'s snapshot of boundary ``step`` (the same bytes whoever writes
        them, so a second copy replacing the first changes nothing)."""
        self._ensure()
        _write_whole(self.dir / f"rank{rank}.step{step}", payload)

    def get(self, rank: int, step: int) -> bytes | None:
        try:
            return (self.dir / f"rank{rank}.step{step}").read_bytes()
        except FileNotFoundError:
            return None

    def ranks_at(self, step: int) -> set[int]:
        """The ranks whose snapshot of boundary ``step`` is here."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return set()
        out = set()
        for name in names:
            m = _SNAP_RE.match(name)
            if m and int(m.group(2)) == step:
                out.add(int(m.group(1)))
        return out

    def steps_of(self, rank: int) -> list[int]:
        """The boundaries of which ``rank``'s snapshot is here, oldest first."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(2)) for m in map(_SNAP_RE.match, names)
                      if m and int(m.group(1)) == rank)

    def mark_offered(self, rank: int) -> None:
        self._ensure()
        _write_whole(self.dir / f"offered.{rank}", b"")

    def offered(self) -> set[int]:
        """The ranks that have offered what they hold."""
        return self._ranks(_OFFERED_RE)

    def mark_died(self, rank: int) -> None:
        self._ensure()
        _write_whole(self.dir / f"died.{rank}", b"")

    def died(self) -> set[int]:
        """The ranks known dead whose buddy has offered all it holds of them."""
        return self._ranks(_DIED_RE)

    def _ranks(self, pattern: re.Pattern[str]) -> set[int]:
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return set()
        return {int(m.group(1)) for m in map(pattern.match, names) if m}

    def listing(self) -> str:
        """The snapshot files offered so far, for a log line."""
        try:
            return ", ".join(sorted(n for n in os.listdir(self.dir) if _SNAP_RE.match(n))) \
                or "none"
        except OSError as e:
            return f"cannot list {self.dir}: {e.strerror}"

    def claim(self, rank: int, step: int) -> bool:
        """Whether this rank is the one to write the rescue checkpoint (the first to ask).

        The claim appears whole (a hard link of a finished temporary file), so it always names
        its writer: a full disk makes the claim fail here, never leaves an empty one that the
        others cannot judge. Raises OSError when no claim could be made at all."""
        self._ensure()
        pid = os.getpid()
        data = json.dumps({"rank": rank, "step": step, "pid": pid,
                           "host": socket.gethostname(), "start": process_start(pid),
                           "time": time.time()}).encode()
        return _write_whole(self.dir / "claim", data, exclusive=True)

    def heartbeat(self) -> Heartbeat:
        """The claimant keeps its claim's mtime advancing while it writes."""
        return Heartbeat(self.dir / "claim")

    def claimant_gone(self, who: dict[str, Any]) -> str | None:
        """Why the claimant ``who`` (``claimant()``) is known to be gone, or None while it may
        still write. Call it repeatedly: on another host, it is gone once its claim's mtime
        stood still for ``STALE_S`` (measured on this host's monotonic clock, so no clock skew
        between hosts matters)."""
        pid, host = who.get("pid"), who.get("host")
        if isinstance(pid, int) and host == socket.gethostname():
            if not pid_alive(pid, who.get("start")):
                return f"its process {pid} on {host} is gone"
            return None
        try:
            st = os.stat(self.dir / "claim")
        except FileNotFoundError:
            return "its claim disappeared"
        key, now = (st.st_mtime_ns, st.st_size), time.monotonic()
        if self._seen is None or self._seen[0] != key:
            self._seen = (key, now)
            return None
        if now - self._seen[1] >= STALE_S:
            return f"its claim (host {host or '?'}) showed no heartbeat for {STALE_S:.0f} s"
        return None

    def claimant(self) -> dict[str, Any] | None:
        """Who claimed the rescue (None before anyone did; {} while the claim is being written)."""
        try:
            raw = (self.dir / "claim").read_bytes()
        except FileNotFoundError:
            return None
        try:
            return json.loads(raw)
        except ValueError:
            return {}

    def finish(self, outcome: dict[str, Any]) -> None:
        self._ensure()
        _write_whole(self.dir / "done.json", json.dumps(outcome).encode())

    def outcome(self) -> dict[str, Any] | None:
        try:
            return json.loads((self.dir / "done.json").read_bytes())
        except (FileNotFoundError, ValueError):
            return None


def remove_stale(paths: RunPaths, keep: str) -> None:
    """Remove the rescue files of earlier attempts (rank 0, at start; a failure is harmless)."""
    top = paths.rescue
    try:
        names = os.listdir(top)
    except OSError:
        return
    for name in names:
        if name != keep:
            with contextlib.suppress(OSError):
                shutil.rmtree(top / name)
