"""One live run per checkpoint directory: the lease ``checkpoint.dir/.lease``.

Two runs started on one directory (twice the same sbatch, a notebook beside the batch job) both
adopt ``run.json`` and commit into the same step directories: one of them later fails with a
missing ``.metadata`` and the other's checkpoints are no longer what it wrote. Rank 0 of a live
run therefore holds the directory, and a second live run stops at start (exit 78) naming the
holder: host, pid, job id.

The lease has to work on NFS and Lustre, where ``flock`` may be unsupported or local to one
client, so it uses only what those servers make atomic: ``O_CREAT|O_EXCL`` creation and
``rename``. The holder writes who it is once and touches the file's mtime every
``HEARTBEAT_S`` from a daemon thread. A lease left behind (SIGKILL, a dead node) is taken over:

* at once when its holder is this host's process that no longer exists (pid gone, or reused:
  the process start time differs), or an earlier attempt of this same SLURM job (SLURM ends
  every process of a job before it runs the job again);
* otherwise once its mtime has not moved for ``STALE_S``, measured against the filesystem's
  own clock (a probe file's mtime), so the clocks of different hosts are never compared. A
  holder on another host whose mtime moves while we watch is alive: refused at once.

A takeover renames the stale file aside (of several contenders only one rename succeeds), checks
that what it moved is the lease it judged, and creates a fresh one with ``O_EXCL``.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kempner_resilience.checkpoint.info import CheckpointDirError
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.procs import pid_alive, process_start

__all__ = ["LEASE_FILE", "DirectoryInUseError", "Lease", "acquire"]

log = get_logger(__name__)

LEASE_FILE = ".lease"
HEARTBEAT_S = 5.0
# A holder whose heartbeat has not moved for this long is gone. Long enough for a slow
# filesystem or a briefly paused holder, short enough that a job resubmitted after a node
# died waits at most this long at start.
STALE_S = 60.0
_POLL_S = 0.5


class DirectoryInUseError(CheckpointDirError):
    """Another live run holds ``checkpoint.dir`` (exit 78 CONFIG when uncaught)."""


def _me(job_id: str | None, restart_count: int | None, run_id: str | None) -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": process_start(os.getpid()),
            "job_id": job_id, "restart_count": restart_count, "run_id": run_id,
            "token": uuid.uuid4().hex, "since": time.time()}


def describe(holder: dict[str, Any]) -> str:
    job = f", SLURM job {holder['job_id']}" if holder.get("job_id") else ""
    return f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}{job}"


@dataclass
class _Seen:
    holder: dict[str, Any] | None     # None: unreadable (being written, or garbage)
    mtime: float
    ino: int


class Lease:
    """A held lease: refreshed by a daemon thread until ``release()``."""

    def __init__(self, path: Path, me: dict[str, Any]) -> None:
        self.path = path
        self.me = me
        self._stop = threading.Event()
        self._lost = False
        self._thread = threading.Thread(target=self._beat, name="kr-lease", daemon=True)
        self._thread.start()

    @property
    def lost(self) -> bool:
        """Whether another run took the directory over while this one held it."""
        return self._lost

    def _ours(self) -> bool:
        seen = _read(self.path)
        return seen is not None and seen.holder is not None and \
            seen.holder.get("token") == self.me["token"]

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                if not self._ours():
                    seen = _read(self.path)
                    other = seen.holder if seen is not None and seen.holder else {}
                    log.error("the lease on %s was taken over by another run (%s): two runs now "
                              "write into one checkpoint directory; stop one of them",
                              self.path.parent, describe(other) if other else "unknown")
                    self._lost = True
                    return
                os.utime(self.path)
            except OSError as e:           # a filesystem hiccup: the next beat tries again
                log.debug("lease heartbeat failed: %s", e)

    def release(self) -> None:
        """Give the directory up (only if the lease is still ours)."""
        self._stop.set()
        try:
            if self._ours():
                os.unlink(self.path)
        except OSError:
            pass


def _read(path: Path) -> _Seen | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        raw = os.read(fd, 64 * 1024)
    finally:
        os.close(fd)
    try:
        holder = json.loads(raw)
        holder = holder if isinstance(holder, dict) else None
    except ValueError:
        holder = None
    return _Seen(holder, st.st_mtime, st.st_ino)


def _fs_now(root: Path) -> float:
    """The filesystem's clock, from a probe file's mtime (NFS: the server's)."""
    probe = root / f".lease.probe.{socket.gethostname()}.{os.getpid()}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_WRONLY, 0o644)
        os.close(fd)
        os.utime(probe)
        return probe.stat().st_mtime
    except OSError:
        return time.time()
    finally:
        try:
            probe.unlink()
        except OSError:
            pass


def _create(path: Path, me: dict[str, Any]) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, json.dumps(me).encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def _gone_at_once(holder: dict[str, Any], me: dict[str, Any]) -> str | None:
    """Why a lease's holder is known to be gone without waiting, or None."""
    if holder.get("host") == me["host"] and isinstance(holder.get("pid"), int):
        if holder["pid"] == me["pid"] and holder.get("start") == me["start"]:
            return "held by this process"
        if not pid_alive(holder["pid"], holder.get("start")):
            return f"its holder, pid {holder['pid']} on this host, has exited"
        return None
    job, restarts = holder.get("job_id"), holder.get("restart_count")
    if job and job == me["job_id"] and (restarts or 0) < (me["restart_count"] or 0):
        return f"its holder was attempt {restarts or 0} of this job, which SLURM ended"
    return None


def _take_over(path: Path, seen: _Seen, me: dict[str, Any], why: str) -> bool:
    aside = path.with_name(f"{LEASE_FILE}.stale.{me['token']}")
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False                      # another contender moved it first: look again
    moved = _read(aside)
    if moved is None or moved.ino != seen.ino:
        # Not the lease we judged (a contender replaced it meanwhile): put it back untouched.
        try:
            os.link(aside, path)
        except OSError:
            pass
        os.unlink(aside)
        return False
    os.unlink(aside)
    if _create(path, me):
        log.warning("took over the lease on %s: %s", path.parent, why)
        return True
    return False


def acquire(root: Path, *, job_id: str | None = None, restart_count: int | None = None,
            run_id: str | None = None, stale_s: float = STALE_S) -> Lease:
    """Hold ``root`` for this run, or raise DirectoryInUseError naming the live holder.

    Waits at most about ``stale_s`` (a holder on another host that stopped beating); a live
    holder is refused within a few heartbeats.
    """
    path = Path(root) / LEASE_FILE
    me = _me(job_id, restart_count, run_id)
    watched: tuple[int, float] | None = None     # (inode, mtime) when we started watching
    said = False
    deadline = time.monotonic() + stale_s + 2 * HEARTBEAT_S
    while True:
        if _create(path, me):
            return Lease(path, me)
        seen = _read(path)
        if seen is None:
            continue                                   # released between the two calls
        why = _gone_at_once(seen.holder, me) if seen.holder else None
        age = _fs_now(path.parent) - seen.mtime
        if why is None and age > stale_s:
            why = f"its heartbeat stopped {age:.0f} s ago"
        if why is not None:
            if _take_over(path, seen, me, why):
                return Lease(path, me)
            continue
        if watched is None or watched[0] != seen.ino:
            watched = (seen.ino, seen.mtime)
        elif seen.mtime != watched[1] and seen.holder is not None:
            raise _in_use(root, seen.holder)           # its heartbeat moved: alive
        if seen.holder is not None and seen.holder.get("host") == me["host"]:
            raise _in_use(root, seen.holder)           # this host's process, still running
        if time.monotonic() > deadline:
            raise _in_use(root, seen.holder or {})
        if not said:
            said = True
            log.warning("%s is held by %s; waiting up to %.0f s for its heartbeat", root,
                     describe(seen.holder or {}), stale_s - age)
        time.sleep(_POLL_S)


def _in_use(root: Path, holder: dict[str, Any]) -> DirectoryInUseError:
    return DirectoryInUseError(
        f"checkpoint.dir {root} is in use by another live run ({describe(holder)}, run "
        f"{holder.get('run_id') or '?'}): two runs writing into one directory overwrite each "
        "other's checkpoints. Give this run its own checkpoint.dir, or stop the other run. If "
        f"that run is gone, this run takes the directory over once its lease ({LEASE_FILE}) "
        f"is {STALE_S:.0f} s old")
