"""Integrity checks of one checkpoint against its manifest: one implementation for resume and
`kempner-resilience verify`, so what they accept cannot drift apart.

Three levels, each reading more than the one before:

* ``check_manifest`` reads nothing but the manifest: file names, sizes, checksums present, the
  records of each data file tiling it exactly, and their CRCs combining to the file's CRC.
* ``check_metadata`` compares DCP's ``.metadata`` with the manifest: every storage entry DCP
  would read (file, offset, length) is exactly one manifest record, and every record is read.
  A save without collectives (``use_collectives=False``) has one ``__<rank>.metadata`` per rank
  instead, each naming its rank's records (``metadata_names``, ``check_all_metadata``).
* ``verify_data`` reads every byte: each record's CRC and each file's size and CRC.

Resume runs the first two before loading (``.metadata`` CRC included when ``checkpoint.verify``)
and checks record CRCs while it loads (``VerifyingReader``, which runs the second level itself
when used alone as DCP's storage reader); `verify` runs all three.
Every failure is a ``CheckpointCorrupt`` naming the file and what is wrong with it.

Nothing here imports torch: `ls` and `verify` start in a fraction of a second.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import zlib
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable

from kempner_resilience.checkpoint.crc import crc32_combine
from kempner_resilience.checkpoint.info import CheckpointCorrupt, CheckpointDamaged
from kempner_resilience.core.fileio import open_regular

__all__ = ["METADATA_NAME", "check_all_metadata", "check_manifest", "check_metadata",
           "load_metadata", "metadata_name", "metadata_names", "parse_metadata", "part",
           "part_names", "verify_data"]

METADATA_NAME = ".metadata"
MARKER_NAME = "OWNER.json"        # layout's ownership marker: a whole-file checksum, no records
_DATA_RE = re.compile(r"^__\d+_\d+\.distcp$")
_RANK_METADATA_RE = re.compile(r"^__\d+\.metadata$")      # use_collectives=False: one per rank
# A part saved by other processes (``checkpoint/delegated.py``): ``<part>/<file>``.
_PART_RE = re.compile(r"^([A-Za-z0-9_][A-Za-z0-9_-]*)/(.+)$")
_READ_CHUNK = 16 << 20

# (bytes done, bytes total, seconds since start): progress of ``verify_data``.
Progress = Callable[[int, int, float], None]


def _uint(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def metadata_name(rank: int | None = None) -> str:
    """DCP's metadata file: ``.metadata``, or rank ``rank``'s own in a save without collectives."""
    return METADATA_NAME if rank is None else f"__{rank}{METADATA_NAME}"


def metadata_names(manifest: dict[str, Any]) -> list[str]:
    """The metadata files the manifest lists: ``.metadata``, or each rank's own."""
    return sorted(n for n in manifest["files"]
                  if n == METADATA_NAME or _RANK_METADATA_RE.match(n))


def _whole_file(name: str) -> bool:
    """A file the manifest checksums whole (no records)."""
    return name in (METADATA_NAME, MARKER_NAME) or bool(_RANK_METADATA_RE.match(name))


def part_names(manifest: dict[str, Any]) -> list[str]:
    """The parts other processes saved into subdirectories (``checkpoint/delegated.py``)."""
    return sorted({m.group(1) for n in manifest["files"] if (m := _PART_RE.match(n))})


