"""One file's bytes on their way to disk: records in ``os.writev`` batches, staged through chunks.

``ChecksummingWriter`` (``writer.py``) decides what goes into which file; an ``OutFile`` writes one
file. Host bytes (records of CPU tensors, pickled items) go to the kernel straight from their
memory, many at once per ``writev``. A device tensor's bytes are copied into the reused host
chunks of ``hostbuf`` (no fresh ``.cpu()`` copy per tensor), the copy of the next chunk
overlapping the write of the current one, and the CRC is computed over the staged bytes; a
``StagedRecord`` completes its record's suffix once its last byte has been checksummed. The
kernel is asked to start writing back each batch at once, so the disk works while we checksum;
with a ``directio.DirectSink`` the batches go past the page cache instead.
"""

from __future__ import annotations

import ctypes
import os
import threading
import zlib
from typing import Any

import torch

from kempner_resilience.checkpoint import recordfmt
from kempner_resilience.checkpoint.directio import DirectSink
from kempner_resilience.checkpoint.hostbuf import Chunk, Slot, flat_bytes

__all__ = ["OutFile", "StagedRecord", "SaveAborted", "ENV_STAGE_FAULT"]

ENV_STAGE_FAULT = "KEMPNER_RESILIENCE_STAGE_FAULT"
"""Tests only: set to 1 to corrupt the first byte of every staged tensor after its copy, the
failure a wrong stream/event order would cause (``prove`` must catch it before any commit)."""

_BATCH_BYTES = 64 << 20     # hand this much to one writev: big enough to stream, small enough
_BATCH_IOVECS = 900         # to start writing early; IOV_MAX is 1024 on Linux


class SaveAborted(RuntimeError):
    """The save was abandoned on purpose (an emergency save needed the disk)."""


_FAULT = os.environ.get(ENV_STAGE_FAULT) == "1"


