"""One run identity across requeues: ``run.json`` in ``checkpoint.dir``.

A job requeued five times is one training run. The first attempt that finds no ``run.json``
creates it once it holds the directory's lease (atomically: written aside, then hard-linked into
place, never over another attempt's); every later attempt reads it. Every checkpoint
records the id in its manifest and ownership marker, so a directory that holds checkpoints of a
different run (copied in, or a run id given explicitly that is not the directory's) is noticed
at resume instead of silently continuing someone else's training.

A damaged ``run.json`` (cut short, random bytes, a symbolic link, a FIFO) is bookkeeping, not
the run's state: it must neither block every restart nor hand the directory to another lineage.
``runrecord`` rebuilds it from what the step directories record (the current lineage, and the
ones left behind), or refuses the start when that cannot be told (a directory in its place, an
unreadable file, a ledger that disagrees). A start decides everything by reading (``plan``) and
writes ``run.json`` only once it holds the directory's lease (``record``): a refused start
writes nothing. ``repair`` does both at once, for tools.

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
from dataclasses import dataclass
from typing import Any, Iterable

from kempner_resilience.checkpoint import runrecord
from kempner_resilience.checkpoint.info import CheckpointDirError
from kempner_resilience.checkpoint.runrecord import Recorded, RunFileError, recorded_run_id
from kempner_resilience.core.fileio import write_atomic
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.runpaths import RunPaths

__all__ = ["RUN_ID_ENV", "OtherRunError", "RunFileError", "Plan", "plan", "record",
           "new_run_id", "read_run_id", "repair",
           "load_or_create", "other_run_ids", "check_same_run", "recorded_run_id",
           "earlier_runs", "plan_lineage", "record_lineage", "mark_complete", "completed_step"]

log = get_logger(__name__)

RUN_ID_ENV = "KEMPNER_RESILIENCE_RUN_ID"


class OtherRunError(CheckpointDirError):
    """``checkpoint.dir`` holds checkpoints of another run (exit 78 CONFIG when uncaught)."""


def new_run_id() -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:8]}"


def read_run_id(paths: RunPaths) -> str | None:
    """The run id recorded in ``run.json``, or None when there is none (or it is damaged)."""
    return _read_data(paths).get("run_id")


def _read_data(paths: RunPaths) -> dict[str, Any]:
    """The whole of a sound ``run.json`` ({} when absent or damaged; never blocks)."""
    return runrecord.read(paths)[0] or {}


def earlier_runs(paths: RunPaths) -> frozenset[str | None]:
    """The lineages ``run.json`` records as left behind by a fresh start (``None`` among them
    stands for checkpoints that record no run id at all)."""
    return runrecord.earlier_of(_read_data(paths))


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


@dataclass(frozen=True)
class Plan:
    """What a start decided about the run's identity, by reading only (``plan``)."""

    run_id: str
    earlier: frozenset[str | None]      # lineages left behind: never resumed, counted, deleted
    recorded: str | None = None         # the directory's own id (run.json's, or recovered)
    write: dict[str, Any] | None = None  # the run.json ``record`` puts in place, if any
    replace: bool = False               # over what is there; else only where there is none
    note: str | None = None             # what ``record`` says once it is written
    repair: bool = False                # ``note`` is a warning: run.json was damaged


def plan(paths: RunPaths, entries: Iterable[Any], explicit: str | None = None, *,
         resume: bool = True) -> Plan:
    """The run id a start goes on with, the lineages it leaves alone, and the ``run.json`` it
    writes once it holds the lease (``record``). Reads only. ``entries``: ``layout.scan``'s.

    A damaged ``run.json`` is recovered from the step directories (``runrecord``). Raises
    ``RunFileError`` when that cannot be done safely (a directory in its place, an unreadable
    file; on resume, a ledger naming another run), and ``OtherRunError`` as ``plan_lineage``."""
    entries = list(entries)
    found = runrecord.recorded(paths, entries)
    if not resume:
        rid, data = plan_lineage(paths, entries, explicit, found)
        if data is not None and data.get("repaired_at") is None:
            left = data.get("earlier_runs") or []
            return Plan(rid, frozenset(left), found.run_id, data, replace=True, note=(
                f"checkpoint.resume is off: run {rid} starts a new lineage in {paths}; the "
                "checkpoints of " + ", ".join("run " + r if r else "no recorded run"
                                              for r in left)
                + " are kept (never resumed from nor deleted by this run)"))
        return _resumed(paths, found, rid, data)
    if found.doubt is not None and explicit != found.run_id:
        raise RunFileError(found.doubt)
    rid = explicit or found.run_id or new_run_id()
    data = None
    if found.damage is not None and found.run_id in (None, rid):
        data = found.repaired(rid)    # (another explicit id: check_same_run refuses the start)
    return _resumed(paths, found, rid, data)


