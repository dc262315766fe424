"""State saved by other processes: an entry of the run's state whose save and load are done
elsewhere (a Ray worker group's actors, over their own process group), into a subdirectory of
the step directory, committed with the rest.

A value of ``state`` with ``save_into(directory, step)`` and ``load_from(directory, manifest)``
is such an entry (``Delegated``). At a save, once this process's own DCP files are written,
``save_into`` gets ``<step dir>/<name>/`` (made here) and returns the file table its writers
kept (``ChecksummingWriter.files``: each file's size, CRC-32 and records). The tables join the
manifest under ``<name>/``, so the one commit (rank 0's atomic rename) covers every process's
files, and resume, ``verify`` and retention check them as they check ours. At resume,
``load_from`` gets the same subdirectory and the part of the manifest that describes it
(``integrity.part``: names relative to it), before this process's own state is applied.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Mapping, Protocol, runtime_checkable

from kempner_resilience.checkpoint import integrity
from kempner_resilience.checkpoint.info import CheckpointError
from kempner_resilience.core.fileio import fsync_dir

__all__ = ["Delegated", "is_delegated", "merge_files", "save_parts", "load_parts", "PART_RE"]

#: A part's name: a state key (no dots, no slashes), so one path level under the step directory.
PART_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_-]*$")


@runtime_checkable
class Delegated(Protocol):
    """An entry of ``state`` that other processes save and load."""

    def save_into(self, directory: Path, step: int) -> Mapping[str, Mapping[str, Any]]:
        """Write this entry's state of ``step`` into ``directory`` (it exists, empty) and return
        every file written there: ``{name: {"size", "crc32", "rank", "records"?}}``, as
        ``ChecksummingWriter.files`` keeps them. Raise to fail the save (nothing is committed)."""
        ...

    def load_from(self, directory: Path, manifest: Mapping[str, Any]) -> None:
        """Load this entry's state from ``directory``; ``manifest`` describes its files
        (``{"files": {...}}``, the names relative to ``directory``). Raise ``CheckpointError``
        to make resume try an older checkpoint."""
        ...


def is_delegated(value: Any) -> bool:
    """Whether ``value`` is saved and loaded by other processes (see ``Delegated``)."""
    return callable(getattr(value, "save_into", None)) and callable(
        getattr(value, "load_from", None))


def merge_files(files: dict[str, Any], name: str, table: Mapping[str, Any]) -> None:
    """Add entry ``name``'s file ``table`` to a manifest's ``files``, under ``<name>/``. A table
    naming anything but a plain file of the subdirectory is refused: the manifest must never
    point outside the step directory."""
    if not PART_RE.match(name):
        raise CheckpointError(f"state key {name!r} cannot name a subdirectory of a step "
                              "directory: use letters, digits, '_' and '-'")
    for file, meta in table.items():
        if not isinstance(file, str) or "/" in file or file in ("", ".", ".."):
            raise CheckpointError(f"state[{name!r}] saved a file named {file!r}: only plain "
                                  "file names of its own subdirectory can be committed")
        files[f"{name}/{file}"] = dict(meta)


def save_parts(entries: Mapping[str, Any], path: Path, step: int,
               own: Mapping[str, Any]) -> dict[str, Any]:
    """Rank 0, its own files written into step directory ``path``: each entry saved into its
    subdirectory (made here, durable before any file goes in); ``own`` (this rank's file
    table) with every entry's files added under ``<name>/``."""
    files = dict(own)
    for name, entry in entries.items():
        sub = path / name
        sub.mkdir()
        fsync_dir(path)
        merge_files(files, name, entry.save_into(sub, step))
    return files


def load_parts(entries: Mapping[str, Any], path: Path, manifest: dict[str, Any]) -> str | None:
    """Each entry loaded from its subdirectory of checkpoint ``path``; why not, or None. An
    entry the checkpoint has no part for cannot resume: it is refused, never started fresh
    beside a resumed rest."""
    saved = set(integrity.part_names(manifest))
    for name, entry in entries.items():
        if name not in saved:
            return (f"{path}: holds no state of {name!r} (saved by other processes into "
                    f"{name}/); it cannot resume this state")
        entry.load_from(path / name, integrity.part(manifest, name))
    return None
