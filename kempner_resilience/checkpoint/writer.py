"""A DCP StorageWriter that writes stock-loadable files fast and checksums them while writing.

Why not the stock ``FileSystemWriter``: it calls ``torch.save`` once per tensor (~0.2 ms fixed
cost each, seven small writes per tensor). Here each writer thread owns one file and a share of
the items (balanced by size), encodes tensors as ``torch.save``-format records from cached
templates (``recordfmt``), CRCs the raw bytes straight out of the tensor's memory (zlib releases
the GIL, so one thread's CRC overlaps another's write), and hands many records at once to
``os.writev``: large sequential writes, no copies. Each file is fsynced, then the directory.

Device (CUDA) tensors are not copied with ``.cpu()`` (fresh pageable memory per tensor at every
save, the slowest part of saving GPU state): their bytes stream through the reused host chunks of
``hostbuf`` (``_Out``), the copy of the next chunk overlapping the write of the current one, the
CRC computed over the staged bytes. The records are the same bytes either way.

The result is a standard DCP checkpoint: ``__<rank>_<i>.distcp`` + ``.metadata``, loadable by
``dcp.load`` with a stock ``FileSystemReader``. Per-record CRCs (offset, length, crc, data offset,
dtype) and a whole-file CRC are kept in ``files`` for the manifest.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import os
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch
from torch.futures import Future
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from kempner_resilience.checkpoint import recordfmt
from kempner_resilience.checkpoint.hostbuf import Chunk, HostStaging, Slot, caller_streams, flat_bytes
from kempner_resilience.checkpoint.layout import file_crc
from kempner_resilience.fileio import fsync_dir

__all__ = ["ChecksummingWriter", "SaveAborted", "StagingMismatch", "STAGING_MISMATCH",
           "ENV_STAGE_FAULT"]

STAGING_MISMATCH = "staged bytes differ from a plain copy"
ENV_STAGE_FAULT = "KEMPNER_RESILIENCE_STAGE_FAULT"
"""Tests only: set to 1 to corrupt the first byte of every staged tensor after its copy, the
failure a wrong stream/event order would cause (``prove`` must catch it before any commit)."""

_BATCH_BYTES = 64 << 20     # hand this much to one writev: big enough to stream, small enough
_BATCH_IOVECS = 900         # to start writing early; IOV_MAX is 1024 on Linux
_MIN_FILE_BYTES = 32 << 20  # below this per file, one more file only adds an fsync


class SaveAborted(RuntimeError):
    """The save was abandoned on purpose (an emergency save needed the disk)."""


class StagingMismatch(RuntimeError):
    """A staged tensor's bytes differ from an independent plain copy of the same tensor."""


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


