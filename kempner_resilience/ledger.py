"""The run ledger: one JSON line per event of a run, across all its attempts (requeues).

``ledger.jsonl`` lives next to the checkpoints (``checkpoint.dir``) and only rank 0 writes it.
It is what ``kempner-resilience report`` turns into a timeline and a goodput figure.

Crash safety: every event is one ``write()`` of one complete line on a descriptor opened with
``O_APPEND``, so concurrent or later appends never interleave inside a line. A process killed in
the middle of a write can leave at most a torn last line; readers skip lines that do not parse,
and the next attempt starts its first event on a fresh line. Nothing here ever raises into the
training loop: a ledger that cannot be written (a full disk) is logged once, and later events
try again.

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
* ``rescue``: after a lost peer or a hang (rank 0, when it survived): ``step``, ``committed``,
  ``writer`` (the rank that wrote it), ``why`` (nothing committed), ``reason``, ``seconds``.
* ``requeue``: ``code``. ``exit``: ``code``, ``ending``, ``step`` (the last step reached).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Iterator

from kempner_resilience.log import get_logger

__all__ = ["Ledger", "LEDGER_NAME", "MAX_BYTES", "read_ledger", "process_start_time"]

log = get_logger(__name__)

LEDGER_NAME = "ledger.jsonl"
MAX_BYTES = 4 * 2**20


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


def read_ledger(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every event that parses, in file order; torn or foreign lines are skipped."""
    out = []
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return []
    for line in data.split(b"\n"):
        if not line.strip():
            continue
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if isinstance(ev, dict) and isinstance(ev.get("ev"), str):
            out.append(ev)
    return out


class Ledger:
    """Rank 0's appender; on other ranks (or with ``path`` None) every call does nothing."""

    def __init__(self, path: str | os.PathLike[str] | None, *, run_id: str | None = None,
                 attempt: int = 0, max_bytes: int = MAX_BYTES) -> None:
        self.path = None if path is None else Path(path)
        self.run_id = run_id
        self.attempt = attempt
        self.max_bytes = max_bytes
        self._fd: int | None = None
        self._size = 0
        self._warned = False
        self._torn = False
        self.last_event: dict[str, Any] | None = None

    @property
    def active(self) -> bool:
        return self.path is not None

    def event(self, ev: str, **fields: Any) -> None:
        """Append one event (one write of one line). Never raises."""
        if not self.active:
            return
        rec = {"ev": ev, "t": round(time.time(), 3), "attempt": self.attempt,
               "run_id": self.run_id, **fields}
        self.last_event = rec
        try:
            line = (json.dumps(rec, separators=(",", ":"), default=str) + "\n").encode()
            if self._fd is None:
                self._open()
            if self._size + len(line) > self.max_bytes:
                self._compact()
            assert self._fd is not None
            if self._torn:          # the last write was cut short: start on a fresh line
                line = b"\n" + line
            written = os.write(self._fd, line)
            self._torn = written < len(line)
            self._size += written
        except OSError as e:
            # Said once; later events try again (a disk that was full may have room again).
            if not self._warned:
                self._warned = True
                log.warning("run ledger %s cannot be written (%s); the run goes on, and so "
                            "does the ledger once it can", self.path, e)

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
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._size = os.fstat(self._fd).st_size
        if self._size:
            # A torn last line (a process killed mid-write) must not swallow our first event.
            with open(self.path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                if f.read(1) != b"\n":
                    self._size += os.write(self._fd, b"\n")

    def _compact(self) -> None:
        """Rewrite the file (atomically) within half of ``max_bytes``: periodic saves are folded
        into one summary per attempt, then the oldest attempts (never this one) dropped."""
        assert self.path is not None
        events = list(_fold_saves(read_ledger(self.path)))
        lines = [json.dumps(e, separators=(",", ":"), default=str) + "\n" for e in events]
        budget = self.max_bytes // 2
        while sum(map(len, lines)) > budget:
            oldest = events[0].get("attempt")
            if oldest == self.attempt:
                break                  # a handful of events: nothing more to fold or drop
            keep = [i for i, e in enumerate(events) if e.get("attempt") != oldest]
            events, lines = [events[i] for i in keep], [lines[i] for i in keep]
        tmp = self.path.with_name(f".{self.path.name}.tmp{os.getpid()}")
        with open(tmp, "w") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self.close()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._size = os.fstat(self._fd).st_size
        log.info("run ledger %s compacted to %d bytes", self.path, self._size)


def _fold_saves(events: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Each attempt's ``save`` events become one ``saves`` event where its first save was."""
    summary: dict[Any, dict[str, Any]] = {}
    for e in events:
        a = e.get("attempt")
        if e.get("ev") != "save":
            yield e
            continue
        s = summary.get(a)
        if s is None:
            s = summary[a] = {"ev": "saves", "t": e.get("t"), "attempt": a,
                              "run_id": e.get("run_id"), "n": 0, "blocking_s": 0.0,
                              "bytes": 0, "last_step": None}
            yield s      # filled in as the loop goes on
        s["n"] += 1
        s["blocking_s"] = round(s["blocking_s"] + float(e.get("blocking_s") or 0.0), 4)
        s["bytes"] += int(e.get("bytes") or 0)
        s["last_step"] = e.get("step")
