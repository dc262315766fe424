"""Loading one checkpoint into the state, on every rank alike, or skipping it on every rank.

Everything before ``dcp.load`` (manifest, cheap checks, ``.metadata`` against the manifest, the
load template) runs locally and any rank's error is gathered, so all ranks skip a damaged or
unreadable checkpoint together; ``dcp.load`` itself fails on all ranks together. The caller
(``CheckpointManager.resume``) walks the candidates newest first.

A checkpoint whose entries differ from the live state's (``statekeys``) is not skipped but
refused on every rank (``StateMismatchError``, exit 78): an older checkpoint would differ the
same way, or match by chance and silently resume the wrong state. With
``checkpoint.allow_partial_resume`` what both have is loaded instead, and the checkpoint is
pinned (``pinned``) when it holds more.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException   # a BaseException subclass
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from kempner_resilience.checkpoint import (delegated, identity, integrity, layout, pinned,
                                          quarantine, statekeys)
from kempner_resilience.checkpoint.comm import Comm
from kempner_resilience.checkpoint.hostbuf import HostStaging
from kempner_resilience.checkpoint.info import (CheckpointError, CheckpointInfo,
                                               StateMismatchError, describe_error, is_damage)
from kempner_resilience.checkpoint.reader import VerifyingReader
from kempner_resilience.checkpoint.state import TrainState
from kempner_resilience.config import CheckpointConfig
from kempner_resilience.core.faults import is_peer_failure
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.runpaths import RunPaths

__all__ = ["candidates", "lineage_candidates", "load_newest", "try_load", "restore_ddp_buckets"]

log = get_logger(__name__)


def candidates(paths: RunPaths, earlier: Iterable[str | None] = ()
               ) -> tuple[list[str] | None, str | None]:
    """Rank 0's list of what to try, newest first: committed checkpoints and damaged ones (so
    the fall-back warning names them), or (None, why) when the run's directory cannot be
    listed. Those recording a run id in ``earlier`` (lineages a fresh start left behind, see
    ``identity.earlier_runs``) are not tried: resume continues the newest lineage, not the
    highest step."""
    try:
        return [str(e.path) for e in lineage_candidates(layout.scan(paths), earlier)], None
    except OSError as e:
        return None, f"{e.strerror}"


def lineage_candidates(entries: Iterable[layout.Entry], earlier: Iterable[str | None] = (),
                       run_of: Callable[[layout.Entry], Any] | None = None
                       ) -> list[layout.Entry]:
    """``entries`` (oldest first, as ``scan`` gives them) that resume may try, newest first:
    committed or damaged, and not of an ``earlier`` lineage (``run_of`` gives an entry's
    recorded run id; default: its manifest's, else its marker's). Pure when ``run_of`` is."""
    left = frozenset(earlier)
    recorded = run_of or identity.recorded_run_id
    return [e for e in reversed(list(entries))
            if (e.committed or e.damaged) and not (left and recorded(e) in left)]


def load_newest(paths: RunPaths, config: CheckpointConfig, state: TrainState, rank: int,
                comm: Comm, staging: HostStaging | None = None, *,
                earlier: Iterable[str | None] = (), failed: list[Path] | None = None
                ) -> tuple[CheckpointInfo, int] | None:
    """Load the newest checkpoint of the run's directory that loads into ``state`` on every
    rank, and give each DDP its bucket layout back: (its info, bytes read), or None when there
    is none.

    A checkpoint that fails validation or checksum verification is skipped with a warning and
    the previous one is tried; CheckpointError when checkpoints exist but none loads (the
    model may then be partially overwritten), ``LineageDamagedError`` (exit 78) when what
    stands in the way is only damage: every checkpoint of the lineage set aside, now or by an
    earlier launch. Collective. Checkpoints of ``earlier`` lineages
    are not tried. One whose bytes prove it damaged is set aside by rank 0
    (``quarantine.set_aside``); those that failed otherwise (permissions, a state that does not
    fit) stay, and are appended to ``failed`` so the run's retention neither counts nor
    deletes them.
    """
    # Rank 0 lists, every rank tries the same list: all make the same choice. Damaged entries
    # are tried too, so the warning below names them and the fall-back is the same as for any
    # other per-checkpoint error. Those of the lineage earlier launches set aside come along:
    # with nothing else to load, they make the start a refusal, not a fresh start.
    earlier = frozenset(earlier)
    listing = (*candidates(paths, earlier), _set_aside_before(paths, earlier)) if rank == 0 \
        else (None, None, [])
    tried, err, before = comm.broadcast_object(listing)
    if tried is None:
        raise CheckpointError(f"cannot list the checkpoints in {paths} ({err}); fix its "
                              "permissions or set checkpoint.resume: false")
    failures: list[str] = []
    damaged: list[tuple[Path, str]] = []
    moved: list[tuple[Path, Path | None, str]] = []      # rank 0's: where each went
    try:
        for p in tried:
            info, why, nread, proven = try_load(paths, Path(p), config, state, rank, comm, staging)
            if info is not None:
                restore_ddp_buckets(state, comm, rank)
                if failures:
                    log.warning("resumed from the older checkpoint %s after skipping: %s",
                                p, "; ".join(failures))
                return info, nread
            failures.append(f"{p}: {why}")
            if proven:
                damaged.append((Path(p), why))
            elif failed is not None:
                failed.append(Path(p))
            log.warning("cannot resume from %s (%s); falling back to the previous checkpoint",
                        p, why)
    finally:
        # After the walk, when no rank reads them any more: rank 0 alone renames.
        for p, why in damaged:
            target = quarantine.set_aside(p, why) if rank == 0 else None
            moved.append((p, target, why))
            if rank == 0 and target is None and failed is not None:
                failed.append(p)
    if len(damaged) == len(failures) and (damaged or before):
        # Nothing of the lineage left that loads, and only damage to blame (the same on every
        # rank: gathered): refused on every rank, never a quiet start from step 0.
        raise quarantine.refusal(paths, moved, [Path(p) for p in before], renamed=rank == 0)
    if failures:
        raise CheckpointError(
            f"no committed checkpoint in {paths} could be loaded ({'; '.join(failures)}). The "
            "model/optimizer may be partially overwritten: restart the process. To start "
            "fresh, move the step_* directories away or set checkpoint.resume: false")
    log.debug("no committed checkpoint in %s: starting fresh", paths)
    return None


def _set_aside_before(paths: RunPaths, earlier: frozenset[str | None]) -> list[str]:
    """Rank 0: the set-aside checkpoints of the lineage resume continues (none of an
    ``earlier`` one), newest first."""
    try:
        return [str(e.path) for e in lineage_candidates(quarantine.entries(paths), earlier)]
    except OSError as e:      # a hint lost, not a resume: the listing above says what is wrong
        log.debug("cannot list the set-aside checkpoints in %s: %s", paths, e)
        return []


def try_load(paths: RunPaths, path: Path, config: CheckpointConfig, state: TrainState,
             rank: int, comm: Comm, staging: HostStaging | None = None
             ) -> tuple[CheckpointInfo | None, str, int, bool]:
    """Load ``path`` into ``state`` (collective): (info, "", bytes read, False) or (None, why,
    0, damaged), ``damaged`` when some rank's failure proves the bytes damaged
    (``CheckpointDamaged``). GPU tensors are read through ``staging``'s host buffers when
    given."""
    local: str | None = None
    proven = False
    entry = reader = None
    sd: dict[str, Any] = {}
    blob_key: str | None = None
    diff: statekeys.KeyDiff | None = None
    refusal: str | None = None
    try:
        parsed = layout.parse_name(path.name)
        entry = layout.Entry(path, parsed[0] if parsed else -1, parsed[1] if parsed else 0,
                             layout.read_manifest(path))
        layout.validate(entry, config.allow_foreign_owner)
        if config.verify:
            layout.verify_files(path, entry.manifest or {}, [integrity.METADATA_NAME])
        own = integrity.part(entry.manifest or {})    # without the parts others saved
        reader = VerifyingReader(path, own, verify=config.verify,
                                 threads=config.io_threads, staging=staging)
        metadata = reader.read_metadata()
        integrity.check_metadata(path, metadata, own)
        sd, blob_key = state.load_template(rank, set(metadata.state_dict_metadata),
                                           comm.world_size)
        # Before anything is loaded: the entries the checkpoint holds that the live state
        # lacks would be dropped without a word (DCP loads only what the template asks for).
        diff = statekeys.compare(sd, metadata.state_dict_metadata)
        if diff.mismatch and not config.allow_partial_resume:
            refusal = statekeys.refusal(str(path), diff)
    except (CheckpointError, OSError) as e:
        local = str(e) if isinstance(e, CheckpointError) else \
            f"{e.filename or path}: {e.strerror or e}"
        proven = is_damage(e)
    except Exception as e:   # noqa: BLE001 - unpickling a damaged .metadata raises anything
        local = f"{path}: {describe_error(e)}"
    gathered = comm.all_gather_object((local, refusal, proven))
    errors = list(dict.fromkeys(e for e, _, _ in gathered if e))
    if errors or entry is None or reader is None or diff is None:
        return None, "; ".join(errors), 0, any(d for _, _, d in gathered)
    _refuse_any(r for _, r, _ in gathered)
    try:
        # A partial resume the user asked for: entries the checkpoint lacks keep their values.
        planner = DefaultLoadPlanner(allow_partial_load=bool(diff.added))
        dcp.load(sd, storage_reader=reader, planner=planner, process_group=comm.dcp_group,
                 no_dist=comm.dcp_no_dist)
    except (Exception, CheckpointException) as e:   # DCP raises on all ranks together
        return None, describe_error(e) or "load failed", 0, is_damage(e)
    blob, why = None, None
    try:
        blob = state.read_blob(sd, blob_key)
    except Exception as e:   # noqa: BLE001 - checksummed, yet not unpickled here: skip on all
        why = f"{path}: {blob_key}: {describe_error(e)}"
    why = _check_objects(paths, path, config, state, blob, why, diff, rank, comm)
    if why:
        return None, why, 0, False
    if state.delegated:     # loaded by their processes, before this one's state is applied
        try:
            why = delegated.load_parts(state.delegated, path, entry.manifest or {})
        except (Exception, CheckpointException) as e:  # theirs: an older one is tried
            if is_peer_failure(e):
                raise
            return None, f"{path}: {describe_error(e)}", 0, is_damage(e)
        if why:
            return None, why, 0, False
    step = state.restore(sd, blob_key, blob)
    if rank == 0 and (line := statekeys.dtype_line(str(path), diff)) is not None:
        log.warning("%s", line)
    info = entry.info()
    if step is not None and step != info.step:
        log.warning("%s: manifest step %d, saved state says %d", path, info.step, step)
    return info, "", reader.bytes_read, False


def _refuse_any(refusals: Any) -> None:
    """Raise the first rank's refusal on every rank (the same list on each: all_gather)."""
    first = next((r for r in refusals if r), None)
    if first is not None:
        raise StateMismatchError(first)


