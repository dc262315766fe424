"""The run ledger: one JSON line per event of a run, across all its attempts (requeues).

``ledger.jsonl`` lives next to the checkpoints (``checkpoint.dir``). Rank 0 writes it; another
rank appends only the one event it alone may know: a rescue it committed (rank 0 may be dead).
It is what ``kempner-resilience report`` turns into a timeline and a goodput figure.

Crash safety: every event is one ``write()`` of one complete line on a descriptor opened with
``O_APPEND``, so concurrent or later appends never interleave inside a line. A process killed in
the middle of a write can leave at most a torn last line; readers skip lines that do not parse,
and the next attempt starts its first event on a fresh line. Nothing here ever raises into the
training loop: a ledger that cannot be written (a full disk) is logged once, and later events
try again; a ledger that is not a regular file (a FIFO, a device, a directory) is never waited
on (opened with ``O_NONBLOCK``): it is logged once and the ledger is off for this process.
Readers check every line against the fields below (``valid_event``): a line that does not parse,
or whose known fields have the wrong type or an impossible value (NaN, a time past year 5000,
a string count), is skipped, with one warning per read.

Size: an event is 100-350 bytes (a periodic save ~200 B, an attempt start with a short host list
~300 B). The file is kept under ``MAX_BYTES`` (4 MiB, some 20 000 events): past it, the
periodic saves are folded into one ``saves`` summary per attempt (which keeps every number
``report`` needs), and if that is not enough the oldest attempts are dropped.

Events (``ev``), each with ``t`` (wall clock, epoch seconds), ``attempt`` and ``run_id``:

* ``start``: ``t0`` (when the attempt began: the job's start or this process's start),
  ``job_id``, ``array``, ``restart_count``, ``hosts``, ``world_size``.
* ``resume``: ``step``, ``load_s``. ``loop``: the first step boundary, ``step``.
* ``save``: a periodic or manual save: ``step``, ``reason``, ``blocking_s``, ``bytes``,
  ``bw_mib_s``. ``saves``: a compacted summary: ``n``, ``blocking_s``, ``bytes``, ``last_step``.
* ``stop``: ``signal`` (a name, or ``time-limit``), ``signal_t``, ``step`` (agreed).
* ``emergency_save``: ``step``, ``seconds``, ``saved`` (committed / failed / nothing).
* ``save_failed``: a periodic save that failed (training went on): ``step``, ``reason`` (the
  error, shortened), ``failed`` (periodic saves failed in a row).
* ``rescue``: after a lost peer or a hang; a committed one recorded by the rank that wrote it
  (rank 0 may be the rank that died), one that committed nothing by rank 0: ``step``,
  ``committed``, ``writer`` (the rank that wrote it), ``why`` (nothing committed), ``reason``,
  ``seconds``, ``rank`` (the rank that recorded it).
* ``exclude``: a requeue of a run with recorded bad nodes (``slurm/badnodes.py``):
  ``bad_nodes`` (the nodes asked to be excluded, comma-separated), ``excluded`` (those the
  requeued job is now kept off; empty when the update failed), ``why`` (the failure).
* ``restart``: an in-job restart (the batch job's glue started the training again inside the
  same allocation after a failure; written by the glue, before the new attempt's ``start``).
  The attempt it starts is an attempt of its own: its events carry ``relaunch`` (the in-job
  restart count, 1, 2, ...; absent for 0) next to ``attempt`` (SLURM's restart count), and its
  ``start.t0`` is the relaunch (when the supervisor launched it, as its channel says:
  ``supervise/channel.relaunched``; else its processes' start), not the job's start. The
  glue writes it with ``slurm.restart_event.record_restart`` (the srun loop,
  ``supervise/srun/relaunch.py``; under torchrun the new group's rank-0 agent,
  ``supervise/torchrun/spares.py``). Fields:
  ``relaunch``; ``reason`` (what failed, e.g. "rank 3 on krnode2 died"); ``bad_nodes`` (the
  nodes kept out from now on, comma-separated or a list); ``spare`` (the spare node taken
  in, absent: none); ``step`` (the committed step the new attempt resumes from);
  ``failure_t`` (when the failure happened, as best known); and the recovery's first three
  parts, each in seconds:
  ``detect_s`` (the failure → the glue knows which node failed), ``rescue_s`` (the survivors'
  rescue, or the wait for the periodic save's commit), ``relaunch_s`` (the old step ended and
  the new one launched). The new attempt's own ``start``/``resume``/``loop`` events give the
  last two: start-up and load (``goodput.Attempt.recovery``).
* ``requeue``: ``verdict`` (``exitcodes.Verdict``), ``code``, ``seconds``. ``exit``: ``code``,
  ``ending`` (``exitcodes.Ending``), ``step`` (the last step reached; absent when the hang
  backstop's monitor process wrote it, for a hang that held the GIL), ``by`` (``backstop``
  then), ``loop_end_t``; after a signal where the shutdown's steps took their time
  (``shutdown/timing.py``): ``signal_t``, ``agree_s``, ``save_s``, ``requeue_s``, ``teardown_s``,
  ``shutdown_s`` (signal → this event), and ``leave`` (``exit`` or ``raise``: how the process
  leaves after it).
"""

