"""Retention: which step directories may be deleted, and deleting them safely.

Retention deletes only what this package wrote: a directory is deleted only when it is a real
directory (never a symlink), it and everything in it belong to our uid, it holds only files our
saves write, and it carries our ``OWNER.json`` marker, or, for checkpoints written before the
marker existed, a committed manifest of ours. Anything else is left alone and said so. Never the
newest committed checkpoint.

Retention counts and deletes within the run's lineage only (its run id, see
``checkpoint/identity.py``): another run's checkpoints, and those of the earlier lineages a
fresh start left behind, are never counted by ``keep_last`` nor deleted. The saver also
protects the checkpoint the run resumed from until the run has committed one of its own, and
any checkpoint resume could not load (see ``plan_deletions``); one proven damaged was already set
aside (``checkpoint/quarantine.py``).

Deletion renames the directory to ``.trash-...`` first (atomic, and the new name no longer matches
the step pattern), then removes it, so a crash mid-delete never leaves a half-deleted directory
that looks like a checkpoint; ``clean_trash`` finishes such deletions later. The removal takes
the marker and the manifest last, so what a crash leaves still shows it is ours.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from kempner_resilience.checkpoint.info import CheckpointCorrupt
from kempner_resilience.checkpoint.layout import (MANIFEST_NAME, MARKER_NAME, Entry, is_our_file,
                                                  read_manifest, read_marker)
from kempner_resilience.checkpoint.delegated import PART_RE
from kempner_resilience.core.fileio import fsync_dir
from kempner_resilience.core.runpaths import RunPaths

__all__ = ["why_not_ours", "remove_dir", "clean_trash", "select_for_deletion", "plan_deletions"]


def why_not_ours(path: Path, manifest: dict[str, Any] | None = None,
                 run_id: str | None = None) -> str | None:
    """None when retention may delete ``path``, else why it must leave it alone.

    Ours means: a real directory (a symlink never is; nothing is followed), owned by our uid, as
    is everything in it; holding only regular files our saves write; carrying our marker (with
    our ``run_id`` when both are known). A directory from before the marker existed is ours only
    when committed with our manifest (``manifest``, as ``scan`` parsed it): a committed
    checkpoint names its writer, a partial one without a marker names nobody.
    """
    uid = os.geteuid()
    try:
        st = os.lstat(path)
        if stat.S_ISLNK(st.st_mode):
            return "it is a symbolic link (retention never follows or removes links)"
        if not stat.S_ISDIR(st.st_mode):
            return "it is not a directory"
        if st.st_uid != uid:
            return f"it is owned by uid {st.st_uid}, not by us (uid {uid})"
        for name in os.listdir(path):
            fst = os.lstat(path / name)
            if stat.S_ISDIR(fst.st_mode) and PART_RE.match(name):
                # A part other processes saved (checkpoint/delegated.py): DCP's files only.
                why = _not_our_part(path / name, fst, uid)
                if why is not None:
                    return why
                continue
            if not is_our_file(name):
                return f"it holds {name!r}, which our saves never write"
            if not stat.S_ISREG(fst.st_mode):
                return f"its {name!r} is not a regular file"
            if fst.st_uid != uid:
                return f"its {name!r} is owned by uid {fst.st_uid}, not by us (uid {uid})"
        if manifest is None and os.path.lexists(path / MANIFEST_NAME):
            # Damage, not a partial save (the commit is an atomic rename): keep it to inspect.
            return f"its {MANIFEST_NAME} is unreadable (check it with `kempner-resilience verify`)"
        marker = read_marker(path)
    except CheckpointCorrupt as e:
        return str(e)
    except OSError as e:
        return f"it cannot be inspected ({e.strerror or e})"
    if marker is None:
        if manifest is None:
            # Also what a save SIGKILLed between its mkdir and its marker leaves: nothing in it
            # proves it ours, so it stays (it holds no data: at most the marker's temp file).
            return (f"it has no {MARKER_NAME} and no {MANIFEST_NAME}: not written by a save of "
                    "this package, or one cut short before its first byte")
        return None
    theirs = marker.get("run_id")
    if run_id is not None and theirs is not None and theirs != run_id:
        return f"it belongs to run {theirs!r}, not to this run ({run_id!r})"
    return None


def _not_our_part(path: Path, st: os.stat_result, uid: int) -> str | None:
    """Why the subdirectory ``path`` of a step directory is not a part of our saves, if so."""
    if st.st_uid != uid:
        return f"its {path.name!r} is owned by uid {st.st_uid}, not by us (uid {uid})"
    for name in os.listdir(path):
        fst = os.lstat(path / name)
        if not is_our_file(name) or name in (MANIFEST_NAME, MARKER_NAME):
            return f"it holds {path.name}/{name}, which our saves never write"
        if not stat.S_ISREG(fst.st_mode):
            return f"its {path.name}/{name} is not a regular file"
        if fst.st_uid != uid:
            return f"its {path.name}/{name} is owned by uid {fst.st_uid}, not by us (uid {uid})"
    return None


def remove_dir(path: Path) -> None:
    """Rename to a trash name (atomic, never matches the step pattern), then delete.
    Never a symlink: renaming one would only hide it, deleting through it would reach elsewhere."""
    if stat.S_ISLNK(os.lstat(path).st_mode):
        raise OSError(f"{path} is a symbolic link; retention never removes links")
    trash = path.parent / RunPaths.trash_name(path.name, f"{os.getpid()}-{time.monotonic_ns()}")
    os.rename(path, trash)
    fsync_dir(path.parent)
    _delete(trash)


def _delete(path: Path) -> None:
    """Delete a directory of ours with its marker, then its manifest, last: a deletion cut short
    (a SIGKILL, a node's death) leaves a trash directory that still proves it is ours, which the
    next ``clean_trash`` finishes. (``shutil.rmtree`` goes in directory order: one cut short
    after the marker left the shards behind for good, retention refusing to touch them.)"""
    with os.scandir(path) as entries:
        rest = [e for e in entries if e.name not in (MARKER_NAME, MANIFEST_NAME)]
    for entry in rest:
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
    for name in (MARKER_NAME, MANIFEST_NAME):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path / name)
    with contextlib.suppress(OSError):      # not empty: something appeared, leave it
        path.rmdir()


def clean_trash(paths: RunPaths, run_id: str | None = None,
                on_skip: Callable[[Path, str], None] | None = None) -> None:
    """Finish deletions a crash interrupted (only of directories that are ours, as retention
    decides it; ``on_skip(path, why)`` hears about the others)."""
    try:
        names = os.listdir(paths.root)
    except FileNotFoundError:
        return
    for name in names:
        if not RunPaths.is_step_trash(name):
            continue
        p = paths.root / name
        try:
            # Empty: a deletion cut short after its last file. Nothing in it can be lost, and
            # rmdir removes only an empty directory (any other fails here and is checked below).
            p.rmdir()
            continue
        except OSError:
            pass
        try:
            manifest: dict[str, Any] | None = read_manifest(p)
        except (CheckpointCorrupt, OSError):
            manifest = None
        why = why_not_ours(p, manifest, run_id)
        if why is None:
            _delete(p)
        elif on_skip is not None:
            on_skip(p, why)


def select_for_deletion(entries: list[Entry], keep_last: int, keep_every: int,
                        protect: Iterable[Path] = (), *, run_id: str | None = None,
                        earlier: Iterable[str | None] = (),
                        on_skip: Callable[[Path, str], None] | None = None) -> list[Entry]:
    """What retention removes (``plan_deletions``), among the directories that are ours
    (``why_not_ours``: checked on disk); ``on_skip(path, why)`` hears about the others.
    Never the newest committed one of the run's lineage, never ``protect``ed paths, never a
    checkpoint of another lineage (another ``run_id``, or one of the ``earlier`` lineages a
    fresh start left behind)."""
    from kempner_resilience.checkpoint.identity import recorded_run_id

    left = frozenset(earlier)
    protected = {Path(p) for p in protect}
    ours: list[Entry] = []
    for e in entries:
        if e.path in protected:
            continue
        earlier_lineage = bool(left) and e.committed and recorded_run_id(e) in left
        # An earlier lineage is kept whatever it holds: only what else is odd about it is
        # worth a warning (its run id differing from ours is the point, not news).
        why = why_not_ours(e.path, e.manifest, None if earlier_lineage else run_id)
        if why is None:
            if not earlier_lineage:
                ours.append(e)
        elif on_skip is not None:
            on_skip(e.path, why)
    return plan_deletions(ours, keep_last, keep_every, run_id=run_id, earlier=left,
                          run_of=recorded_run_id)


def plan_deletions(entries: Iterable[Entry], keep_last: int, keep_every: int,
                   protect: Iterable[Path] = (), *, run_id: str | None = None,
                   earlier: Iterable[str | None] = (),
                   run_of: Callable[[Entry], Any] = lambda e: None) -> list[Entry]:
    """The pure decision (no disk access when ``run_of`` has none): committed entries of the
    run's lineage beyond the newest ``keep_last`` (except ``keep_every`` multiples), and
    partial ones no newer than its newest commit (a later commit proves their save is over:
    saves of one job are serial).

    The lineage of ``run_id``: entries whose recorded run id (``run_of``) is ``run_id``, or
    records none (written before run ids existed) unless ``None`` is among the ``earlier``
    lineages. Entries of any other run, ``protect``ed ones and damaged ones are neither counted
    nor removed: a checkpoint that is not this lineage's, or that resume could not load, must
    neither push this lineage's checkpoints out nor be deleted by it.
    """
    protected = {Path(p) for p in protect}
    left = frozenset(earlier)

    def mine(e: Entry) -> bool:
        rid = run_of(e)
        if rid is None:
            return None not in left
        return run_id is None or rid == run_id

    ours = [e for e in entries if e.path not in protected and not e.damaged and mine(e)]
    committed = [e for e in ours if e.committed]
    if not committed:
        return []
    newest = max(committed, key=Entry.sort_key)
    keep = {e.path for e in sorted(committed, key=Entry.sort_key)[-max(keep_last, 1):]}
    keep.add(newest.path)
    if keep_every > 0:
        keep.update(e.path for e in committed if e.step % keep_every == 0)
    # A damaged manifest might be a transient read error; it is not ours to judge, and
    # `ls`/`verify` report it (damaged entries were left out above).
    return [e for e in ours if e.path not in keep and (e.committed or e.step <= newest.step)]
