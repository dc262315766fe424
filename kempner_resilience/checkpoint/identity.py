"""One run identity across requeues: ``run.json`` in ``checkpoint.dir``.

A job requeued five times is one training run. The first attempt that finds no ``run.json``
creates it (atomically: written aside, then hard-linked into place, so two attempts racing on
the same directory end up with the same id); every later attempt reads it. Every checkpoint
records the id in its manifest and ownership marker, so a directory that holds checkpoints of a
different run (copied in, or a run id given explicitly that is not the directory's) is noticed
at resume instead of silently continuing someone else's training.

A damaged ``run.json`` (truncated by a full disk, unparsable, a run id that is not a string) is
bookkeeping, not the run's state: it must not block every restart, nor (with
``allow_other_run``) give each attempt a new id whose retention then keeps every earlier
attempt's checkpoints. ``repair`` rewrites it (atomically, with a warning naming the file) from
the run id the newest committed checkpoint records, or a new id when no checkpoint records one.

Lineages: ``checkpoint.resume: false`` in a directory holding checkpoints starts a new lineage
(``plan_lineage``, ``record_lineage``): a new run id is recorded in ``run.json``, and the ids it
replaces are listed under ``earlier_runs``. Their checkpoints stay on disk: resume never continues them (it
continues the lineage ``run.json`` names, whatever the step numbers), retention of the new run
never counts nor deletes them, and ``check_same_run`` does not take them for another run's.
When ``run.steps(total)`` ends its loop, ``mark_complete`` records ``completed_step`` for the
lineage: the next start says the run is complete (or that it trains longer).

The id is ``YYYYmmdd-HHMMSS-<8 hex>``: valid as a W&B run id, a TensorBoard or MLflow directory
name. ``KEMPNER_RESILIENCE_RUN_ID`` (or ``ResilientRun(run_id=...)``) gives it explicitly.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Iterable

from kempner_resilience.checkpoint.info import CheckpointDirError
from kempner_resilience.core.fileio import load_json_bounded, write_atomic
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.runpaths import RunPaths

__all__ = ["RUN_ID_ENV", "OtherRunError", "new_run_id", "read_run_id", "repair",
           "load_or_create", "other_run_ids", "check_same_run", "recorded_run_id",
           "earlier_runs", "plan_lineage", "record_lineage", "mark_complete", "completed_step"]

log = get_logger(__name__)

RUN_ID_ENV = "KEMPNER_RESILIENCE_RUN_ID"


class OtherRunError(CheckpointDirError):
    """``checkpoint.dir`` holds checkpoints of another run (exit 78 CONFIG when uncaught)."""


def new_run_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"


def read_run_id(paths: RunPaths) -> str | None:
    """The run id recorded in ``run.json``, or None when there is none (or unreadable)."""
    return _read(paths)[0]


def _read_data(paths: RunPaths) -> dict[str, Any]:
    """The whole of ``run.json`` ({} when absent or unreadable)."""
    try:
        data = load_json_bounded(paths.run_file)     # a FIFO or /dev/zero: unreadable
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def earlier_runs(paths: RunPaths) -> frozenset[str | None]:
    """The lineages ``run.json`` records as left behind by a fresh start (``None`` among them
    stands for checkpoints that record no run id at all)."""
    raw = _read_data(paths).get("earlier_runs")
    if not isinstance(raw, list):
        return frozenset()
    return frozenset(r for r in raw if r is None or (isinstance(r, str) and len(r) <= 256))


def completed_step(paths: RunPaths, run_id: str) -> int | None:
    """The ``total`` whose ``run.steps(total)`` loop run ``run_id`` finished, if recorded."""
    data = _read_data(paths)
    step = data.get("completed_step")
    if data.get("run_id") != run_id or not isinstance(step, int) or isinstance(step, bool):
        return None
    return step


def mark_complete(paths: RunPaths, run_id: str, step: int) -> None:
    """Record that lineage ``run_id`` finished its loop at ``step`` (rank 0, at the loop's
    end). Only into a ``run.json`` that still names this run; OSError when it cannot be
    written."""
    data = _read_data(paths)
    if data.get("run_id") != run_id:
        return
    data.update(completed_step=int(step), completed_at=time.time())
    _write(paths, data, replace=True)


def plan_lineage(paths: RunPaths, entries: Iterable[Any], proposed: str | None = None
                 ) -> tuple[str, dict[str, Any] | None]:
    """A fresh start (``checkpoint.resume: false``): the run id to use, and the ``run.json`` to
    write for it (None: nothing to write). Reads only: ``record_lineage`` writes, once the run
    holds the directory's lease.

    When the directory holds committed checkpoints not already left behind, a new lineage
    begins (``proposed`` or a new id) and their run ids, with the one ``run.json`` named, join
    ``earlier_runs``; otherwise the recorded id (or ``proposed``) goes on. Raises
    OtherRunError when ``proposed`` names a lineage that has checkpoints here: starting it
    again at step 0 would mix two trainings under one id."""
    current = read_run_id(paths)
    earlier = set(earlier_runs(paths))
    live = {recorded_run_id(e) for e in entries if e.committed} - earlier
    if proposed is not None and (proposed in live or proposed in earlier):
        raise OtherRunError(
            f"{paths} already holds checkpoints of run {proposed}; checkpoint.resume: false would "
            "train it again from step 0 under the same id. Give the new run another id "
            f"({RUN_ID_ENV}), or resume it (checkpoint.resume: true)")
    if not live:                      # nothing to leave behind: this lineage goes on
        if current is None or proposed is None or proposed == current:
            return (current or proposed or new_run_id()), None
        return proposed, {"run_id": proposed, "created_at": time.time(),
                          "earlier_runs": _ordered(earlier | {current})}
    rid = proposed or new_run_id()
    left = earlier | live | ({current} if current is not None else set())
    return rid, {"run_id": rid, "created_at": time.time(), "earlier_runs": _ordered(left)}


def record_lineage(paths: RunPaths, rid: str, data: dict[str, Any] | None) -> str:
    """Write what ``plan_lineage`` decided (rank 0, holding the lease); the run id recorded.
    With nothing to write, a missing ``run.json`` is created as by ``load_or_create``."""
    if data is None:
        return load_or_create(paths, rid)[0]
    _write(paths, data, replace=True)
    left = data.get("earlier_runs") or []
    log.info("checkpoint.resume is off: run %s starts a new lineage in %s; the checkpoints of %s "
             "are kept (never resumed from nor deleted by this run)", rid, paths,
             ", ".join("run " + r if r else "no recorded run" for r in left))
    return rid


def _ordered(ids: Iterable[str | None]) -> list[str | None]:
    return sorted(ids, key=lambda r: "" if r is None else r)


def _read(paths: RunPaths) -> tuple[str | None, str | None]:
    """``(run_id, None)``; ``(None, None)`` when there is no file; ``(None, what is wrong)``
    when there is one that records no usable id."""
    try:
        data = load_json_bounded(paths.run_file)     # a FIFO or /dev/zero: unreadable
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as e:
        return None, f"unreadable ({type(e).__name__}: {e})"
    rid = data.get("run_id") if isinstance(data, dict) else None
    if not isinstance(rid, str) or not rid.strip() or len(rid) > 256:
        return None, f"no usable run_id in it ({json.dumps(rid, default=str)[:60]})"
    return rid, None


def _recorded_by_checkpoints(paths: RunPaths) -> str | None:
    """The run id the most recently committed checkpoint records (manifest, else ownership
    marker): by commit time, not step, since a fresh lineage starts again at low steps."""
    from kempner_resilience.checkpoint import layout

    try:
        entries = layout.scan(paths)
    except OSError:
        return None
    by_time = sorted((e for e in entries if e.committed),
                     key=lambda e: float((e.manifest or {}).get("committed_at", 0.0) or 0.0))
    for e in reversed(by_time):
        rid = recorded_run_id(e)
        if isinstance(rid, str) and rid:
            return rid
    return None


def recorded_run_id(entry: Any) -> Any:
    """The run id a checkpoint records: its manifest's, else its ownership marker's."""
    from kempner_resilience.checkpoint import layout

    rid = (entry.manifest or {}).get("run_id")
    if rid is None:
        try:
            rid = (layout.read_marker(entry.path) or {}).get("run_id")
        except Exception:  # noqa: BLE001 - a damaged marker is just no evidence
            rid = None
    return rid


def repair(paths: RunPaths, proposed: str | None = None) -> str | None:
    """When ``run.json`` exists but records no usable id, rewrite it (atomically) with the
    id of the newest committed checkpoint, else ``proposed`` or a new one; returns the id now
    recorded. None when the file is absent (``load_or_create`` makes it); the recorded id when
    it is sound. Raises OSError when the file cannot be rewritten."""
    rid, problem = _read(paths)
    if problem is None:
        return rid
    found = _recorded_by_checkpoints(paths)
    rid = found or proposed or new_run_id()
    _write(paths, {"run_id": rid, "created_at": time.time(), "repaired_at": time.time()},
           replace=True)
    if found:
        log.warning("%s was damaged (%s); repaired it with run id %s, the one its newest "
                    "committed checkpoint records: the run goes on under that id", paths.run_file,
                    problem, rid)
    else:
        log.warning("%s was damaged (%s) and no checkpoint records a run id; replaced it with a "
                    "new run id %s", paths.run_file, problem, rid)
    return rid


def _write(paths: RunPaths, data: dict[str, Any], *, replace: bool) -> bool:
    """Write ``run.json`` aside and put it in place: hard-linked (never replacing another
    attempt's, False when one got there first) or, for a repair, renamed over it."""
    paths.root.mkdir(parents=True, exist_ok=True)
    # Not a replace: a hard link, which fails if another attempt got there first.
    return write_atomic(paths.run_file, json.dumps(data), exclusive=not replace)


def load_or_create(paths: RunPaths, proposed: str | None = None,
                   extra: dict[str, Any] | None = None) -> tuple[str, bool]:
    """``(run_id, created)``: the directory's id, or ``proposed`` (a fresh one if None) written
    into a new ``run.json``. Never replaces a sound file; a damaged one is repaired first
    (``repair``)."""
    existing = repair(paths, proposed)
    if existing is not None:
        return existing, False
    rid = proposed or new_run_id()
    created = _write(paths, {"run_id": rid, "created_at": time.time(), **(extra or {})},
                     replace=False)
    if not created:
        return read_run_id(paths) or rid, False
    return rid, True


def other_run_ids(entries: Iterable[Any], run_id: str,
                  earlier: Iterable[str | None] = ()) -> dict[str, list[str]]:
    """``{other_run_id: [step dir names]}`` for committed checkpoints recording another run id
    (checkpoints written before run ids existed record none and count as ours; those of
    ``earlier`` lineages of this directory are not another run's)."""
    left = frozenset(earlier)
    found: dict[str, list[str]] = {}
    for e in entries:
        rid = recorded_run_id(e) if e.committed else None
        if rid and rid != run_id and rid not in left:
            found.setdefault(str(rid), []).append(e.path.name)
    return found


def check_same_run(paths: RunPaths, run_id: str, entries: Iterable[Any],
                   recorded: str | None = None) -> None:
    """Raise ``OtherRunError`` naming both runs when the run's directory belongs to another run."""
    override = ("set checkpoint.allow_other_run: true (--set checkpoint.allow_other_run=true) "
                "to continue from them anyway, or point checkpoint.dir at a directory of its own")
    if recorded is not None and recorded != run_id:
        raise OtherRunError(
            f"{paths.run_file} belongs to run {recorded}, but this is run {run_id} (given by "
            f"{RUN_ID_ENV} or ResilientRun(run_id=...)); refusing to resume another run's "
            f"training: {override}")
    others = other_run_ids(entries, run_id, earlier_runs(paths))
    if others:
        what = "; ".join(f"run {rid}: {', '.join(sorted(names)[-3:])}"
                         for rid, names in others.items())
        raise OtherRunError(
            f"{paths} holds checkpoints of another run ({what}), but this is run {run_id} "
            f"({paths.run_file}); refusing to resume another run's training: {override}")