def _check_objects(paths: RunPaths, path: Path, config: CheckpointConfig,
                   state: TrainState, blob: dict[str, Any] | None, why: str | None,
                   diff: statekeys.KeyDiff, rank: int, comm: Comm) -> str | None:
    """After the load, before anything is applied: the blob's objects (scheduler, data
    loader, ...) that the live state lacks are refused like the DCP entries; with
    ``allow_partial_resume`` rank 0 pins the checkpoint when anything of it is left out, and
    says what. ``why``: this rank's blob could not be read. Collective (one gather): every
    rank refuses, or none; returns every rank's ``why`` (skip this checkpoint) or None."""
    saved_objects = [] if blob is None else list(blob.get("objects", {}))
    objs = statekeys.objects(state.others, saved_objects)
    problem: str | None = None
    if why is not None:
        pass        # reported below, on every rank
    elif objs.dropped and not config.allow_partial_resume:
        problem = statekeys.refusal(str(path), objs)
    elif rank == 0 and (diff.mismatch or objs.dropped):
        both = statekeys.KeyDiff(dropped=diff.dropped + objs.dropped, added=diff.added,
                                 live=diff.live | objs.live, saved=diff.saved | objs.saved)
        note = statekeys.partial_note(str(path), both)
        try:
            if both.dropped:
                pinned.pin(paths, path, note)
        except OSError as e:
            problem = (f"refusing the partial resume from {path}: it cannot be pinned in "
                       f"{paths.pinned} ({e.strerror or e}), and "
                       "retention would then delete the only full copy; fix or remove that "
                       "file")
        else:
            log.warning("%s", note)
    gathered = comm.all_gather_object((why, problem))
    whys = list(dict.fromkeys(w for w, _ in gathered if w))
    if whys:
        return "; ".join(whys)
    _refuse_any(p for _, p in gathered)
    return None


def restore_ddp_buckets(state: TrainState, comm: Comm, rank: int) -> None:
    """Give each DDP the gradient bucket layout it had when the checkpoint was written (see
    ``ddp_buckets``), on every rank or on none: ranks reducing in different layouts would
    deadlock. Collective when the state holds a DDP."""
    layouts = state.buckets
    if not layouts.ddps:
        return
    plan = layouts.plan(state.loaded_buckets)
    plans = comm.all_gather_object(plan)
    for key in sorted(plan):
        indices, why = plan[key]
        if any(p.get(key) != plan[key] for p in plans):
            indices, why = None, "the ranks' checkpoints hold different layouts"
        if indices is None:
            if why and rank == 0:
                log.warning("DDP %s: gradient bucket layout not restored: %s. With 3 or "
                            "more ranks the first steps after this resume may differ from an "
                            "uninterrupted run in the last bits", key, why)
            continue
        old = layouts.apply(key, indices)
        if not all(comm.all_gather_object(old is not None)):
            if old is not None:
                layouts.revert(key, old)
            continue
        if rank == 0:
            log.info("DDP %s: restored its gradient bucket layout (%d buckets) from the "
                     "checkpoint", key, len(indices))