from __future__ import annotations

import json
import math
import os
import stat
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

from kempner_resilience.core.fileio import read_bounded, write_atomic
from kempner_resilience.core.log import get_logger

__all__ = ["Ledger", "MAX_BYTES", "read_ledger", "valid_event",
           "process_start_time", "attempt_start", "AGENT_START_ENV", "REPORT_ENV"]

log = get_logger(__name__)

MAX_BYTES = 4 * 2**20
# What a reader accepts. Far above MAX_BYTES: a writer with ``only`` never compacts, and one
# killed mid-event leaves what it wrote (CI saw 75 MB of 4 MiB events before a SIGKILL); a
# FIFO or /dev/zero is refused by read_bounded whatever the size.
_READ_MAX = 1 << 30
#: Set by the ``kempner-resilience torchrun`` agent in its workers' environment: its own start
#: time (epoch seconds). The agent's start-up and rendezvous are the attempt's, not queue time.
AGENT_START_ENV = "KEMPNER_RESILIENCE_AGENT_START"
#: Where rank 0 writes the run report (JSON: how the attempt ended) for its launcher; set by the
#: user or by the ``kempner-resilience torchrun`` agent, which reads it back for its last line.
REPORT_ENV = "KEMPNER_RESILIENCE_REPORT"


def process_start_time() -> float:
    """When this process started (epoch seconds), from /proc; now when that cannot be read."""
    try:
        with open("/proc/self/stat") as f:
            # The command name (field 2) may hold spaces: split after its closing parenthesis.
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        # Against the boot clock, not /proc/stat's btime: that is whole seconds.
        age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
        return time.time() - max(age, 0.0)
    except (OSError, ValueError, IndexError, AttributeError):
        return time.time()


def attempt_start(environ: Mapping[str, str] | None = None, relaunch: int = 0,
                  relaunch_t: float | None = None) -> float:
    """When this attempt began (the ledger's ``start.t0``): the job's start under SLURM (the
    prolog and srun count as start-up); else the start of the torchrun agent that started this
    worker's first group (its imports and rendezvous are start-up too; a group torch elastic
    restarts begins with its own processes); else this process's start. ``relaunch`` > 0: an
    in-job relaunch (``supervise/channel.relaunched``), which began at ``relaunch_t`` (else at
    its processes' start), not at the job's start. A value in the future or not a number is
    ignored."""
    env = os.environ if environ is None else environ
    now = time.time()
    # An in-job relaunch began when the glue launched it (else: its processes' start), long
    # after the job's start, which SLURM keeps for every step.
    candidates = [repr(relaunch_t) if relaunch_t is not None else ""] if relaunch > 0 else \
        [env.get("SLURM_JOB_START_TIME", "")]
    if env.get("TORCHELASTIC_RESTART_COUNT", "0") in ("", "0"):
        candidates.append(env.get(AGENT_START_ENV, ""))
    own = process_start_time()
    for raw in candidates:
        try:
            start = float(raw)
        except ValueError:
            continue
        if 0 < start <= now:
            return min(start, own)
    return own


# What each known field may hold (None is always allowed: unknown). A field outside this table
# is kept as it is: nothing reads it.
_MAX_TIME = 1e11            # epoch seconds: the year 5138
_MAX_DURATION = 1e9         # seconds: 31 years
_MAX_COUNT = 2 ** 62


def _time(x: Any) -> bool:
    return _number(x) and 0.0 <= x < _MAX_TIME


