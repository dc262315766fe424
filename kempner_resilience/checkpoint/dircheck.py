"""Can checkpoints be written under ``checkpoint.dir``? Checked at start, before any training.

A missing parent, a file where the directory should be, no write permission, or too little
space for about one save: each is one sentence naming the problem and the fix.
"""

from __future__ import annotations

import contextlib
import os
import socket
from pathlib import Path
from typing import Callable

from kempner_resilience.checkpoint.info import CheckpointError
from kempner_resilience.core.runpaths import RunPaths

__all__ = ["local_problem", "disk_full", "out_of_inodes", "note_inodes", "full_words",
           "INODES_MARK"]

_GIB = 2**30


# Appended to a disk-full error when the filesystem ran out of inodes, not of bytes: the same
# ENOSPC, but `df -h` shows free space and "the disk is full" sends the user the wrong way.
INODES_MARK = "[no free inodes]"


def disk_full(text: str) -> bool:
    """Whether an error text says the filesystem is full (or the quota spent)."""
    return "No space left on device" in text or "Disk quota exceeded" in text or \
        "[Errno 28]" in text or "[Errno 122]" in text


def out_of_inodes(path: Path) -> bool:
    """Whether the filesystem holding ``path`` has no inode left for us (``statvfs``'s
    ``f_favail``). Filesystems without a fixed inode table (btrfs, many network ones) report
    0 inodes in all: never "out of inodes"."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_files > 0 and st.f_favail == 0


def note_inodes(text: str, path: Path) -> str:
    """``text`` marked with ``INODES_MARK`` when it is a disk-full error and the filesystem
    holding ``path`` is out of inodes. Call it where the error happened, before anything is
    removed: removing the partial save frees inodes again."""
    if disk_full(text) and INODES_MARK not in text and out_of_inodes(path):
        return f"{text} {INODES_MARK}"
    return text


def full_words(text: str, root: Path) -> tuple[str, str]:
    """(what is full, the fix) for a disk-full error ``text`` about ``root``."""
    if INODES_MARK in text:
        return (f"the filesystem holding {root} has no free inodes (file entries) left, though "
                "`df -h` may show free space (`df -i` shows 100%)",
                "Delete files there (many small files use up the inodes) or point "
                "checkpoint.dir at another filesystem")
    return (f"the disk holding {root} is full (No space left on device)",
            "Free space there or point checkpoint.dir at a larger filesystem")


def local_problem(paths: RunPaths, state_nbytes: int, rank: int,
                  on_ok: Callable[[], None] | None = None) -> str | None:
    """What keeps this rank from writing checkpoints into the run's directory (created when
    missing), or None; ``on_ok`` runs when the directory is usable (rank 0 finishes old
    deletions there)."""
    root = paths.root
    try:
        if not root.exists():
            if not root.parent.is_dir():
                raise CheckpointError(
                    f"checkpoint.dir {root}: the parent directory {root.parent} does not "
                    "exist; create it (mkdir -p) or set checkpoint.dir to an existing location")
            root.mkdir(exist_ok=True)
        elif not root.is_dir():
            raise CheckpointError(f"checkpoint.dir {root} exists but is not a directory; "
                                  "remove it or choose another checkpoint.dir")
        _probe_write(paths, rank)
        st = os.statvfs(root)
        free = st.f_bavail * st.f_frsize
        need = int(state_nbytes * 1.05) + (1 << 20)
        # A filesystem without a fixed size (ramfs, some network ones) reports 0 blocks in all:
        # it is never "full" by statvfs, a failed write says so when it is.
        if st.f_blocks > 0 and free < need:
            raise CheckpointError(
                f"checkpoint.dir {root} is (nearly) full: {free / _GIB:.3f} GiB free, one "
                f"checkpoint needs ~{need / _GIB:.3f} GiB; free space there or point "
                "checkpoint.dir at a larger filesystem")
        if on_ok is not None:
            on_ok()
    except CheckpointError as e:
        return str(e)
    except OSError as e:
        return f"checkpoint.dir {root}: {e}; fix it or choose another checkpoint.dir"
    return None


def _probe_write(paths: RunPaths, rank: int) -> None:
    root = paths.root
    probe = paths.probe(socket.gethostname(), rank, os.getpid())
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, b"\0" * 4096)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        if disk_full(str(e)) and out_of_inodes(root):
            raise CheckpointError(f"checkpoint.dir {root} has no free inodes (file entries) "
                                  "left, though `df -h` may show free space (`df -i` shows "
                                  "100%); delete files there (many small files use up the "
                                  "inodes) or point checkpoint.dir at another filesystem") from e
        if disk_full(str(e)):
            raise CheckpointError(f"checkpoint.dir {root} is full ({e.strerror}); free space "
                                  "there or point checkpoint.dir at a larger filesystem") from e
        raise CheckpointError(f"checkpoint.dir {root} is not writable ({e.strerror}); fix "
                              "its permissions/mount or choose another checkpoint.dir") from e
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()
