"""A DCP StorageWriter that writes stock-loadable files fast and checksums them while writing.

Why not the stock ``FileSystemWriter``: it calls ``torch.save`` once per tensor (~0.2 ms fixed
cost each, seven small writes per tensor). Here each writer thread owns one file and a share of
the items (balanced by size), encodes tensors as ``torch.save``-format records from cached
templates (``recordfmt``), CRCs the raw bytes straight out of the tensor's memory (zlib releases
the GIL, so one thread's CRC overlaps another's write), and hands many records at once to
``os.writev``: large sequential writes, no copies. Each file is fsynced, then the directory.

Device (CUDA) tensors are not copied with ``.cpu()`` (fresh pageable memory per tensor at every
save, the slowest part of saving GPU state): their bytes stream through the reused host chunks of
``hostbuf``, the copy of the next chunk overlapping the write of the current one, the CRC
computed over the staged bytes. The records are the same bytes either way. Writing one file
(batches, staging, early writeback) is ``outfile.OutFile``; this module decides what goes into
which file and keeps the checksums.

The result is a standard DCP checkpoint: ``__<rank>_<i>.distcp`` + ``.metadata``, loadable by
``dcp.load`` with a stock ``FileSystemReader``. Per-record CRCs (offset, length, crc, data offset,
dtype) and a whole-file CRC are kept in ``files`` for the manifest.

As a drop-in ``storage_writer`` it refuses a directory that holds a committed checkpoint (a
``MANIFEST.json``), whatever ``overwrite`` says, at set-up on every rank: before any file is
opened. It also runs where torch moves it: pickled into ``async_save``'s staging process (the
abort event and the host buffers stay behind; the files are the same), and in the rank-local
mode of ``use_collectives=False`` (each rank's ``__<rank>.metadata``).
"""

from __future__ import annotations

import contextlib
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
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from kempner_resilience.checkpoint import recordfmt
from kempner_resilience.checkpoint.directio import DirectPool, DirectSink
from kempner_resilience.checkpoint.hostbuf import HostStaging, caller_streams
from kempner_resilience.checkpoint.info import CheckpointCommitted
from kempner_resilience.checkpoint.integrity import metadata_name
from kempner_resilience.checkpoint.layout import MANIFEST_NAME, file_crc
from kempner_resilience.checkpoint.outfile import ENV_STAGE_FAULT, OutFile, SaveAborted
from kempner_resilience.core.fileio import fsync_dir
from kempner_resilience.core.torch_private import StorageInfo, StoragePrefix

__all__ = ["ChecksummingWriter", "SaveAborted", "StagingMismatch", "STAGING_MISMATCH",
           "ENV_STAGE_FAULT"]

STAGING_MISMATCH = "staged bytes differ from a plain copy"
_MIN_FILE_BYTES = 32 << 20  # below this per file, one more file only adds an fsync


class StagingMismatch(RuntimeError):
    """A staged tensor's bytes differ from an independent plain copy of the same tensor."""


def _item_nbytes(item: WriteItem) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    n = torch._utils._element_size(item.tensor_data.properties.dtype)
    for s in item.tensor_data.size:
        n *= s
    return n