def _item_nbytes(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    n = torch._utils._element_size(item.tensor_data.properties.dtype)
    for s in item.tensor_data.size:
        n *= s
    return n


class _Staged:
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


class _Out:
    """One file's bytes on their way to disk, in order, in ``writev`` batches.

    Host bytes (records of CPU tensors, pickled items) are written straight from their memory.
    A staged tensor's bytes are copied into the slot's current chunk; a batch that holds chunk
    bytes is sealed when the chunk is full (or the batch is large enough) and written only when
    the next one is sealed, so the device-to-host copies into one chunk overlap the write of the
    other. Before a batch is written its chunk's copies are awaited and the CRCs computed over
    the staged bytes, which completes the suffixes of the records that end there.
    """

    def __init__(self, fd: int, slot: Slot | None, abort: threading.Event, where: Any,
                 caller_streams: dict[int, Any]) -> None:
        self.fd = fd
        self.slot = slot
        self.abort = abort
        self.where = where
        self.iov: list[Any] = []
        self.keep: list[Any] = []       # what the pending iovecs point into
        self.fills: list[tuple[_Staged, int, int]] = []   # (record, chunk offset, bytes)
        self.nbytes = 0
        self.flushed = 0                # bytes of the file handed to the kernel
        self.chunk_i = 0                # the chunk being filled, and how far
        self.used = 0
        self.sealed: tuple[list[Any], list[Any], list[tuple[_Staged, int, int]], Chunk] | None \
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
        staged = _Staged(rec, prefix_crc, template, at, nbytes)
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

    def _write(self, iov: list[Any], keep: list[Any], fills: list[tuple[_Staged, int, int]],
               chunk: Chunk) -> None:
        chunk.wait()
        for staged, at, n in fills:
            staged.update(chunk.view[at:at + n])
        self._writev(iov)

    def _writev(self, iov: list[Any]) -> None:
        n = _writev_all(self.fd, iov)
        _start_writeback(self.fd, self.flushed, n)
        self.flushed += n

    def close(self) -> None:
        """Write everything still pending (the last batches)."""
        self.seal()
        if self.sealed is not None:
            previous, self.sealed = self.sealed, None
            self._write(*previous)


class ChecksummingWriter(FileSystemWriter):
    """``FileSystemWriter`` with a fast, checksumming ``write_data`` (same file format).

    ``threads`` files per rank are written in parallel. ``abort`` (an Event), when set, makes
    the writer threads stop at the next record with ``SaveAborted``. ``staging``, when given,
    carries the bytes of the tensors it ``wants`` (device tensors) through its reused host
    buffers instead of a fresh ``.cpu()`` copy each (same file, byte for byte). After
    ``dcp.save``, ``files`` maps each file this rank wrote to ``{"size", "crc32", "rank",
    "records"}``; on the coordinator it also holds ``.metadata``.
    """

    def __init__(self, path: str | os.PathLike[str], *, threads: int = 2,
                 abort: threading.Event | None = None,
                 staging: HostStaging | None = None, prove: bool = False) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True,
                         thread_count=threads, overwrite=False)
        self.threads = max(1, threads)
        self.abort = abort or threading.Event()
        self.staging = staging
        # Check every staged record against a plain copy of its tensor (the run's first staged
        # save): the staging path's streams, events and reused chunks are trusted only once
        # they have produced the same bytes as the simple path, before anything is committed.
        self.prove = prove
        self.proven_records = 0
        self._caller_streams: dict[int, Any] = {}
        self.files: dict[str, dict[str, Any]] = {}
        self.bytes_written = 0
        self.write_seconds = 0.0

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix: _StoragePrefix = plan.storage_data
        buckets = self._buckets(plan.items)
        if self.staging is not None:
            # The writer threads' copies must follow the work queued by this (the caller's)
            # thread, e.g. the optimizer step that produced the state.
            self._caller_streams = caller_streams()
        t0 = time.monotonic()
        with ThreadPoolExecutor(max_workers=len(buckets) or 1,
                                thread_name_prefix="ckpt-write") as pool:
            futs = [pool.submit(self._write_file, f"{prefix.prefix}{i}.distcp", items, planner)
                    for i, items in enumerate(buckets)]
            results: list[WriteResult] = []
            for f in futs:
                results += f.result()
        fsync_dir(self.path)
        self.write_seconds = time.monotonic() - t0
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _buckets(self, items: list[WriteItem]) -> list[list[WriteItem]]:
        """Balance tensor bytes over ``threads`` files; small byte items go to the first file."""
        byte_items = [i for i in items if i.type == WriteItemType.BYTE_IO]
        sized = [(_item_nbytes(i), i) for i in items if i.type != WriteItemType.BYTE_IO]
        tensor_bytes = sum(n for n, _ in sized)
        # Small states gain nothing from parallel files and pay an fsync per file.
        n = max(1, min(self.threads, tensor_bytes // _MIN_FILE_BYTES + 1))
        if n == 1:
            return [byte_items + [i for _, i in sized]] if items else []
        buckets: list[list[WriteItem]] = [[] for _ in range(n)]
        sizes = [0] * n
        buckets[0] += byte_items
        for nbytes, item in sorted(sized, key=lambda p: p[0], reverse=True):
            k = sizes.index(min(sizes))
            buckets[k].append(item)
            sizes[k] += nbytes
        return [b for b in buckets if b]

    def _write_file(self, name: str, items: list[WriteItem],
                    planner: SavePlanner) -> list[WriteResult]:
        path = Path(self.path) / name
        staging = self.staging
        lease = staging.lease() if staging is not None else contextlib.nullcontext()
        # O_EXCL: a fresh file in a fresh directory; never overwrite anything.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        results: list[WriteResult] = []
        records: list[list[Any]] = []
        expected: list[tuple[str, list[Any], int]] = []     # (fqn, staged record, plain crc)
        offset = 0
        try:
            with lease as slot:
                out = _Out(fd, slot, self.abort, self.path, self._caller_streams)
                for item in items:
                    if self.abort.is_set():
                        raise SaveAborted(f"save into {self.path} abandoned")
                    data = planner.resolve_data(item)
                    if item.type == WriteItemType.BYTE_IO:
                        buf = data.getbuffer() if isinstance(data, io.BytesIO) \
                            else memoryview(data)
                        length = buf.nbytes
                        rec: list[Any] = [offset, length, zlib.crc32(buf)]
                        out.add([buf], length)
                    else:
                        t = data.detach()
                        if slot is not None and staging is not None and staging.wants(t) \
                                and recordfmt.encodable(t) and t.is_contiguous():
                            if self.prove:
                                plain = t.to("cpu", copy=True)   # synchronous, no chunks
                                expected.append((item.index.fqn, None,
                                                 recordfmt.tensor_record(plain).crc))
                            rec = out.add_staged(t, offset)
                            length = rec[1]
                            if self.prove:
                                expected[-1] = (expected[-1][0], rec, expected[-1][2])
                        else:
                            rec = self._record(t, offset, out)
                            length = rec[1]
                    records.append(rec)
                    results.append(WriteResult(index=item.index, size_in_bytes=length,
                                               storage_data=_StorageInfo(name, offset, length)))
                    offset += length
                    out.maybe_seal()
                out.close()
                os.fsync(fd)
        finally:
            os.close(fd)
        for fqn, rec, crc in expected:
            if rec[2] != crc:
                raise StagingMismatch(f"{STAGING_MISMATCH}: tensor {fqn!r} (record crc "
                                      f"{rec[2]:#010x}, plain copy {crc:#010x})")
        self.proven_records += len(expected)
        crc = 0
        for rec in records:
            crc = recordfmt.crc32_combine(crc, rec[2], rec[1])
        self.files[name] = {"size": offset, "crc32": crc, "rank": self.rank or 0,
                            "records": records}
        self.bytes_written += offset
        return results

    @staticmethod
    def _record(t: torch.Tensor, offset: int, out: "_Out") -> list[Any]:
        """A tensor's record from host memory (a device tensor is copied to the host first)."""
        if t.device.type != "cpu":
            t = t.cpu()
        if not t.is_contiguous():
            t = t.contiguous()
        if recordfmt.fast_path_ok(t):
            r = recordfmt.tensor_record(t)
            out.add([r.prefix, r.data, r.suffix], r.length, keep=t)
            return [offset, r.length, r.crc, r.data_offset, str(t.dtype)]
        # Rare dtypes/layouts: stock torch.save (still the same file format).
        # torch.save writes a view's whole storage: clone to write only ours.
        b = io.BytesIO()
        torch.save(t.clone() if t.untyped_storage().nbytes()
                   != t.numel() * t.element_size() else t, b)
        buf = b.getbuffer()
        out.add([buf], buf.nbytes)
        return [offset, buf.nbytes, zlib.crc32(buf)]

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Stock ``.metadata`` write (tmp, fsync, rename), then make the rename durable."""
        super().finish(metadata, results)
        fsync_dir(self.path)
        meta = Path(self.path) / ".metadata"
        self.files[".metadata"] = {"size": meta.stat().st_size, "crc32": file_crc(meta),
                                   "rank": self.rank or 0}
