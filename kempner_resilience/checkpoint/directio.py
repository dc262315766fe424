"""Writing a checkpoint file past the page cache (``O_DIRECT``), from buffers touched at set-up.

Why: a buffered write copies every byte into page-cache pages the kernel takes from free memory
at that moment, then the fsync writes them out. On a VM whose freed memory the host takes back
(these machines; many clouds), each such page costs a host fault on first touch, and several
writer threads doing it at once on a small node fight over the same lock: in the shutdown-vs-dd bench's setting
(0.94 GiB of Adam state, 2 cores) the buffered save took 1.6-5 s where one thread writing
``O_DIRECT`` from warm buffers took 0.7-0.9 s. Here each writer thread copies its records into
two page-aligned buffers allocated and touched when the run was set up (``DirectPool.reserve``),
and one helper thread writes a full buffer with ``O_DIRECT`` while the other one fills: no page
cache, no cold pages, and the fsync at the end has only the tail and the metadata left. The
touching (64 MiB by default, 40-100 ms of page faults here) is a thread's ``memset`` without the
GIL, so the rest of the set-up (the resume) goes on meanwhile; the first lease waits for it.

The last partial block of a file (its length is whatever the records add up to, ``O_DIRECT``
wants whole blocks) goes through the ordinary descriptor, at its offset. The file format is
unchanged (``writer.py`` decides what goes into it).

``checkpoint.direct_io`` (``KEMPNER_RESILIENCE_DIRECT_IO`` overrides it) picks the mode. The
buffers (2 per writer thread, 8 MiB each) are host memory the run holds: they count against
``checkpoint.staging_cap_gib`` (at most half of it; ``hostbuf`` sizes the staging buffers
within the rest). At start-up (``CheckpointManager.check_dir``) ``refusal`` asks the directory's
filesystem: one that refuses ``O_DIRECT`` (ramfs and some network filesystems at open, others
at the first write; tmpfs took it from Linux 6.6 on) is a start-up error under ``on``, and under
``auto`` the buffers are given back and the files written through the page cache, said once. A
filesystem that refuses later, at a save, gets the same bytes through the ordinary descriptor
(a save is never lost over how it is written), said once too: a warning under ``on``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import socket
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

from kempner_resilience.config import CheckpointConfig, ConfigError, DirectIOMode
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.runpaths import RunPaths

__all__ = ["DirectPool", "DirectSink", "ENV_DIRECT_IO", "mode_of", "refusal", "reserve", "settle"]

log = get_logger(__name__)

ENV_DIRECT_IO = "KEMPNER_RESILIENCE_DIRECT_IO"
"""Overrides ``checkpoint.direct_io``: 0 or off, 1 or on, auto (the A/B of
``bench/shutdown_vs_dd_bench.py`` sets 0: the files written through the page cache)."""

_ENV_VALUES = {"0": DirectIOMode.OFF, "off": DirectIOMode.OFF, "false": DirectIOMode.OFF,
               "1": DirectIOMode.ON, "on": DirectIOMode.ON, "true": DirectIOMode.ON,
               "auto": DirectIOMode.AUTO}

_BUF_BYTES = 8 << 20        # one O_DIRECT write: large enough to stream at disk speed
_ALIGN = 4096               # the largest logical block size O_DIRECT asks alignment for
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_FIX = ("set checkpoint.direct_io: auto (the files are then written through the page cache "
        "there) or off, or point checkpoint.dir at a filesystem that takes O_DIRECT")


def mode_of(configured: DirectIOMode) -> DirectIOMode:
    """The mode in force: ``KEMPNER_RESILIENCE_DIRECT_IO`` when set, else ``configured``."""
    raw = os.environ.get(ENV_DIRECT_IO, "").strip()
    if not raw:
        return configured
    if raw.lower() not in _ENV_VALUES:
        raise ConfigError([(ENV_DIRECT_IO, f"{raw[:40]!r} is not one of 0, off, 1, on, auto "
                            "(it overrides checkpoint.direct_io); unset it or give one of them")])
    return _ENV_VALUES[raw.lower()]


def _fstype(path: Path) -> str:
    """The type of the filesystem holding ``path`` (``/proc/mounts``' longest mount point
    above it), or "" where that cannot be told: for messages only."""
    best, kind = "", ""
    target = os.path.realpath(path)
    with contextlib.suppress(OSError):
        with open("/proc/mounts", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mnt = fields[1].replace("\\040", " ")
                inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best):
                    best, kind = mnt, fields[2]
    return kind


def refusal(paths: RunPaths, rank: int) -> str | None:
    """Why the filesystem holding the run's directory refuses ``O_DIRECT`` (at open, or at the
    first aligned write, as some network filesystems do), or None when it takes it. Writes and
    removes the start-up check's probe file."""
    probe = paths.probe(socket.gethostname(), rank, os.getpid())
    kind = _fstype(paths.root)
    where = f"{paths.root}" + (f" ({kind})" if kind else "")
    if not _O_DIRECT:
        return f"this platform has no O_DIRECT (checkpoint.dir {where})"
    buf = mmap.mmap(-1, _ALIGN)            # page-aligned, as O_DIRECT wants
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | _O_DIRECT,
                     0o600)
        try:
            os.pwrite(fd, memoryview(buf), 0)
        finally:
            os.close(fd)
    except OSError as e:
        return f"checkpoint.dir {where} refuses O_DIRECT ({e.strerror or e})"
    finally:
        buf.close()
        with contextlib.suppress(OSError):
            probe.unlink()
    return None


