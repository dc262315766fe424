"""What ``run.json`` says, read without trusting the file; when it is damaged, what the
directory says in its place.

``run.json`` is bookkeeping next to the step directories, and every step directory records the
run it belongs to (manifest, ownership marker). So a damaged ``run.json`` (cut short, random
bytes, a symbolic link, a FIFO, a device, a file too large to be ours) loses nothing the
directory does not hold again. The current lineage is the one whose run id the most recent
step directory records: by its commit time, else its marker's creation time (a fresh lineage
starts again at low steps, so step numbers say nothing). Every other run id recorded there is a
lineage left behind (``earlier_runs``). The same directory gives the same answer to every
attempt, so a requeued job keeps one run id.

Two cases are refused rather than guessed (``RunFileError``, exit 78), and nothing is written:

* ``run.json`` is a directory or cannot be read (permissions, an I/O error). A rename cannot
  put a file in place of a directory, and an unreadable file may be sound. The message gives
  the content to put there.
* The ledger's last attempt ran as another run than the one the newest step directory records.
  A fresh start (``checkpoint.resume: false``) that ended before its first save looks like
  that, and so does another run's checkpoint copied in. Continuing the newest step directory's
  run could resume a training its user left behind. An explicit run id settles it.

This module reads only. ``identity`` writes what a start decides, once the run holds the
directory's lease.
"""

from __future__ import annotations

import json
import os
import stat
import time
from dataclasses import dataclass, field
from typing import Any, Iterable

from kempner_resilience.checkpoint.info import CheckpointDirError
from kempner_resilience.core.fileio import TooLarge, file_kind, parse_json, read_bounded
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.runpaths import RunPaths

__all__ = ["RunFileError", "Recorded", "read", "recorded", "recorded_run_id", "earlier_of"]

log = get_logger(__name__)


class RunFileError(CheckpointDirError):
    """``run.json`` is damaged and a start cannot tell which run it was (exit 78 CONFIG when
    uncaught): the message names the file and the fix."""


@dataclass(frozen=True)
class Recorded:
    """The directory's identity: ``run.json``'s when sound, else the one its step directories
    give (``damage`` says what is wrong with the file)."""

    run_id: str | None                  # the current lineage; None: nothing recorded yet
    earlier: frozenset[str | None] = frozenset()   # lineages left behind
    data: dict[str, Any] = field(default_factory=dict)  # run.json's content, when sound
    damage: str | None = None           # what is wrong with run.json; None: sound or absent
    source: str | None = None           # the step directory a recovered id comes from
    doubt: str | None = None            # why resume cannot tell the current lineage

    @property
    def exists(self) -> bool:
        """Whether a sound ``run.json`` or a damaged one is there (not absent)."""
        return bool(self.data) or self.damage is not None

    def repaired(self, run_id: str) -> dict[str, Any]:
        """The ``run.json`` to put in place of the damaged one, naming ``run_id``."""
        now = time.time()
        data: dict[str, Any] = {"run_id": run_id, "created_at": now, "repaired_at": now}
        left = self.earlier - {run_id}
        if left:
            data["earlier_runs"] = sorted(left, key=lambda r: "" if r is None else r)
        return data


def read(paths: RunPaths) -> tuple[dict[str, Any] | None, str | None, bool]:
    """``(content, None, _)`` for a sound ``run.json``; ``(None, None, _)`` when there is none;
    ``(None, what is wrong, fixable)`` otherwise, ``fixable`` when a rename over it repairs it.
    Never blocks (the type is checked before the open, which is ``O_NONBLOCK``) and reads at
    most ``SMALL_FILE_MAX`` bytes; a symbolic link is never followed (we never create one)."""
    try:
        mode = os.lstat(paths.run_file).st_mode
    except FileNotFoundError:
        return None, None, True
    except OSError as e:
        return None, f"cannot be looked at ({e.strerror})", False
    if stat.S_ISDIR(mode):
        return None, "a directory", False
    if stat.S_ISLNK(mode):
        try:
            to = os.readlink(paths.run_file)
        except OSError:
            to = "?"
        return None, f"a symbolic link to {to}, not a file of ours", True
    if not stat.S_ISREG(mode):
        return None, f"{file_kind(mode)}, not a regular file", True
    try:
        raw = read_bounded(paths.run_file, follow_symlinks=False)
    except FileNotFoundError:          # removed between the two looks: as if never there
        return None, None, True
    except TooLarge as e:
        return None, f"too large ({e.strerror})", True
    except OSError as e:
        return None, f"cannot be read ({e.strerror})", False
    try:
        data = parse_json(raw)
    except ValueError as e:
        return None, f"not JSON: {str(e)[:80]}", True
    rid = data.get("run_id") if isinstance(data, dict) else None
    if not isinstance(rid, str) or not rid.strip() or len(rid) > 256:
        return None, f"no usable run_id in it ({json.dumps(rid, default=str)[:60]})", True
    return data, None, True


