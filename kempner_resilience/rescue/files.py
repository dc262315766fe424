"""The rescue's coordination files on the shared checkpoint directory: no collective is needed
(the process group has lost a member) and no store (it may have died with rank 0's node).

    <checkpoint.dir>/.rescue/<attempt>/
        rank<r>.step<S>     rank r's snapshot of boundary S, from r itself or from its buddy
        offered.<r>         rank r has offered every snapshot it holds (its own, its
                            predecessor's): what is missing then can only come from elsewhere
        claim               created with O_CREAT|O_EXCL: the one rank that writes the checkpoint
        done.json           the outcome: the step committed and where, or why nothing was

Each file appears whole (written under a temporary name, then renamed). ``<attempt>`` is a
token agreed at start, so files of an earlier attempt never count; rank 0 removes those at
start (``remove_stale``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import socket
import time
from pathlib import Path
from typing import Any

__all__ = ["RescueFiles", "RESCUE_DIR", "remove_stale"]

RESCUE_DIR = ".rescue"
_SNAP_RE = re.compile(r"^rank(\d+)\.step(\d+)$")
_OFFERED_RE = re.compile(r"^offered\.(\d+)$")


def _write_whole(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{time.monotonic_ns()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)
    os.rename(tmp, path)


class RescueFiles:
    """The files of one attempt's rescue under ``root``."""

    def __init__(self, root: Path, attempt: str) -> None:
        self.dir = Path(root) / RESCUE_DIR / attempt

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

    def mark_offered(self, rank: int) -> None:
        self._ensure()
        _write_whole(self.dir / f"offered.{rank}", b"")

    def offered(self) -> set[int]:
        """The ranks that have offered what they hold."""
        try:
            names = os.listdir(self.dir)
        except FileNotFoundError:
            return set()
        return {int(m.group(1)) for m in map(_OFFERED_RE.match, names) if m}

    def listing(self) -> str:
        """The snapshot files offered so far, for a log line."""
        try:
            return ", ".join(sorted(n for n in os.listdir(self.dir) if _SNAP_RE.match(n))) \
                or "none"
        except OSError as e:
            return f"cannot list {self.dir}: {e.strerror}"

    def claim(self, rank: int, step: int) -> bool:
        """Whether this rank is the one to write the rescue checkpoint (the first to ask)."""
        self._ensure()
        try:
            fd = os.open(self.dir / "claim", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                         0o600)
        except FileExistsError:
            return False
        try:
            os.write(fd, json.dumps({"rank": rank, "step": step, "pid": os.getpid(),
                                     "host": socket.gethostname(),
                                     "time": time.time()}).encode())
        finally:
            os.close(fd)
        return True

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


def remove_stale(root: Path, keep: str) -> None:
    """Remove the rescue files of earlier attempts (rank 0, at start; a failure is harmless)."""
    top = Path(root) / RESCUE_DIR
    try:
        names = os.listdir(top)
    except OSError:
        return
    for name in names:
        if name != keep:
            with contextlib.suppress(OSError):
                shutil.rmtree(top / name)