def _duration(x: Any) -> bool:
    return _number(x) and 0.0 <= x <= _MAX_DURATION


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= _MAX_COUNT


def _code(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and -2 ** 31 <= x < 2 ** 31


def _text(x: Any) -> bool:
    return isinstance(x, str)


_FIELDS: dict[str, Callable[[Any], bool]] = {
    "t": _time, "t0": _time, "signal_t": _time, "loop_end_t": _time,
    "blocking_s": _duration, "load_s": _duration, "seconds": _duration,
    "agree_s": _duration, "save_s": _duration, "requeue_s": _duration, "teardown_s": _duration,
    "shutdown_s": _duration, "leave": _text,
    "detect_s": _duration, "rescue_s": _duration, "relaunch_s": _duration,
    "failure_t": _time, "relaunch": _count, "spare": _text,
    "bad_nodes": lambda x: _text(x) or (isinstance(x, list) and all(map(_text, x))),
    "excluded": _text,
    "bw_mib_s": lambda x: _number(x) and x >= 0,
    "attempt": _count, "step": _count, "last_step": _count, "n": _count, "bytes": _count,
    "restart_count": _count, "world_size": _count, "writer": _count, "rank": _count,
    "failed": _count, "code": _code,
    "run_id": _text, "job_id": lambda x: _text(x) or _code(x), "hosts": _text,
    "reason": _text, "signal": _text, "why": _text, "saved": _text, "ending": _text,
    "committed": lambda x: isinstance(x, bool),
}


def valid_event(ev: Any) -> str | None:
    """None when ``ev`` is an event every reader can use, else what is wrong with it."""
    if not isinstance(ev, dict):
        return "not a JSON object"
    if not isinstance(ev.get("ev"), str):
        return "no event name (ev)"
    for k, check in _FIELDS.items():
        v = ev.get(k)
        if v is not None and not check(v):
            return f"{k}={json.dumps(v, default=str)[:40]}"
    return None


def read_ledger(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every usable event, in file order; torn, foreign or malformed lines are skipped (one
    warning per read names how many and the first). A missing file has no events; a file that
    is not a regular one (a FIFO would block) or cannot be read raises OSError."""
    try:
        data = _read_regular(Path(path))
    except FileNotFoundError:
        return []
    out, skipped, first = [], 0, ""
    for no, line in enumerate(data.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            ev = json.loads(line)
            why = valid_event(ev)
        except (ValueError, RecursionError) as e:
            why = f"not JSON ({type(e).__name__})"
        if why is None:
            out.append(ev)
            continue
        skipped += 1
        first = first or f"line {no}: {why}"
    if skipped:
        log.warning("run ledger %s: skipped %d malformed line(s) (first: %s)", path, skipped,
                    first)
    return out


def _read_regular(path: Path) -> bytes:
    # Bounded (core/fileio.read_bounded): a FIFO must not block, /dev/zero not read without end.
    return read_bounded(path, _READ_MAX)


class Ledger:
    """An appender (rank 0's); with ``path`` None every call does nothing. ``only``: the events
    this process writes (another rank's ledger records only its own rescue), all when None; a
    ledger with ``only`` never compacts (rank 0 may be appending)."""

    def __init__(self, path: str | os.PathLike[str] | None, *, run_id: str | None = None,
                 attempt: int = 0, max_bytes: int = MAX_BYTES,
                 only: Iterable[str] | None = None, relaunch: int = 0) -> None:
        self.path = None if path is None else Path(path)
        self.run_id = run_id
        self.attempt = attempt
        self.relaunch = relaunch        # in-job restarts: every event carries it when not 0
        self.max_bytes = max_bytes
        self.only = None if only is None else frozenset(only)
        self._fd: int | None = None
        self._size = 0
        self._warned = False
        self._torn = False
        self.last_event: dict[str, Any] | None = None

    @property
    def active(self) -> bool:
        return self.path is not None

    def event(self, ev: str, **fields: Any) -> None:
        """Append one event (one write of one line). Never raises, never blocks on the file."""
        if not self.active or (self.only is not None and ev not in self.only):
            return
        rec = {"ev": ev, "t": round(time.time(), 3), "attempt": self.attempt,
               "run_id": self.run_id, **({"relaunch": self.relaunch} if self.relaunch else {}),
               **fields}
        self.last_event = rec
        try:
            line = (json.dumps(rec, separators=(",", ":"), default=str) + "\n").encode()
            if self._fd is None:
                self._open()
            if self._fd is None:            # turned off: not a regular file
                return
            if self._size + len(line) > self.max_bytes and self.only is None:
                self._compact()
            assert self._fd is not None
            if self._torn:          # the last write was cut short: start on a fresh line
                line = b"\n" + line
            written = os.write(self._fd, line)
            self._torn = written < len(line)
            self._size += written
        except Exception as e:  # noqa: BLE001 - nothing in the ledger may stop training
            # Said once; later events try again (a disk that was full may have room again).
            if not self._warned:
                self._warned = True
                log.warning("run ledger %s cannot be written (%s); the run goes on, and so "
                            "does the ledger once it can", self.path, e)

    def disown(self) -> None:
        """Another run holds the directory now (a lost lease): its ledger is not ours to write
        any more, so every later event does nothing."""
        self.path = None
        self.close()

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None

    def _open(self) -> None:
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            # O_NONBLOCK: a FIFO in the ledger's place would block the open until a reader
            # came (ENXIO instead); on a regular file it changes nothing.
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK,
                         0o644)
        except OSError as e:
            if e.errno is not None and os.path.exists(self.path) and \
                    not stat.S_ISREG(os.stat(self.path).st_mode):
                self._off()
                return
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            self._off()
            return
        self._fd = fd
        self._size = os.fstat(fd).st_size
        if self._size:
            # A torn last line (a process killed mid-write) must not swallow our first event.
            rfd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
            try:
                last = os.pread(rfd, 1, self._size - 1)
            finally:
                os.close(rfd)
            if last != b"\n":
                self._size += os.write(self._fd, b"\n")

    def _off(self) -> None:
        log.warning("run ledger %s is not a regular file; no ledger for this run (remove it to "
                    "have one)", self.path)
        self.path = None

    def _compact(self) -> None:
        """Rewrite the file (atomically) within half of ``max_bytes``: periodic saves are folded
        into one summary per attempt, then the oldest attempts (never this one) dropped.
        Malformed lines are left out (``read_ledger`` skips them)."""
        assert self.path is not None
        events = list(_fold_saves(read_ledger(self.path)))
        lines = [json.dumps(e, separators=(",", ":"), default=str) + "\n" for e in events]
        budget = self.max_bytes // 2
        while events and sum(map(len, lines)) > budget:
            oldest = _key(events[0])
            if oldest == (self.attempt, self.relaunch):
                break                  # a handful of events: nothing more to fold or drop
            keep = [i for i, e in enumerate(events) if _key(e) != oldest]
            events, lines = [events[i] for i in keep], [lines[i] for i in keep]
        write_atomic(self.path, "".join(lines))
        self.close()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK,
                           0o644)
        self._size = os.fstat(self._fd).st_size
        log.info("run ledger %s compacted to %d bytes", self.path, self._size)


def _fold_saves(events: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Each attempt's ``save`` events become one ``saves`` event where its first save was
    (``events`` as ``read_ledger`` returns them: every known field of the right type)."""
    summary: dict[Any, dict[str, Any]] = {}
    for e in events:
        a = e.get("attempt")
        if e.get("ev") != "save":
            yield e
            continue
        s = summary.get((e.get("run_id"), _key(e)))
        if s is None:
            s = summary[(e.get("run_id"), _key(e))] = {
                "ev": "saves", "t": e.get("t"), "attempt": a, "run_id": e.get("run_id"),
                **({"relaunch": e["relaunch"]} if e.get("relaunch") else {}),
                "n": 0, "blocking_s": 0.0, "bytes": 0, "last_step": None}
            yield s      # filled in as the loop goes on
        s["n"] += 1
        s["blocking_s"] = round(min(s["blocking_s"] + (e.get("blocking_s") or 0.0),
                                    _MAX_DURATION), 4)
        s["bytes"] = min(s["bytes"] + (e.get("bytes") or 0), _MAX_COUNT)
        s["last_step"] = e.get("step")


def _key(e: dict[str, Any]) -> tuple[Any, int]:
    """The attempt an event belongs to: SLURM's restart count and the in-job restart count."""
    return e.get("attempt"), e.get("relaunch") or 0