def recorded(paths: RunPaths, entries: Iterable[Any]) -> Recorded:
    """The directory's identity (see the module docstring); ``entries``: ``layout.scan``'s.
    Raises ``RunFileError`` when ``run.json`` is damaged and cannot be repaired in place."""
    data, damage, fixable = read(paths)
    if data is not None:
        return Recorded(data["run_id"], earlier_of(data), data)
    entries = list(entries)
    if damage is None:                                   # no run.json: nothing to recover
        return Recorded(None)
    rid, source, earlier = _from_step_dirs(entries)
    found = Recorded(rid, earlier, damage=damage, source=source)
    if not fixable:
        raise RunFileError(_unfixable(paths, found))
    if rid is not None:
        found = Recorded(rid, earlier, damage=damage, source=source,
                         doubt=_doubt(paths, found))
    return found


def recorded_run_id(entry: Any) -> Any:
    """The run id a checkpoint records: its manifest's, else its ownership marker's."""
    rid = (entry.manifest or {}).get("run_id")
    if rid is None:
        rid = (_marker(entry) or {}).get("run_id")
    return rid


def _marker(entry: Any) -> dict[str, Any] | None:
    from kempner_resilience.checkpoint import layout

    try:
        return layout.read_marker(entry.path)
    except Exception:  # noqa: BLE001 - a damaged marker is just no evidence
        return None


def earlier_of(data: dict[str, Any]) -> frozenset[str | None]:
    raw = data.get("earlier_runs")
    if not isinstance(raw, list):
        return frozenset()
    return frozenset(r for r in raw if r is None or (isinstance(r, str) and len(r) <= 256))


def _when(entry: Any) -> float | None:
    """When a step directory was committed, else created (its marker); None when unknown."""
    t = (entry.manifest or {}).get("committed_at")
    if not isinstance(t, (int, float)) or isinstance(t, bool):
        t = (_marker(entry) or {}).get("created_at")
    return float(t) if isinstance(t, (int, float)) and not isinstance(t, bool) else None


def _from_step_dirs(entries: list[Any]) -> tuple[str | None, str | None,
                                                  frozenset[str | None]]:
    """``(current run id, its newest step directory's name, earlier lineages)`` as the step
    directories record them. Committed checkpoints recording no run id (written before run
    ids existed) are left behind when a lineage with an id is current: kept, never resumed."""
    dated: list[tuple[float, tuple[int, int], str, str]] = []
    ids: set[str | None] = set()
    for e in entries:
        rid = recorded_run_id(e)
        if rid is None:
            if e.committed:
                ids.add(None)
            continue
        if not isinstance(rid, str) or not rid or len(rid) > 256:
            continue
        ids.add(rid)
        t = _when(e)
        if t is not None:
            dated.append((t, (e.step, e.attempt), rid, e.path.name))
    if not dated:
        return None, None, frozenset()
    _, _, current, name = max(dated)
    return current, name, frozenset(ids - {current})


def _doubt(paths: RunPaths, found: Recorded) -> str | None:
    """Why the newest step directory's run may not be the current lineage: the ledger's last
    attempt ran as another run (None when it agrees, or there is no ledger to ask)."""
    from kempner_resilience.core.ledger import read_ledger

    try:
        starts = [e for e in read_ledger(paths.ledger)
                  if e.get("ev") == "start" and isinstance(e.get("run_id"), str)]
    except OSError as e:
        log.debug("cannot read the ledger %s to check the recovered run id: %s", paths.ledger, e)
        return None
    if not starts or starts[-1]["run_id"] == found.run_id:
        return None
    last = starts[-1]["run_id"]
    return (f"{paths.run_file} is damaged ({found.damage}), and the directory does not say which "
            f"training is current: its newest checkpoint {found.source} is run {found.run_id}'s, "
            f"but the last attempt in {paths.ledger} ran as run {last} (a fresh start, "
            "checkpoint.resume: false, that ended before its first save looks like this, and so "
            f"does another run's checkpoint copied in). Refusing to guess: to continue run "
            f"{found.run_id}, {_put(paths, found)} or give the run id explicitly "
            "(KEMPNER_RESILIENCE_RUN_ID or ResilientRun(run_id=...)); to start anew, set "
            "checkpoint.resume: false (every checkpoint is kept)")


def _unfixable(paths: RunPaths, found: Recorded) -> str:
    what = (f"{paths.run_file} is {found.damage}: it cannot be repaired in place, and starting "
            "without it could resume a training left behind. ")
    perms = "" if found.damage == "a directory" else "fix its permissions, or "
    if found.run_id is None:
        return what + f"No checkpoint records a run id: {perms}move it away, then restart"
    return what + (f"Its newest checkpoint {found.source} records run {found.run_id}: {perms}"
                   f"move it away and {_put(paths, found)}, then restart")


def _put(paths: RunPaths, found: Recorded) -> str:
    data: dict[str, Any] = {"run_id": found.run_id}
    left = sorted(found.earlier - {found.run_id}, key=lambda r: "" if r is None else r)
    if left:
        data["earlier_runs"] = left
    return f"write {json.dumps(data)} into {paths.run_file}"
