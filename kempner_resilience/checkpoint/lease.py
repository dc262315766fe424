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
  the process start time differs), an earlier attempt of this same SLURM job (SLURM ends
  every process of a job before it runs the job again), a pid no process can have (0, -1,
  10**30), or when ``.lease`` is no regular file (a dangling symlink: ours are made ``O_EXCL``);
* otherwise once its mtime has not moved for ``STALE_S``, measured against the filesystem's
  own clock (a probe file's mtime), so the clocks of different hosts are never compared, or
  while we watched it for ``STALE_S`` (a time stamp in the future never looks old). A holder
  on another host whose mtime moves while we watch is alive: refused at once.

A takeover renames the stale file aside (of several contenders only one rename succeeds), checks
that what it moved is the lease it judged, and creates a fresh one with ``O_EXCL``.

**A run that lost its lease.** The holder's heartbeat re-reads the file: when it names another
run (a takeover after this one was frozen, SIGSTOP or a paused VM, longer than ``STALE_S``), the
lease is lost for good: ``lost`` turns True, one error line says so, and ``check`` raises
``LeaseLost`` from then on. The saver calls ``check`` before it creates a step directory, right
before the commit's rename, and before retention deletes anything; the step loop stops at its
next boundary with LEASE_LOST (82), never requeued. A ``.lease`` merely missing (moved away and
back, a contender's rename-aside) is written again (``O_EXCL``: a contender's new lease wins)
while the holder's last heartbeat is too young for anyone to have judged it stale; missing
after a longer silence, it may have been taken over and released meanwhile: lost.

``KEMPNER_RESILIENCE_LEASE_TIMEOUT_S`` sets ``STALE_S`` for a process (tests, a filesystem whose
clients pause longer); the heartbeat is a twelfth of it, at most ``HEARTBEAT_S``.
"""

from __future__ import annotations

import errno
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
from kempner_resilience.core.fileio import (NotARegularFile, file_kind, parse_json,
                                            read_bounded_stat)
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.procs import pid_alive, process_start
from kempner_resilience.core.runpaths import RunPaths

__all__ = ["DirectoryInUseError", "LeaseLost", "Lease", "acquire", "stale_s",
           "heartbeat_s", "TIMEOUT_ENV"]


log = get_logger(__name__)

HEARTBEAT_S = 5.0
# A holder whose heartbeat has not moved for this long is gone. Long enough for a slow
# filesystem or a briefly paused holder, short enough that a job resubmitted after a node
# died waits at most this long at start.
STALE_S = 60.0
TIMEOUT_ENV = "KEMPNER_RESILIENCE_LEASE_TIMEOUT_S"
_POLL_S = 0.5
_MAX_BYTES = 64 * 1024          # a lease is ~300 bytes of JSON
_PID_MAX = 1 << 22              # Linux's PID_MAX_LIMIT: no process has a larger pid


def stale_s() -> float:
    """The lease's timeout: ``$KEMPNER_RESILIENCE_LEASE_TIMEOUT_S`` when set (> 0), else
    ``STALE_S``."""
    return _timeout()


def _timeout() -> float:    # ``acquire``'s parameter ``stale_s`` hides the public name there
    try:
        value = float(os.environ.get(TIMEOUT_ENV, ""))
    except ValueError:
        return STALE_S
    return value if 0 < value < float("inf") else STALE_S


def heartbeat_s() -> float:
    """How often the holder touches its lease: a twelfth of the timeout, at most HEARTBEAT_S."""
    return min(HEARTBEAT_S, _timeout() / 12)


class DirectoryInUseError(CheckpointDirError):
    """Another live run holds ``checkpoint.dir`` (exit 78 CONFIG when uncaught)."""


class LeaseLost(Exception):
    """Another run took ``checkpoint.dir`` over from this one, which must write nothing there
    again (exit 82). No failed save (no CheckpointError: nothing counts or retries it), and no
    RuntimeError, whose text ``is_peer_failure`` reads."""


def _me(job_id: str | None, restart_count: int | None, run_id: str | None) -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "start": process_start(os.getpid()),
            "job_id": job_id, "restart_count": restart_count, "run_id": run_id,
            "token": uuid.uuid4().hex, "since": time.time()}


def describe(holder: dict[str, Any]) -> str:
    job = f", SLURM job {str(holder['job_id'])[:40]}" if holder.get("job_id") else ""
    return f"host {str(holder.get('host', '?'))[:80]}, pid {str(holder.get('pid', '?'))[:40]}{job}"


@dataclass
class _Seen:
    holder: dict[str, Any] | None     # None: unreadable (being written, or garbage)
    mtime: float
    ino: int
    kind: str | None = None           # None: a regular file; else what it is instead


class Lease:
    """A held lease: refreshed by a daemon thread until ``release()``; see the module
    docstring for how it is lost and what a lost lease means."""

    def __init__(self, path: Path, me: dict[str, Any], *,
                 timeout_s: float | None = None) -> None:
        self.path = path
        self.me = me
        self.timeout_s = _timeout() if timeout_s is None else timeout_s
        self.heartbeat_s = min(HEARTBEAT_S, self.timeout_s / 12)
        self._stop = threading.Event()
        self._lock = threading.Lock()      # the heartbeat and check() judge one at a time
        self._lost: str | None = None      # why, once lost (for good)
        # When our heartbeat last moved the file's mtime (created: now). A contender judges us by
        # that mtime, so this, not our last read, says whether one can have judged us stale.
        self._touched = time.monotonic()
        self._rewritten = False
        self._thread = threading.Thread(target=self._beat, name="kr-lease", daemon=True)
        self._thread.start()

    @property
    def lost(self) -> bool:
        """Whether another run took the directory over while this one held it."""
        return self._lost is not None

    @property
    def why_lost(self) -> str | None:
        """The one line that said the lease was lost, or None."""
        return self._lost

    def check(self) -> None:
        """Raise ``LeaseLost`` unless the lease is still ours, judged now from the file (not
        only from the last heartbeat): before a step directory is made, right before a commit's
        rename, before retention deletes."""
        with self._lock:
            if self._lost is None:
                self._confirm(touch=False)
            if self._lost is not None:
                raise LeaseLost(self._lost)

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            with self._lock:
                if self._lost is None:
                    self._confirm(touch=True)
                if self._lost is not None:
                    return

    def _confirm(self, touch: bool) -> None:
        """Is the file still ours? Touch it (the heartbeat), write it again when it is merely
        missing, or mark the lease lost. Under ``_lock``."""
        try:
            seen = _read(self.path)
            now = time.monotonic()
            if seen is not None and seen.holder is not None and \
                    seen.holder.get("token") == self.me["token"]:
                if touch:
                    os.utime(self.path)
                    self._touched = now
                return
            silent = now - self._touched
            if seen is None:
                # Missing: moved away (and back), or a takeover's rename-aside window. No
                # contender can have judged us stale while our last heartbeat is younger than
                # half the timeout: write it again (O_EXCL: a contender's new lease wins).
                if silent < self.timeout_s / 2:
                    if _create(self.path, self.me):
                        if not self._rewritten:
                            self._rewritten = True
                            log.warning("the lease %s was missing; written again (this run "
                                        "still holds %s)", self.path, self.path.parent)
                        self._touched = now
                    return                      # else someone created one: judged next time
                self._lose(f"its lease file is gone and this run was not heard from for "
                           f"{silent:.0f} s (paused?), longer than half the lease's timeout: "
                           "another run may have taken the directory over meanwhile")
                return
            if seen.kind is None and seen.holder is None and silent < self.timeout_s / 2:
                return                          # unreadable for a moment (NFS): next beat
            self._lose(self._taken_over(seen.holder or {}, seen.kind, silent))
        except OSError as e:           # a filesystem hiccup: the next beat tries again
            log.debug("lease heartbeat failed: %s", e)

    def _taken_over(self, other: dict[str, Any], kind: str | None, silent: float) -> str:
        """What the file now says, and how that can be: a takeover of a run not heard from
        for longer than the timeout, or, sooner, a rewrite no takeover rule allows."""
        now = (f"the lease now names {describe(other)}, run "
               f"{str(other.get('run_id') or '?')[:60]}" if other
               else f"the lease file is now {kind or 'unreadable'}")
        if silent >= self.timeout_s:
            return (f"{now}: another run took the directory over after this one was not heard "
                    f"from for {silent:.1f} s (paused, or cut off from the filesystem), longer "
                    f"than the lease's {self.timeout_s:.0f} s timeout")
        return (f"{now}: another run took it over, or the file was rewritten, although this "
                f"run's heartbeat touched it {silent:.1f} s ago, within the lease's "
                f"{self.timeout_s:.0f} s timeout")

    def _lose(self, why: str) -> None:
        self._lost = (f"this run lost its lease on {self.path.parent}: {why}; it stops at the "
                      "next step boundary without saving, committing or deleting anything there")
        log.error("%s", self._lost)

    def release(self) -> None:
        """Give the directory up (only if the lease is still ours)."""
        self._stop.set()
        with self._lock:
            try:
                seen = _read(self.path)
                if self._lost is None and seen is not None and seen.holder is not None and \
                        seen.holder.get("token") == self.me["token"]:
                    os.unlink(self.path)
            except OSError:
                pass


def _read(path: Path) -> _Seen | None:
    """The lease at ``path``, never following a link nor blocking on a FIFO (``kind`` says
    what it is when it is no regular file); None when there is none."""
    try:
        raw, st = read_bounded_stat(path, _MAX_BYTES, follow_symlinks=False)
    except FileNotFoundError:
        return None
    except NotARegularFile:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return None
        return _Seen(None, st.st_mtime, st.st_ino, file_kind(st.st_mode))
    except OSError as e:
        if e.errno != errno.EFBIG:
            raise
        st = os.lstat(path)
        return _Seen(None, st.st_mtime, st.st_ino)      # garbage: judged like any other
    try:
        holder = parse_json(raw)
        holder = holder if isinstance(holder, dict) else None
    except ValueError:
        holder = None
    return _Seen(holder, st.st_mtime, st.st_ino)


def _fs_now(paths: RunPaths) -> float:
    """The filesystem's clock, from a probe file's mtime (NFS: the server's)."""
    probe = paths.lease_probe(socket.gethostname(), os.getpid())
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


def _valid_pid(pid: Any) -> bool:
    return isinstance(pid, int) and not isinstance(pid, bool) and 0 < pid <= _PID_MAX


def _gone_at_once(holder: dict[str, Any], me: dict[str, Any]) -> str | None:
    """Why a lease's holder is known to be gone without waiting, or None."""
    pid = holder.get("pid")
    if not _valid_pid(pid):
        # We write our own pid; 0, -1 or 10**30 is no process (and kill(0) or kill(-1) would
        # ask about a whole process group, 10**30 overflow): nobody holds this lease.
        return f"it names pid {str(pid)[:40]}, which no process can have"
    if holder.get("host") == me["host"]:
        start = holder.get("start")
        start = start if isinstance(start, str) else None
        if pid == me["pid"] and start == me["start"]:
            return "held by this process"
        if not pid_alive(pid, start):
            return f"its holder, pid {pid} on this host, has exited"
        return None
    job, restarts = holder.get("job_id"), holder.get("restart_count")
    restarts = restarts if isinstance(restarts, int) else 0
    if job and job == me["job_id"] and restarts < (me["restart_count"] or 0):
        return f"its holder was attempt {restarts} of this job, which SLURM ended"
    return None


def _take_over(paths: RunPaths, seen: _Seen, me: dict[str, Any], why: str) -> bool:
    path, aside = paths.lease, paths.lease_aside(me["token"])
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


def acquire(paths: RunPaths, *, job_id: str | None = None, restart_count: int | None = None,
            run_id: str | None = None, stale_s: float | None = None) -> Lease:
    """Hold the run's directory for this run, or raise DirectoryInUseError naming the live holder.

    Waits at most about ``stale_s`` (default: the module's ``stale_s()``) for a holder on
    another host that stopped beating; a live holder is refused within a few heartbeats.
    """
    timeout = _timeout() if stale_s is None else stale_s
    path = paths.lease
    me = _me(job_id, restart_count, run_id)
    watched: tuple[int, float, float] | None = None   # (inode, mtime, monotonic) first seen
    said = False
    deadline = time.monotonic() + timeout + 2 * min(HEARTBEAT_S, timeout / 12) + 1.0
    while True:
        if _create(path, me):
            return Lease(path, me, timeout_s=timeout)
        seen = _read(path)
        if seen is None:
            continue                                   # released between the two calls
        if seen.kind == "a directory":
            raise DirectoryInUseError(
                f"{path} is a directory, not a lease: no run can hold {paths} while it is "
                "there. Remove it (nothing of ours creates it)")
        why = None
        if seen.kind is not None:
            why = f"{path} is {seen.kind}, not a lease (a run only ever creates a regular file)"
        elif seen.holder:
            why = _gone_at_once(seen.holder, me)
        age = _fs_now(paths) - seen.mtime
        if why is None and age > timeout:
            why = f"its heartbeat stopped {age:.0f} s ago"
        now = time.monotonic()
        if why is None:
            if watched is None or watched[0] != seen.ino:
                watched = (seen.ino, seen.mtime, now)
            elif seen.mtime != watched[1] and seen.holder is not None:
                raise _in_use(paths, seen.holder, timeout)   # its heartbeat moved: alive
            elif now - watched[2] > timeout:
                # Watched for the whole timeout and it never moved: stale, whatever its time
                # stamp says (one in the future never looks old by age).
                why = (f"its heartbeat did not move in the {now - watched[2]:.0f} s this run "
                       "watched it" + (f" (its time stamp lies {-age:.0f} s in the future)"
                                       if age < 0 else ""))
        if why is not None:
            if _take_over(paths, seen, me, why):
                return Lease(path, me, timeout_s=timeout)
            time.sleep(0.01)                           # a contender moved it: look again
            continue
        if seen.holder is not None and seen.holder.get("host") == me["host"]:
            raise _in_use(paths, seen.holder, timeout)   # this host's process, still running
        if now > deadline:
            raise _in_use(paths, seen.holder or {}, timeout)
        if not said:
            said = True
            log.warning("%s is held by %s; waiting up to %.0f s for its heartbeat", paths,
                        describe(seen.holder or {}), timeout)
        time.sleep(_POLL_S)


def _in_use(paths: RunPaths, holder: dict[str, Any], timeout: float) -> DirectoryInUseError:
    return DirectoryInUseError(
        f"checkpoint.dir {paths} is in use by another live run ({describe(holder)}, run "
        f"{str(holder.get('run_id') or '?')[:60]}): two runs writing into one directory "
        "overwrite each other's checkpoints. Give this run its own checkpoint.dir, or stop the "
        f"other run. If that run is gone, this run takes the directory over once its lease "
        f"({paths.lease.name}) is {timeout:.0f} s old")