def _load_sync_file_range() -> Any:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):      # not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _load_sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2
_EARLY_WRITEBACK = True       # False only to measure what it gains (bench A/B)


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Have the kernel start writing ``nbytes`` at ``offset`` to disk now, without waiting.

    Otherwise dirty pages wait until the final fsync (a 1 GiB save stays below the kernel's
    background threshold), so the disk idles while we checksum and the fsync writes it all:
    CPU time and disk time add up. Started batch by batch, they overlap. The fsync at the end
    still decides durability; this is only a hint (errors are ignored).
    """
    if _SYNC_FILE_RANGE is not None and _EARLY_WRITEBACK and nbytes:
        _SYNC_FILE_RANGE(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)


def _writev_all(fd: int, bufs: list[Any]) -> int:
    """``os.writev`` until everything is written (regular files may return short on signals);
    returns the bytes written."""
    views = [memoryview(b).cast("B") for b in bufs]
    views = [v for v in views if v.nbytes]
    total = sum(v.nbytes for v in views)
    while views:
        n = os.writev(fd, views)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if n:
            views[0] = views[0][n:]
    return total



class StagedRecord:
    """A record whose data goes through the staging chunks: its CRC and suffix are known only
    once the last of its bytes has been staged and checksummed."""

    __slots__ = ("rec", "prefix_crc", "template", "at", "nbytes", "left", "data_crc", "suffix")

    def __init__(self, rec: list[Any], prefix_crc: int, template: bytes, at: tuple[int, int],
                 nbytes: int) -> None:
        self.rec, self.prefix_crc, self.template, self.at = rec, prefix_crc, template, at
        self.nbytes = self.left = nbytes
        self.data_crc = 0
        self.suffix = bytearray(len(template))     # filled in place before it is written
        if not nbytes:
            self._finish()

    def update(self, staged: memoryview) -> None:
        self.data_crc = zlib.crc32(staged, self.data_crc)
        self.left -= staged.nbytes
        if not self.left:
            self._finish()

    def _finish(self) -> None:
        suffix, self.rec[2] = recordfmt.finish_record(self.prefix_crc, self.template, self.at,
                                                      self.data_crc, self.nbytes)
        self.suffix[:] = suffix


class OutFile:
    """One file's bytes on their way to disk, in order, in ``writev`` batches.

    Host bytes (records of CPU tensors, pickled items) are written straight from their memory.
    A staged tensor's bytes are copied into the slot's current chunk; a batch that holds chunk
    bytes is sealed when the chunk is full (or the batch is large enough) and written only when
    the next one is sealed, so the device-to-host copies into one chunk overlap the write of the
    other. Before a batch is written its chunk's copies are awaited and the CRCs computed over
    the staged bytes, which completes the suffixes of the records that end there.
    """

    def __init__(self, fd: int, slot: Slot | None, abort: threading.Event, where: Any,
                 caller_streams: dict[int, Any], sink: DirectSink | None = None) -> None:
        self.fd = fd
        self.sink = sink                # past the page cache (directio), when given
        self.slot = slot
        self.abort = abort
        self.where = where
        self.iov: list[Any] = []
        self.keep: list[Any] = []       # what the pending iovecs point into
        self.fills: list[tuple[StagedRecord, int, int]] = []   # (record, chunk offset, bytes)
        self.nbytes = 0
        self.flushed = 0                # bytes of the file handed to the kernel
        self.chunk_i = 0                # the chunk being filled, and how far
        self.used = 0
        self.sealed: tuple[list[Any], list[Any], list[tuple[StagedRecord, int, int]], Chunk] | None \
            = None
        if slot is not None:
            slot.begin(caller_streams)

    def add(self, parts: list[Any], nbytes: int, keep: Any = None) -> None:
        self.iov += parts
        self.nbytes += nbytes
        if keep is not None:
            self.keep.append(keep)

    def add_staged(self, t: torch.Tensor, offset: int) -> list[Any]:
        """Append ``t``'s record, its bytes through the chunks; returns its manifest entry."""
        slot = self.slot
        assert slot is not None
        prefix, prefix_crc, template, at = recordfmt.record_template(t.dtype, tuple(t.shape))
        nbytes = t.numel() * t.element_size()
        length = len(prefix) + nbytes + len(template)
        rec: list[Any] = [offset, length, None, len(prefix), str(t.dtype)]
        staged = StagedRecord(rec, prefix_crc, template, at, nbytes)
        self.add([prefix], len(prefix))
        src = flat_bytes(t) if nbytes else None
        done = 0
        while done < nbytes:
            chunk = slot.chunks[self.chunk_i]
            if self.used == chunk.nbytes:
                self.seal()
                chunk = slot.chunks[self.chunk_i]
            n = min(nbytes - done, chunk.nbytes - self.used)
            slot.to_host(chunk, self.used, src[done:done + n])
            if done == 0 and _FAULT:
                if torch.cuda.is_available() and torch.cuda.is_initialized():
                    torch.cuda.synchronize()
                chunk.buf[self.used] = 255 - int(chunk.buf[self.used])
            self.iov.append(chunk.view[self.used:self.used + n])
            self.fills.append((staged, self.used, n))
            self.keep.append(t)
            self.used += n
            self.nbytes += n
            done += n
        self.add([staged.suffix], len(template))
        return rec

    def maybe_seal(self) -> None:
        if self.nbytes >= _BATCH_BYTES or len(self.iov) >= _BATCH_IOVECS:
            self.seal()

    def seal(self) -> None:
        """End the pending batch: write the sealed one before it, then this one, or (when it
        holds staged bytes) keep it sealed while the other chunk fills."""
        if self.abort.is_set():
            raise SaveAborted(f"save into {self.where} abandoned")
        batch = (self.iov, self.keep, self.fills)
        self.iov, self.keep, self.fills, self.nbytes = [], [], [], 0
        previous, self.sealed = self.sealed, None
        if previous is not None:
            self._write(*previous)
        if batch[2]:
            assert self.slot is not None
            chunk = self.slot.chunks[self.chunk_i]
            chunk.seal()
            self.sealed = (*batch, chunk)
            self.chunk_i ^= 1           # the other chunk: its batch was just written
            self.used = 0
        elif batch[0]:
            self._writev(batch[0])

    def _write(self, iov: list[Any], keep: list[Any], fills: list[tuple[StagedRecord, int, int]],
               chunk: Chunk) -> None:
        chunk.wait()
        for staged, at, n in fills:
            staged.update(chunk.view[at:at + n])
        self._writev(iov)

    def _writev(self, iov: list[Any]) -> None:
        if self.sink is not None:
            self.flushed += self.sink.write(iov)
            return
        n = _writev_all(self.fd, iov)
        _start_writeback(self.fd, self.flushed, n)
        self.flushed += n

    def close(self) -> None:
        """Write everything still pending (the last batches)."""
        self.seal()
        if self.sealed is not None:
            previous, self.sealed = self.sealed, None
            self._write(*previous)
        if self.sink is not None:
            self.sink.close()
