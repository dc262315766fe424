"""Writing a checkpoint file past the page cache (``O_DIRECT``), from buffers touched at set-up.

Why: a buffered write copies every byte into page-cache pages the kernel takes from free memory
at that moment, then the fsync writes them out. On a VM whose freed memory the host takes back
(these machines; many clouds), each such page costs a host fault on first touch, and several
writer threads doing it at once on a small node fight over the same lock: in issue 32's setting
(0.94 GiB of Adam state, 2 cores) the buffered save took 1.6-5 s where one thread writing
``O_DIRECT`` from warm buffers took 0.7-0.9 s. Here each writer thread copies its records into
two page-aligned buffers allocated and touched when the run was set up (``DirectPool.reserve``),
and one helper thread writes a full buffer with ``O_DIRECT`` while the other one fills: no page
cache, no cold pages, and the fsync at the end has only the tail and the metadata left.

The last partial block of a file (its length is whatever the records add up to, ``O_DIRECT``
wants whole blocks) goes through the ordinary descriptor, at its offset. A filesystem that
refuses ``O_DIRECT`` (tmpfs at open, some network filesystems at the first write) gets the same
bytes through the ordinary descriptor instead: same file, just buffered. The file format is
unchanged (``writer.py`` decides what goes into it).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Iterator

from kempner_resilience.core.log import get_logger

__all__ = ["DirectPool", "DirectSink", "ENV_DIRECT_IO"]

log = get_logger(__name__)

ENV_DIRECT_IO = "KEMPNER_RESILIENCE_DIRECT_IO"
"""Set to 0 to write checkpoint files through the page cache (A/B in ``bench/issue32_bench.py``)."""

_BUF_BYTES = 8 << 20        # one O_DIRECT write: large enough to stream at disk speed
_ALIGN = 4096               # the largest logical block size O_DIRECT asks alignment for
_O_DIRECT = getattr(os, "O_DIRECT", 0)


class DirectPool:
    """Two page-aligned, touched buffers per writer thread; ``lease()`` one pair per file."""

    def __init__(self, pairs: list[tuple[mmap.mmap, mmap.mmap]]) -> None:
        self._free = list(pairs)
        self._lock = threading.Lock()

    @classmethod
    def reserve(cls, threads: int, buf_bytes: int = _BUF_BYTES) -> "DirectPool | None":
        """Allocate and touch the buffers now (set-up, not the signal path); None where
        ``O_DIRECT`` does not exist or ``KEMPNER_RESILIENCE_DIRECT_IO=0``."""
        if not _O_DIRECT or os.environ.get(ENV_DIRECT_IO, "1") == "0":
            return None
        pairs = []
        for _ in range(max(1, threads)):
            pair = (mmap.mmap(-1, buf_bytes), mmap.mmap(-1, buf_bytes))
            for buf in pair:          # touched: first-touch faults belong to set-up
                buf.write(b"\0" * buf_bytes)
                buf.seek(0)
            pairs.append(pair)
        return cls(pairs)

    @contextlib.contextmanager
    def lease(self) -> Iterator[tuple[mmap.mmap, mmap.mmap] | None]:
        """A pair for the calling thread, or None when all are taken (it writes buffered)."""
        with self._lock:
            pair = self._free.pop() if self._free else None
        try:
            yield pair
        finally:
            if pair is not None:
                with self._lock:
                    self._free.append(pair)


class DirectSink:
    """The bytes of one file, in order, through a buffer pair to an ``O_DIRECT`` descriptor.

    ``fd`` is the file's ordinary (buffered) descriptor, which the caller fsyncs and closes;
    ``close`` must be called before that fsync (it writes what is still buffered).
    """

    def __init__(self, path: str | os.PathLike[str], fd: int,
                 pair: tuple[mmap.mmap, mmap.mmap]) -> None:
        self.fd = fd
        try:
            self.dfd: int | None = os.open(path, os.O_WRONLY | os.O_CLOEXEC | _O_DIRECT)
        except OSError:                 # tmpfs and others: the same bytes, buffered
            self.dfd = None
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
                log.debug("O_DIRECT write refused (%s): writing buffered", e)
                os.close(self.dfd)
                self.dfd = None
                continue
            view, offset = view[n:], offset + n

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