class DirectPool:
    """Two page-aligned, touched buffers per writer thread; ``lease()`` one pair per file.
    ``mode`` is the one in force (auto or on); ``refused`` says once that a file went
    buffered."""

    def __init__(self, pairs: list[tuple[mmap.mmap, mmap.mmap]],
                 mode: DirectIOMode = DirectIOMode.AUTO, *, touch: bool = False) -> None:
        self._free = list(pairs)
        self._all = list(pairs)
        self.mode = mode
        self._lock = threading.Lock()
        self._said = False
        self._touched = threading.Event()
        if not touch:
            self._touched.set()
            return
        # First-touch faults belong to set-up, not to a save; ctypes.memset runs without the
        # GIL (an mmap's MAP_POPULATE would hold it), so the set-up goes on while they happen.
        threading.Thread(target=self._touch, name="kempner-directio-touch", daemon=True).start()

    def _touch(self) -> None:
        try:
            for pair in self._all:
                for buf in pair:
                    view = (ctypes.c_char * len(buf)).from_buffer(buf)
                    ctypes.memset(ctypes.addressof(view), 0, len(buf))
                    del view            # the mmap can be closed only without exports
        except Exception as e:  # noqa: BLE001 - untouched buffers still write, only slower
            log.debug("cannot touch the O_DIRECT buffers ahead of the first save: %s", e)
        finally:
            self._touched.set()

    @classmethod
    def reserve(cls, threads: int, buf_bytes: int = _BUF_BYTES, *,
                cap_bytes: int | None = None,
                mode: DirectIOMode = DirectIOMode.AUTO) -> "DirectPool | None":
        """Allocate the buffers now and touch them in a thread of their own (set-up, not the
        signal path; ``lease`` waits for the touching to end): two per thread of
        ``buf_bytes`` (smaller, a multiple of 4 KiB, to fit ``cap_bytes``; fewer pairs of 4 KiB
        below that: threads without one write buffered). None where ``O_DIRECT`` does not exist,
        ``mode`` is off, or ``cap_bytes`` holds not even one pair of 4 KiB."""
        if mode is DirectIOMode.OFF or not _O_DIRECT:
            return None
        threads = max(1, threads)
        size, count = buf_bytes, threads
        if cap_bytes is not None:
            share = (cap_bytes // (2 * threads)) // _ALIGN * _ALIGN
            size = min(buf_bytes, share) if share >= _ALIGN else _ALIGN
            count = threads if share >= _ALIGN else min(threads, cap_bytes // (2 * _ALIGN))
        if count < 1:
            return None
        pairs = [(mmap.mmap(-1, size), mmap.mmap(-1, size)) for _ in range(count)]
        return cls(pairs, mode, touch=True)

    @property
    def nbytes(self) -> int:
        """Host memory the buffers hold."""
        return sum(len(b) for pair in self._all for b in pair)

    def describe(self) -> str:
        """``0.06 GiB O_DIRECT write buffers (4 x 2 x 8 MiB)``."""
        size = len(self._all[0][0]) if self._all else 0
        each = f"{size >> 20} MiB" if size >= 1 << 20 else f"{size >> 10} KiB"
        return (f"{self.nbytes / 2**30:.2f} GiB O_DIRECT write buffers "
                f"({len(self._all)} x 2 x {each})")

    @contextlib.contextmanager
    def lease(self) -> Iterator[tuple[mmap.mmap, mmap.mmap] | None]:
        """A pair for the calling thread, or None when all are taken (it writes buffered)."""
        self._touched.wait()
        with self._lock:
            pair = self._free.pop() if self._free else None
        try:
            yield pair
        finally:
            if pair is not None:
                with self._lock:
                    self._free.append(pair)

    def refused(self, why: str) -> None:
        """A file of a save went through the page cache because the filesystem refused
        ``O_DIRECT`` (``why``): said once per run, as a warning when ``direct_io`` is on."""
        with self._lock:
            if self._said:
                return
            self._said = True
        if self.mode is DirectIOMode.ON:
            log.warning("checkpoint.direct_io is on, but the filesystem refused O_DIRECT at a "
                        "save (%s): that save's files, and any such later, are written through "
                        "the page cache (the save is kept); %s", why, _FIX)
        else:
            log.info("checkpoint.direct_io: auto: the filesystem refused O_DIRECT at a save "
                     "(%s); its files are written through the page cache", why)

    def release(self) -> None:
        """Give the buffers back (the filesystem refused ``O_DIRECT`` at start-up)."""
        self._touched.wait()
        with self._lock:
            pairs, self._all, self._free = self._all, [], []
        for pair in pairs:
            for buf in pair:
                buf.close()


def reserve(config: CheckpointConfig) -> DirectPool | None:
    """This rank's ``O_DIRECT`` buffers for ``config``: the mode in force (``mode_of``), at most
    half of ``staging_cap_gib`` (the staging buffers get the rest). Raises ``ConfigError`` for
    ``direct_io: on`` where it cannot be (no ``O_DIRECT`` here, a cap too small for a pair)."""
    mode = mode_of(config.direct_io)
    pool = DirectPool.reserve(config.io_threads, cap_bytes=int(config.staging_cap_gib * 2**30)
                              // 2, mode=mode)
    if pool is None and mode is DirectIOMode.ON:
        why = ("this platform has no O_DIRECT" if not _O_DIRECT else
               f"checkpoint.staging_cap_gib={config.staging_cap_gib:g} leaves no room for "
               f"two {_ALIGN >> 10} KiB buffers; raise it")
        raise ConfigError([("checkpoint.direct_io", f"on, but {why}; or set "
                            "checkpoint.direct_io: auto or off")])
    return pool


def settle(pool: DirectPool | None, paths: RunPaths, rank: int) -> tuple[DirectPool | None,
                                                                         str | None]:
    """At start-up, once the run's directory exists: (the pool to keep, a start-up problem).
    Under ``on`` a filesystem that refuses ``O_DIRECT`` is a problem naming the key and the
    fix; under ``auto`` the buffers are given back and rank 0 says so once."""
    if pool is None:
        return None, None
    why = refusal(paths, rank)
    if why is None:
        return pool, None
    if pool.mode is DirectIOMode.ON:
        return pool, f"checkpoint.direct_io is on, but {why}; {_FIX}"
    pool.release()
    say = log.info if rank == 0 else log.debug
    say("checkpoint.direct_io: auto: %s; checkpoint files are written through the page cache",
        why)
    return None, None


class DirectSink:
    """The bytes of one file, in order, through a buffer pair to an ``O_DIRECT`` descriptor.

    ``fd`` is the file's ordinary (buffered) descriptor, which the caller fsyncs and closes;
    ``close`` must be called before that fsync (it writes what is still buffered).
    """

    def __init__(self, path: str | os.PathLike[str], fd: int,
                 pair: tuple[mmap.mmap, mmap.mmap],
                 on_refused: Callable[[str], None] | None = None) -> None:
        self.fd = fd
        self._on_refused = on_refused
        try:
            self.dfd: int | None = os.open(path, os.O_WRONLY | os.O_CLOEXEC | _O_DIRECT)
        except OSError as e:            # ramfs and others: the same bytes, buffered
            self.dfd = None
            self._refused(f"open: {e.strerror or e}")
        self.bufs = [memoryview(b) for b in pair]
        self.size = len(pair[0])
        self.cur = 0                    # the buffer being filled, and how far
        self.fill = 0
        self.offset = 0                 # file offset of the buffer being filled
        self.pending: Future[None] | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-direct")

    @property
    def direct(self) -> bool:
        """Whether the writes so far went past the page cache."""
        return self.dfd is not None

    def write(self, parts: list[Any]) -> int:
        """Copy ``parts`` (bytes-like) into the buffers, writing each one that fills; returns
        the bytes taken."""
        total = 0
        for part in parts:
            view = memoryview(part).cast("B")
            while view.nbytes:
                n = min(view.nbytes, self.size - self.fill)
                self.bufs[self.cur][self.fill:self.fill + n] = view[:n]
                self.fill += n
                view = view[n:]
                total += n
                if self.fill == self.size:
                    self._submit(self.size)
        return total

    def _submit(self, n: int) -> None:
        """Hand the full buffer to the helper thread and go on with the other one (once the
        helper has finished writing it)."""
        self._wait()
        self.pending = self._pool.submit(self._pwrite, self.bufs[self.cur][:n], self.offset)
        self.offset += n
        self.cur ^= 1
        self.fill = 0

    def _wait(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def _pwrite(self, view: memoryview, offset: int) -> None:
        while view.nbytes:
            fd = self.dfd if self.dfd is not None else self.fd
            try:
                n = os.pwrite(fd, view, offset)
            except OSError as e:
                if e.errno != errno.EINVAL or self.dfd is None:
                    raise
                # The filesystem opened O_DIRECT but refuses the write: buffered from now on.
                self._refused(f"write: {e.strerror or e}")
                os.close(self.dfd)
                self.dfd = None
                continue
            view, offset = view[n:], offset + n

    def _refused(self, why: str) -> None:
        log.debug("O_DIRECT refused (%s): writing buffered", why)
        if self._on_refused is not None:
            self._on_refused(why)

    def close(self) -> None:
        """Write what is still buffered: whole blocks past the page cache, the last partial
        block through ``fd``. Waits for the helper thread."""
        try:
            whole = self.fill - self.fill % _ALIGN
            tail = bytes(self.bufs[self.cur][whole:self.fill])
            if whole:
                self._submit(whole)
            self._wait()
            view, start = memoryview(tail), self.offset
            while view.nbytes:
                n = os.pwrite(self.fd, view, start)
                view, start = view[n:], start + n
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        """Stop the helper thread and close the ``O_DIRECT`` descriptor (also after errors)."""
        with contextlib.suppress(Exception):
            self._wait()
        self._pool.shutdown(wait=True)
        if self.dfd is not None:
            os.close(self.dfd)
            self.dfd = None