def _resumed(paths: RunPaths, found: Recorded, rid: str, data: dict[str, Any] | None) -> Plan:
    """The plan of a start that goes on with ``rid``: a damaged ``run.json`` rewritten as
    ``data``, a missing one created."""
    if found.damage is None:
        if found.exists:
            return Plan(rid, found.earlier, found.run_id)
        return Plan(rid, found.earlier, None, {"run_id": rid, "created_at": time.time()})
    if data is None:
        return Plan(rid, found.earlier, found.run_id)
    if found.run_id is not None:
        left = sorted(r or "no recorded run" for r in found.earlier)
        note = (f"{paths.run_file} was damaged ({found.damage}); repaired it with run id "
                f"{found.run_id}, the one its newest checkpoint {found.source} records: the run "
                "goes on under that id" + (f" (lineages left behind, kept: {', '.join(left)})"
                                           if left else ""))
    else:
        note = (f"{paths.run_file} was damaged ({found.damage}) and no checkpoint records a run "
                f"id; replaced it with run id {rid}")
    return Plan(rid, found.earlier, found.run_id, data, replace=True, note=note, repair=True)


def record(paths: RunPaths, planned: Plan) -> None:
    """Write what ``plan`` decided (rank 0, holding the directory's lease). OSError when
    ``run.json`` cannot be written: the next start decides the same from the directory."""
    if planned.write is None:
        return
    if not _write(paths, planned.write, replace=planned.replace):
        log.warning("%s appeared while this run started; this run goes on as run %s",
                    paths.run_file, planned.run_id)
        return
    if planned.note is not None:
        (log.warning if planned.repair else log.info)("%s", planned.note)


def plan_lineage(paths: RunPaths, entries: Iterable[Any], proposed: str | None = None,
                 found: Recorded | None = None) -> tuple[str, dict[str, Any] | None]:
    """A fresh start (``checkpoint.resume: false``): the run id to use, and the ``run.json`` to
    write for it (None: nothing to write). Reads only: ``record_lineage`` writes, once the run
    holds the directory's lease. ``found``: the directory's identity (``runrecord.recorded``),
    read here when not given.

    When the directory holds committed checkpoints not already left behind, a new lineage
    begins (``proposed`` or a new id) and their run ids, with the one ``run.json`` named, join
    ``earlier_runs``; otherwise the recorded id (or ``proposed``) goes on (a damaged
    ``run.json`` is then rewritten: ``repaired_at`` in the result). Raises OtherRunError when
    ``proposed`` names a lineage that has checkpoints here: starting it again at step 0 would
    mix two trainings under one id."""
    entries = list(entries)
    if found is None:
        found = runrecord.recorded(paths, entries)
    current = found.run_id
    earlier = set(found.earlier)
    live = {recorded_run_id(e) for e in entries if e.committed} - earlier
    if proposed is not None and (proposed in live or proposed in earlier):
        raise OtherRunError(
            f"{paths} already holds checkpoints of run {proposed}; checkpoint.resume: false would "
            "train it again from step 0 under the same id. Give the new run another id "
            f"({RUN_ID_ENV}), or resume it (checkpoint.resume: true)")
    if not live:                      # nothing to leave behind: this lineage goes on
        if current is None or proposed is None or proposed == current:
            rid = current or proposed or new_run_id()
            return rid, (found.repaired(rid) if found.damage is not None else None)
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


def repair(paths: RunPaths, proposed: str | None = None) -> str | None:
    """When ``run.json`` exists but is damaged, rewrite it (atomically) from what the step
    directories record (``runrecord``), else with ``proposed`` or a new id; returns the id now
    recorded. None when the file is absent (``load_or_create`` makes it); the recorded id when
    it is sound. Raises ``RunFileError`` when it cannot be repaired safely, OSError when it
    cannot be rewritten. For tools: a start plans, then records under its lease."""
    from kempner_resilience.checkpoint import layout

    found = runrecord.recorded(paths, layout.scan(paths))
    if found.damage is None:
        return found.run_id
    if found.doubt is not None:
        raise RunFileError(found.doubt)
    rid = found.run_id or proposed or new_run_id()
    record(paths, _resumed(paths, found, rid, found.repaired(rid)))
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
                   recorded: str | None = None,
                   earlier: Iterable[str | None] | None = None) -> None:
    """Raise ``OtherRunError`` naming both runs when the run's directory belongs to another run.
    ``earlier``: the lineages left behind (``Plan.earlier``); read from ``run.json`` if None."""
    override = ("set checkpoint.allow_other_run: true (--set checkpoint.allow_other_run=true) "
                "to continue from them anyway, or point checkpoint.dir at a directory of its own")
    if recorded is not None and recorded != run_id:
        raise OtherRunError(
            f"{paths.run_file} belongs to run {recorded}, but this is run {run_id} (given by "
            f"{RUN_ID_ENV} or ResilientRun(run_id=...)); refusing to resume another run's "
            f"training: {override}")
    others = other_run_ids(entries, run_id,
                           earlier_runs(paths) if earlier is None else earlier)
    if others:
        what = "; ".join(f"run {rid}: {', '.join(sorted(names)[-3:])}"
                         for rid, names in others.items())
        raise OtherRunError(
            f"{paths} holds checkpoints of another run ({what}), but this is run {run_id} "
            f"({paths.run_file}); refusing to resume another run's training: {override}")