class ChecksummingWriter(FileSystemWriter):
    """``FileSystemWriter`` with a fast, checksumming ``write_data`` (same file format).

    ``threads`` files per rank are written in parallel. ``abort`` (an Event), when set, makes
    the writer threads stop at the next record with ``SaveAborted``. ``staging``, when given,
    carries the bytes of the tensors it ``wants`` (device tensors) through its reused host
    buffers instead of a fresh ``.cpu()`` copy each (same file, byte for byte). After
    ``dcp.save``, ``files`` maps each file this rank wrote to ``{"size", "crc32", "rank",
    "records"}``; on the coordinator it also holds ``.metadata`` (without collectives, each
    rank its own ``__<rank>.metadata``). A copy that torch sends to another process (the
    process staging of ``dcp.async_save``) fills its own ``files`` there, not this one's.
    A directory holding a committed checkpoint is refused with ``CheckpointCommitted``.
    """

    def __init__(self, path: str | os.PathLike[str], single_file_per_rank: bool = True,
                 sync_files: bool = True, thread_count: int | None = None,
                 per_thread_copy_ahead: int = 10_000_000, cache_staged_state_dict: bool = False,
                 overwrite: bool = True, *, threads: int = 2,
                 abort: threading.Event | None = None,
                 staging: HostStaging | None = None, prove: bool = False,
                 direct: DirectPool | None = None, **torch_options: Any) -> None:
        # torch's FileSystemWriter arguments are taken as it takes them, with its defaults, so
        # this is a drop-in storage_writer for dcp.save (torch's own tests save twice into
        # one directory). Our saves pass overwrite=False: they never write over anything.
        # The files are fsynced whatever ``sync_files`` says (a checkpoint that a crash can
        # take back is none).
        if thread_count is not None:
            threads = thread_count
        super().__init__(path, single_file_per_rank=single_file_per_rank, sync_files=True,
                         thread_count=max(1, threads),
                         per_thread_copy_ahead=per_thread_copy_ahead,
                         cache_staged_state_dict=cache_staged_state_dict, overwrite=overwrite,
                         **torch_options)
        # Our records (checksummed, straight from the tensors' bytes) are torch's file format
        # with one file set per rank. Another layout (a file per item, stream extensions,
        # another serialization) is written by torch's own write_data, without checksums.
        fmt = torch_options.get("serialization_format")
        self.stock = (not single_file_per_rank or bool(torch_options.get("_extensions"))
                      or (fmt is not None and getattr(fmt, "value", fmt) != "torch_save"))
        self.threads = max(1, threads)
        self.abort = abort or threading.Event()
        self.staging = staging
        self.direct = direct            # buffers for writing past the page cache (directio)
        # Check every staged record against a plain copy of its tensor (the run's first staged
        # save): the staging path's streams, events and reused chunks are trusted only once
        # they have produced the same bytes as the simple path, before anything is committed.
        self.prove = prove
        self.proven_records = 0
        self._caller_streams: dict[int, Any] = {}
        self.files: dict[str, dict[str, Any]] = {}
        self.bytes_written = 0
        self.write_seconds = 0.0

    # Bound to this process: an event other threads set, host buffers pinned here, CUDA
    # streams. A copy sent to another process (async_save's process staging) writes the same
    # files through plain host copies; the abort event stays with the original.
    _LOCAL = ("abort", "staging", "direct", "_caller_streams")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in self._LOCAL:
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.abort = threading.Event()
        self.staging = None
        self.direct = None
        self._caller_streams = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        """Every rank, before any file is opened: refuse a committed checkpoint's directory."""
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        # Whatever ``overwrite`` says: torch's overwrite truncates the shards first and
        # replaces .metadata last, so a save that fails midway leaves neither checkpoint. A
        # manifest that is there but unreadable is refused as well (committed once).
        manifest = Path(self.path) / MANIFEST_NAME
        if os.path.lexists(manifest):
            raise CheckpointCommitted(
                f"{self.path} holds a committed checkpoint ({MANIFEST_NAME} is there); a save "
                "into it would destroy that checkpoint, so nothing was written. Save into a "
                "fresh directory instead (a new checkpoint_id or path)")

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """A new save (``dcp.save`` calls this first; a reused writer may get another
        ``checkpoint_id``): what the last one wrote is no longer this save's."""
        super().reset(checkpoint_id)
        self.files = {}
        self.bytes_written = 0
        self.write_seconds = 0.0

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        if self.stock:
            return super().write_data(plan, planner)
        prefix: StoragePrefix = plan.storage_data
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
        bounce = self.direct.lease() if self.direct is not None else contextlib.nullcontext()
        # O_EXCL: a fresh file in a fresh directory; never overwrite anything, unless the
        # caller of a plain dcp.save asked for overwrite=True (our manager never does).
        fresh = os.O_TRUNC if self.overwrite else os.O_EXCL
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | fresh | os.O_CLOEXEC, 0o644)
        results: list[WriteResult] = []
        records: list[list[Any]] = []
        expected: list[tuple[str, list[Any], int]] = []     # (fqn, staged record, plain crc)
        try:
            with lease as slot, bounce as pair:
                sink = None if pair is None or self.direct is None else \
                    DirectSink(path, fd, pair, self.direct.refused)
                try:
                    self._fill(OutFile(fd, slot, self.abort, self.path, self._caller_streams,
                                       sink), items, planner, name, staging, slot, results,
                               records, expected)
                finally:
                    if sink is not None:
                        sink.shutdown()
                os.fsync(fd)
        finally:
            os.close(fd)
        offset = sum(r[1] for r in records)
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

    def _fill(self, out: OutFile, items: list[WriteItem], planner: SavePlanner, name: str,
              staging: HostStaging | None, slot: Any, results: list[WriteResult],
              records: list[list[Any]], expected: list[tuple[str, Any, int]]) -> None:
        """Append every item's record to ``out`` in order, then write what is pending."""
        offset = 0
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
                                       storage_data=StorageInfo(name, offset, length)))
            offset += length
            out.maybe_seal()
        out.close()

    @staticmethod
    def _record(t: torch.Tensor, offset: int, out: OutFile) -> list[Any]:
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
        """Stock ``.metadata`` write (tmp, fsync, rename), then make the rename durable.
        Without collectives each rank writes its own ``__<rank>.metadata`` (torch's name)."""
        super().finish(metadata, results)
        fsync_dir(self.path)
        rank_local = not self.use_collectives and self.rank is not None
        name = metadata_name(self.rank if rank_local else None)
        meta = Path(self.path) / name
        self.files[name] = {"size": meta.stat().st_size, "crc32": file_crc(meta),
                            "rank": self.rank or 0}
