"""Cold reads for the benches without root: drop the page cache, or evict each file from it.

``/proc/sys/vm/drop_caches`` needs root, and even with it (these containers run as root) it
empties the cache of every other job on a shared machine. So, first, ``posix_fadvise(POSIX_FADV_DONTNEED)`` on
each file (after its dirty pages are written: fsync first, DONTNEED skips dirty pages) evicts
that file's clean pages, which is all a read benchmark needs. ``resident`` (``mincore`` over a
shared read-only mapping) says what fraction of a file is still cached, so the bench can show
that the eviction worked instead of trusting it.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
_MAP_FAILED = ctypes.c_void_p(-1).value


def drop_caches() -> bool:
    """Drop the whole page cache (root only); False when refused."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def _files(paths: tuple[Path | str, ...]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        out.extend(q for q in (p.rglob("*") if p.is_dir() else [p]) if q.is_file())
    return out


def evict(*paths: Path | str) -> int:
    """fsync then ``POSIX_FADV_DONTNEED`` every file under ``paths``; returns bytes covered."""
    total = 0
    for q in _files(paths):
        fd = os.open(q, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            total += os.fstat(fd).st_size
        finally:
            os.close(fd)
    return total


def resident(*paths: Path | str) -> float:
    """Fraction (0..1) of the pages of every file under ``paths`` in the page cache."""
    pages = cached = 0
    for q in _files(paths):
        size = q.stat().st_size
        if not size:
            continue
        with open(q, "rb") as f:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, f.fileno(), 0)
        if addr in (None, _MAP_FAILED):
            raise OSError(ctypes.get_errno(), f"mmap {q}")
        try:
            n = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = (ctypes.c_ubyte * n)()
            if _libc.mincore(addr, size, vec):
                raise OSError(ctypes.get_errno(), f"mincore {q}")
            pages += n
            cached += sum(b & 1 for b in bytes(vec))
        finally:
            _libc.munmap(addr, size)
    return cached / pages if pages else 0.0


def make_cold(*paths: Path | str) -> str:
    """Make the next read of ``paths`` cold; returns how. Per-file eviction first (touches
    nobody else's cache), checked with ``resident``; ``drop_caches`` only when more than 1%
    stayed cached (and it is permitted)."""
    evict(*paths)
    left = resident(*paths)
    if left > 0.01 and drop_caches():
        return f"drop_caches (fadvise left {left:.1%} cached)"
    return f"fadvise DONTNEED, {left:.1%} still cached"