def part(manifest: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    """The manifest as one DCP checkpoint sees it: the files of part ``name`` (names relative
    to its subdirectory), or with None the step directory's own files. The other keys stay."""
    if name is None:
        files = {n: m for n, m in manifest["files"].items() if "/" not in n}
    else:
        files = {n[len(name) + 1:]: m for n, m in manifest["files"].items()
                 if n.startswith(f"{name}/")}
    return {**manifest, "files": files}


def check_manifest(path: Path, manifest: dict[str, Any]) -> None:
    """Whether the manifest of ``path`` describes a checkpoint our writer could have produced;
    reads no file. A record CRC or a file CRC edited alone is caught here: they stop adding up."""
    files = manifest["files"]
    for sub in [None, *part_names(manifest)]:
        if not metadata_names(part(manifest, sub)):
            where = path if sub is None else path / sub
            raise CheckpointCorrupt(f"{where}: the manifest lists no {METADATA_NAME} (manifest "
                                    "damaged)")
    for name, meta in files.items():
        inner = _PART_RE.match(name)
        base = inner.group(2) if inner else name
        if inner and (base == MARKER_NAME or "/" in base):
            base = ""       # a part holds DCP's files only, one level down
        if not _whole_file(base) and not _DATA_RE.match(base):
            raise CheckpointCorrupt(f"{path}: the manifest lists {name!r}, which is not a "
                                    "checkpoint file (manifest damaged)")
        where = path / name
        if not isinstance(meta, dict) or not _uint(meta.get("size")) or not _uint(
                meta.get("crc32")):
            raise CheckpointCorrupt(f"{where}: the manifest has no valid size and checksum for "
                                    "it (manifest damaged)")
        if _whole_file(base):
            continue
        records = meta.get("records")
        if not isinstance(records, list):
            raise CheckpointCorrupt(f"{where}: the manifest has no record list for it "
                                    "(manifest damaged)")
        pos = crc = 0
        for rec in records:
            if not (isinstance(rec, list) and len(rec) >= 3 and all(_uint(x) for x in rec[:3])):
                raise CheckpointCorrupt(f"{where}: malformed record {rec!r} in the manifest "
                                        "(manifest damaged)")
            if rec[0] != pos:
                raise CheckpointCorrupt(f"{where}: the manifest's records do not tile the file "
                                        f"(a record at byte {rec[0]}, expected one at {pos}; "
                                        "manifest damaged)")
            crc = crc32_combine(crc, rec[2], rec[1])
            pos += rec[1]
        if pos != meta["size"]:
            raise CheckpointCorrupt(f"{where}: the manifest's records cover {pos} bytes but it "
                                    f"gives the file {meta['size']} (manifest damaged)")
        if crc != meta["crc32"]:
            raise CheckpointCorrupt(f"{where}: the record checksums in the manifest do not "
                                    "combine to its file checksum (manifest damaged)")


def check_metadata(path: Path, metadata: Any, manifest: dict[str, Any],
                   name: str = METADATA_NAME, complete: bool = True) -> set[tuple[str, int]]:
    """Whether DCP's parsed metadata file ``name`` (``metadata``) and the manifest describe the
    same bytes: a load reads exactly the (file, offset, length) it names, so each must be one
    CRC-checked manifest record; with ``complete``, a record nobody reads means the two
    disagree (a rank's own metadata names only its rank's records). Returns the records named."""
    where = path / name
    storage = getattr(metadata, "storage_data", None)
    tensors = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(storage, dict) or not isinstance(tensors, dict):
        raise CheckpointCorrupt(f"{where}: not the metadata of a DCP checkpoint (file damaged)")
    records = {(file, rec[0]): rec[1] for file, meta in manifest["files"].items()
               for rec in meta.get("records", ())}
    seen: dict[tuple[str, int], Any] = {}
    for index, info in storage.items():
        fqn = getattr(index, "fqn", index)
        key = (getattr(info, "relative_path", None), getattr(info, "offset", None))
        length = getattr(info, "length", None)
        if key not in records:
            raise CheckpointCorrupt(f"{where}: {fqn!r} is stored at {key[0]}@{key[1]}, where the "
                                    "manifest has no record (.metadata or manifest damaged)")
        if records[key] != length:
            raise CheckpointCorrupt(f"{where}: {fqn!r} is {length} bytes at {key[0]}@{key[1]}, "
                                    f"the manifest's record there is {records[key]} bytes "
                                    "(.metadata or manifest damaged)")
        if key in seen:
            raise CheckpointCorrupt(f"{where}: {fqn!r} and {seen[key]!r} are both stored at "
                                    f"{key[0]}@{key[1]} (file damaged)")
        if fqn not in tensors:
            raise CheckpointCorrupt(f"{where}: {fqn!r} has stored data but no entry in the "
                                    "state dict metadata (file damaged)")
        seen[key] = fqn
    if complete:
        _all_read(path, records, set(seen))
    return set(seen)


def _all_read(path: Path, records: Any, seen: set[tuple[str, int]]) -> None:
    unread = sorted(set(records) - seen)
    if unread:
        name, offset = unread[0]
        raise CheckpointCorrupt(f"{path / name}@{offset}: a record in the manifest that "
                                f"{METADATA_NAME} does not name ({len(unread)} such; .metadata "
                                "or manifest damaged)")


def check_all_metadata(path: Path, manifest: dict[str, Any]) -> None:
    """Every metadata file the manifest lists, parsed (``load_metadata``) and matched against
    it; together they name every record exactly once. A part other processes saved
    (``part_names``) is one DCP checkpoint of its own, in its subdirectory: checked alike."""
    for sub in part_names(manifest):
        _check_all_metadata(path / sub, part(manifest, sub))
    _check_all_metadata(path, part(manifest))


def _check_all_metadata(path: Path, manifest: dict[str, Any]) -> None:
    seen: set[tuple[str, int]] = set()
    names = metadata_names(manifest)
    for name in names:
        named = check_metadata(path, load_metadata(path, name), manifest, name,
                               complete=len(names) == 1)
        if seen & named:
            file, offset = sorted(seen & named)[0]
            raise CheckpointCorrupt(f"{path / name}: names {file}@{offset}, which another "
                                    "rank's metadata names too (file damaged)")
        seen |= named
    _all_read(path, {(file, rec[0]) for file, meta in manifest["files"].items()
                     for rec in meta.get("records", ())}, seen)


class _Stub:
    """Stands in for a torch type or value a ``.metadata`` pickle names, keeping what it was
    given (constructor arguments, attributes): enough for ``check_metadata``, and unpickling
    it runs no code and needs no torch import."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.__dict__["_args"] = args

    def __setstate__(self, state: Any) -> None:
        parts = state if isinstance(state, tuple) and len(state) == 2 and all(
            s is None or isinstance(s, dict) for s in state) else (state,)
        for part in parts:
            if isinstance(part, dict):
                self.__dict__.update(part)
            elif part is not None:
                self.__dict__["_state"] = part


# Harmless builtins a .metadata may hold as themselves; torch and pathlib names become stubs;
# anything else is refused: a DCP .metadata never names it, and importing it could run code.
_REAL = {("collections", "OrderedDict"), ("builtins", "set"), ("builtins", "frozenset"),
         ("builtins", "slice"), ("builtins", "complex")}


def load_metadata(path: Path, name: str = METADATA_NAME) -> Any:
    """DCP's ``.metadata`` (or ``name``) of checkpoint ``path``, parsed without importing what
    it names (see ``_Stub``): the storage entries and state dict keys ``check_metadata``
    compares."""
    where = path / name
    try:
        # Not a FIFO nor a device (a link to /dev/zero would unpickle without end).
        with os.fdopen(open_regular(where), "rb") as f:
            return parse_metadata(where, f)
    except OSError as e:
        raise CheckpointCorrupt(f"{where}: cannot be read ({e.strerror}); check its permissions "
                                "and the filesystem") from None


def parse_metadata(where: Path, source: BinaryIO | bytes) -> Any:
    """A metadata file's bytes (or open file), parsed as ``load_metadata`` parses: no code
    run, nothing imported. ``where`` names it in the error."""
    stubs: dict[tuple[str, str], type] = {}

    class _Unpickler(pickle.Unpickler):
        def find_class(self, module: str, name: str) -> Any:
            if (module, name) in _REAL:
                return super().find_class(module, name)
            if module == "torch" or module.startswith("torch.") or module == "pathlib":
                return stubs.setdefault((module, name), type(name, (_Stub,), {}))
            raise CheckpointCorrupt(f"{where}: refers to {module}.{name}, which a DCP "
                                    ".metadata never holds; not loaded (file damaged or not "
                                    "ours)")

    try:
        return _Unpickler(io.BytesIO(source) if isinstance(source, bytes) else source).load()
    except (CheckpointCorrupt, OSError):
        raise
    except Exception as e:      # noqa: BLE001 - unpickling damaged bytes raises anything
        raise CheckpointCorrupt(f"{where}: does not parse ({type(e).__name__}: {e}; file "
                                "damaged)") from None


def verify_data(path: Path, manifest: dict[str, Any], names: Iterable[str] | None = None,
                progress: Progress | None = None) -> None:
    """Re-read files of checkpoint ``path`` (default: all) and check each record's CRC, then the
    file's size and CRC. Call ``check_manifest`` first: records are assumed to tile each file."""
    import time

    files = manifest["files"]
    chosen = sorted(files if names is None else names)
    for name in chosen:
        if name not in files:
            raise CheckpointCorrupt(f"{path / name}: not listed in the manifest (a checkpoint "
                                    "of another layout, or the manifest damaged)")
    total = sum(int(files[n]["size"]) for n in chosen)
    buf = bytearray(min(_READ_CHUNK, max(total, 1)))
    view = memoryview(buf)
    done, t0 = 0, time.monotonic()
    for name in chosen:
        meta = files[name]
        p = path / name
        records = meta.get("records")
        if records is None:          # .metadata: one whole-file checksum
            records = [[0, meta["size"], meta["crc32"]]]
        got = 0
        try:
            with os.fdopen(open_regular(p), "rb", buffering=0) as f:   # never a FIFO
                for rec in records:
                    offset, length, want = rec[0], rec[1], rec[2]
                    crc, left = 0, length
                    while left:
                        n = f.readinto(view[:min(left, len(buf))])
                        if not n:
                            raise CheckpointDamaged(
                                f"{p}: ends at byte {offset + length - left}, the manifest "
                                f"says {meta['size']} bytes (truncated)")
                        crc = zlib.crc32(view[:n], crc)
                        left -= n
                        done += n
                        if progress is not None:
                            progress(done, total, time.monotonic() - t0)
                    if crc != want:
                        at = f"@{offset}" if "records" in meta else ""
                        raise CheckpointDamaged(f"{p}{at}: checksum mismatch (file damaged)")
                    got = crc32_combine(got, crc, length)
                if f.read(1):
                    raise CheckpointDamaged(f"{p}: longer than the {meta['size']} bytes the "
                                            "manifest says (file damaged)")
        except FileNotFoundError:
            raise CheckpointDamaged(f"{p}: listed in the manifest but missing") from None
        except OSError as e:
            raise CheckpointCorrupt(f"{p}: cannot be read ({e.strerror}); check its "
                                    "permissions and the filesystem") from None
        if got != meta["crc32"]:
            raise CheckpointDamaged(f"{p}: checksum mismatch (file damaged)")
