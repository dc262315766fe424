"""On-disk layout: step directories, the ownership marker, the commit manifest, discovery and
validation (what may be deleted, and deleting it, is ``retention``).

A checkpoint lives in its own fresh directory ``<root>/step_<9 digits>[.<n>]``; the optional
``.<n>`` appears only when a directory for that step already exists (we never write into an
existing one: DCP rewrites shards in place before replacing ``.metadata``). The directory becomes
a checkpoint only when ``MANIFEST.json`` appears in it, written last, atomically, by rank 0 after
every rank's files are durable. Nothing else (``.metadata``, shard files) counts as a commit.
Because the commit is an atomic rename, a ``MANIFEST.json`` that is present but cannot be read or
parsed is damage, not an interrupted save: such a directory is listed as damaged, never as partial.

Right after creating a step directory, before any data, rank 0 writes ``OWNER.json`` into it
(format, uid, host, pid, time, run id): what ``retention`` checks before it deletes anything.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import socket
import time
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from kempner_resilience.checkpoint import integrity
from kempner_resilience.checkpoint.info import CheckpointCorrupt, CheckpointDamaged, CheckpointInfo
from kempner_resilience.core.fileio import (NotARegularFile, TooLarge, fsync_dir,
                                            load_json_bounded, parse_json, read_bounded,
                                            temp_target, write_atomic)
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.runpaths import RunPaths

log = get_logger(__name__)

MANIFEST_NAME = "MANIFEST.json"
FORMAT = "kempner_resilience.checkpoint/1"
MARKER_NAME = integrity.MARKER_NAME
MARKER_FORMAT = "kempner_resilience.step-owner/1"
# Every name our saves create inside a step directory (``is_our_file``); a directory holding
# anything else is not touched by retention (somebody put it there). MANIFEST.json.tmp is the
# temporary name of versions before ``write_atomic``; ``__<rank>.metadata`` is a save's
# without collectives (one per rank).
_OUR_FILES = re.compile(r"^(__\d+_\d+\.distcp|(__\d+)?\.metadata(\.tmp)?"
                        r"|MANIFEST\.json(\.tmp)?|OWNER\.json)$")
_READ_CHUNK = 16 << 20


# The step directories' names are the run directory's (``RunPaths``); these two stay as the
# names the rest of this package and its tests know them by.
dir_name = RunPaths.step_name
parse_name = RunPaths.parse_step_name


def is_our_file(name: str) -> bool:
    """Whether a save of this package writes files named ``name`` into a step directory (a
    temporary file of ``write_atomic`` counts as its target)."""
    return bool(_OUR_FILES.match(temp_target(name) or name))


def create_step_dir(paths: RunPaths, step: int, run_id: str | None = None) -> Path:
    """Create a fresh directory for ``step`` (never an existing one) holding only our ownership
    marker (see ``write_marker``), and make it durable. On failure nothing is left behind."""
    attempt = 0
    while True:
        path = paths.step_dir(step, attempt)
        try:
            path.mkdir(parents=True)
        except FileExistsError:
            attempt += 1
            continue
        try:
            write_marker(path, step, run_id)
            fsync_dir(paths.root)
        except BaseException:
            # A full disk often fails right here: leave no empty directory nobody would delete.
            with contextlib.suppress(OSError):
                (path / MARKER_NAME).unlink(missing_ok=True)
                path.rmdir()
            raise
        return path


def write_marker(path: Path, step: int, run_id: str | None = None) -> None:
    """Mark ``path`` as written by this package, before its first data byte: retention deletes
    only directories carrying it. ``run_id`` (None when unknown) names the run that owns it."""
    marker = {"format": MARKER_FORMAT, "step": step, "uid": os.geteuid(),
              "host": socket.gethostname(), "pid": os.getpid(), "created_at": time.time(),
              "run_id": run_id}
    if not write_atomic(path / MARKER_NAME, json.dumps(marker, separators=(",", ":")),
                        exclusive=True, mode=0o644):
        raise FileExistsError(errno.EEXIST, "step directory already has a marker",
                              str(path / MARKER_NAME))


def read_marker(path: Path) -> dict[str, Any] | None:
    """The ownership marker of a step directory; None if it has none; CheckpointCorrupt if it is
    not one of ours."""
    try:
        marker = load_json_bounded(path / MARKER_NAME)
    except FileNotFoundError:
        return None
    except OSError as e:   # a FIFO, a device, a huge file, unreadable: not a marker of ours
        raise CheckpointCorrupt(f"{path / MARKER_NAME}: cannot be read ({e.strerror})") from None
    except ValueError:
        marker = None
    if not isinstance(marker, dict) or marker.get("format") != MARKER_FORMAT:
        raise CheckpointCorrupt(f"{path / MARKER_NAME} is not a {MARKER_FORMAT} marker")
    return marker


def write_manifest(path: Path, manifest: dict[str, Any],
                   before_commit: Callable[[], None] | None = None) -> None:
    """The commit: the manifest written whole (``write_atomic``: temporary file, fsync, rename,
    fsync the step directory), then the parent fsynced, so the step directory's name is durable
    too. ``before_commit`` runs right before the rename (the lease's check): when it raises,
    nothing is committed."""
    write_atomic(path / MANIFEST_NAME, json.dumps(manifest, separators=(",", ":")), mode=0o644,
                 before_rename=before_commit)
    fsync_dir(path.parent)


class NotCommitted(CheckpointCorrupt):
    """The step directory has no manifest: a save that never finished (not damage)."""


def read_manifest(path: Path) -> dict[str, Any]:
    """The parsed manifest of a step directory. NotCommitted if there is none; CheckpointCorrupt
    if it cannot be read (permissions, I/O, not a file) or is malformed."""
    # Bounded (``read_bounded``): a manifest replaced by a FIFO, a link to /dev/zero or a huge
    # file is damage, found without blocking or reading without end; a symlink to a regular
    # file still reads (a checkpoint copied as a tree of links).
    try:
        raw = read_bounded(path / MANIFEST_NAME)
    except FileNotFoundError:
        raise NotCommitted(f"{path}: no {MANIFEST_NAME} (never committed)") from None
    except (NotARegularFile, TooLarge) as e:
        raise CheckpointCorrupt(f"{path / MANIFEST_NAME}: {e.strerror}: damaged, not a "
                                "manifest") from None
    except OSError as e:
        raise CheckpointCorrupt(f"{path / MANIFEST_NAME}: cannot be read ({e.strerror}); check "
                                "its permissions and the filesystem") from None
    try:
        man = parse_json(raw)
    except ValueError as e:
        raise CheckpointCorrupt(f"{path / MANIFEST_NAME}: unreadable manifest ({e})") from None
    if not isinstance(man, dict) or man.get("format") != FORMAT or not isinstance(
            man.get("files"), dict) or not isinstance(man.get("step"), int):
        raise CheckpointCorrupt(f"{path / MANIFEST_NAME}: not a {FORMAT} manifest")
    return man


@dataclass
class Entry:
    """One of our step directories as found on disk."""

    path: Path
    step: int
    attempt: int
    manifest: dict[str, Any] | None     # None: not committed, or damaged
    problem: str | None = None          # why a present manifest cannot be used (damaged)

    @property
    def committed(self) -> bool:
        """It has a manifest that parsed (its files may still turn out damaged)."""
        return self.manifest is not None

    @property
    def damaged(self) -> bool:
        """It has a manifest that cannot be read or parsed: committed once, now unusable."""
        return self.problem is not None

    def info(self) -> CheckpointInfo:
        m = self.manifest or {}
        return CheckpointInfo(step=self.step, path=self.path, reason=str(m.get("reason", "")),
                              committed_at=float(m.get("committed_at", 0.0)),
                              nbytes=int(m.get("nbytes", 0)),
                              world_size=int(m.get("world_size", 1)),
                              save_seconds=float(m.get("save_seconds", 0.0)),
                              blocked_seconds=float(m.get("blocked_seconds", 0.0)))

    def sort_key(self) -> tuple[int, float, int]:
        return (self.step, float((self.manifest or {}).get("committed_at", 0.0)), self.attempt)


def scan_one(path: Path) -> Entry | None:
    """The step directory ``path`` as an Entry (None if it is not one of ours). Never raises for
    a problem of this one directory: that is the Entry's ``problem``."""
    parsed = parse_name(path.name)
    if parsed is None:
        return None
    try:
        if not path.is_dir():
            return None
        return Entry(path, parsed[0], parsed[1], read_manifest(path))
    except NotCommitted:
        return Entry(path, parsed[0], parsed[1], None)
    except CheckpointCorrupt as e:
        return Entry(path, parsed[0], parsed[1], None, str(e))
    except OSError as e:
        return Entry(path, parsed[0], parsed[1], None,
                     f"{e.filename or path}: cannot be read ({e.strerror}); check its "
                     "permissions and the filesystem")


def scan(paths: RunPaths) -> list[Entry]:
    """Our step directories in the run's directory, oldest first (by step, then commit time). A
    directory whose manifest is present but unusable is included with its ``problem``. Raises
    OSError only when the directory itself cannot be listed (a missing one has no entries)."""
    out: list[Entry] = []
    try:
        names = os.listdir(paths.root)
    except FileNotFoundError:
        return out
    for name in names:
        entry = scan_one(paths.root / name)
        if entry is not None:
            out.append(entry)
    out.sort(key=Entry.sort_key)
    return out


def newest_committed(paths: RunPaths | None) -> int | None:
    """The newest committed step in the run's directory ``paths`` (None: none, or unknown).
    A supervisor reads it from the directory, not from rank 0's report: a rescue that
    survivors committed after rank 0 died is there too."""
    if paths is None:
        return None
    try:
        steps = [e.step for e in scan(paths) if e.committed]
    except OSError:
        return None
    return max(steps) if steps else None


def find_roots(top: Path, max_depth: int = 3, max_dirs: int = 2000) -> tuple[list[Path], bool]:
    """Checkpoint roots (directories holding step directories) at or below ``top``, at most
    ``max_depth`` levels down, looking at no more than ``max_dirs`` directories; and whether the
    search was complete. Step directories, symlinks and hidden directories are not entered: a
    user may point `ls` at a work directory (the demo's keeps ``resilient/checkpoints``)."""
    roots: list[Path] = []
    queue = [(top, 0)]
    seen = 0
    complete = True
    while queue:
        here, depth = queue.pop(0)
        seen += 1
        try:
            with os.scandir(here) as it:
                children = [(c.name, c.is_dir(), c.is_symlink()) for c in it]
        except OSError:
            continue
        if any(is_dir and parse_name(name) for name, is_dir, _ in children):
            roots.append(here)
            continue
        if depth >= max_depth:
            continue
        for name, is_dir, link in sorted(children):
            if is_dir and not link and not name.startswith("."):
                if seen + len(queue) >= max_dirs:
                    complete = False
                    break
                queue.append((here / name, depth + 1))
    return roots, complete


def check_owner(path: Path, allow_foreign_owner: bool) -> None:
    """Refuse files owned by another user: loading unpickles them (arbitrary code)."""
    if allow_foreign_owner:
        return
    uid = os.geteuid()
    st = path.stat()
    if st.st_uid != uid:
        raise CheckpointCorrupt(
            f"{path} is owned by uid {st.st_uid}, not by us (uid {uid}); checkpoints are "
            "unpickled on load, so foreign files are refused. If you trust it, chown it or set "
            "checkpoint.allow_foreign_owner: true")


def validate(entry: Entry, allow_foreign_owner: bool) -> None:
    """Cheap checks (no data read), the ones resume runs before loading: the manifest is
    consistent (``integrity.check_manifest``) and names this directory's step, every file is
    present with its size, and everything is ours. Any failure is a CheckpointCorrupt."""
    man = entry.manifest
    if man is None:
        raise CheckpointCorrupt(entry.problem or f"{entry.path}: not committed")
    if man["step"] != entry.step:
        raise CheckpointCorrupt(f"{entry.path}: the manifest says step {man['step']}, the "
                                f"directory name step {entry.step} (manifest damaged or "
                                "directory renamed)")
    integrity.check_manifest(entry.path, man)
    try:
        check_owner(entry.path, allow_foreign_owner)
        check_owner(entry.path / MANIFEST_NAME, allow_foreign_owner)
        for name, meta in man["files"].items():
            p = entry.path / name
            try:
                st = p.stat()
            except FileNotFoundError:
                raise CheckpointDamaged(f"{p}: listed in the manifest but missing") from None
            if st.st_size != meta["size"]:
                raise CheckpointDamaged(f"{p}: {st.st_size} bytes, manifest says {meta['size']}")
            check_owner(p, allow_foreign_owner)
    except OSError as e:
        raise CheckpointCorrupt(f"{e.filename or entry.path}: cannot be read ({e.strerror}); "
                                "check its permissions and the filesystem") from None


def file_crc(path: Path) -> int:
    """CRC-32 of a whole file, streamed (used for small files and full verification)."""
    crc = 0
    buf = bytearray(_READ_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
    return crc


def verify_files(path: Path, manifest: dict[str, Any], names: Iterable[str] | None = None,
                 progress: integrity.Progress | None = None) -> None:
    """Re-read files (default: all) and check every record's and file's CRC against the manifest
    (resume: .metadata; `verify`: everything). See ``integrity.verify_data``."""
    integrity.verify_data(path, manifest, names, progress)


def verify_entry(entry: Entry, progress: integrity.Progress | None = None) -> None:
    """Every check there is, for `kempner-resilience verify`: the cheap ones resume runs first
    (any owner accepted: nothing is loaded), the ``.metadata`` CRC, ``.metadata`` parsed and
    matched against the manifest's records, then every byte of every file."""
    validate(entry, allow_foreign_owner=True)
    man = entry.manifest or {}
    metadata = integrity.metadata_names(man)
    verify_files(entry.path, man, metadata)
    integrity.check_all_metadata(entry.path, man)
    verify_files(entry.path, man, [n for n in man["files"] if n not in metadata], progress)


def latest(paths: RunPaths, allow_foreign_owner: bool) -> CheckpointInfo | None:
    """The newest committed checkpoint of the run's directory that passes the cheap checks
    (manifest, file sizes, owner); bad ones are logged and skipped. Reads no data."""
    for entry in reversed(scan(paths)):
        if entry.damaged:
            log.warning("skipping checkpoint %s: %s", entry.path, entry.problem)
            continue
        if not entry.committed:
            continue
        try:
            validate(entry, allow_foreign_owner)
        except CheckpointCorrupt as e:
            log.warning("skipping checkpoint %s: %s", entry.path, e)
            continue
        return entry.info()
    return None


def mesh_text(manifest: dict[str, Any]) -> str:
    """A manifest's mesh for people, one word (``ls`` columns): ``replicate=2,shard=2`` for a
    sharded model, ``world=N`` for replicated or single-process state, ``-`` for neither."""
    mesh = manifest.get("mesh")
    if isinstance(mesh, dict) and isinstance(mesh.get("shape"), list):
        dims = mesh.get("dims") or [None] * len(mesh["shape"])
        return ",".join(f"{d}={s}" if d else str(s) for d, s in zip(dims, mesh["shape"]))
    if manifest.get("world_size") is not None:
        return f"world={manifest['world_size']}"
    return "-"
