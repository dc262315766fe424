"""A DCP StorageWriter that writes stock-loadable files fast and checksums them while writing.

Why not the stock ``FileSystemWriter``: it calls ``torch.save`` once per tensor (~0.2 ms fixed
cost each, seven small writes per tensor). Here each writer thread owns one file and a share of
the items (balanced by size), encodes tensors as ``torch.save``-format records from cached
templates (``recordfmt``), CRCs the raw bytes straight out of the tensor's memory (zlib releases
the GIL, so one thread's CRC overlaps another's write), and hands many records at once to
``os.writev``: large sequential writes, no copies. Each file is fsynced, then the directory.

The result is a standard DCP checkpoint: ``__<rank>_<i>.distcp`` + ``.metadata``, loadable by
``dcp.load`` with a stock ``FileSystemReader``. Per-record CRCs (offset, length, crc, data offset,
dtype) and a whole-file CRC are kept in ``files`` for the manifest.
"""

from __future__ import annotations

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
from kempner_resilience.checkpoint.layout import file_crc, fsync_dir

__all__ = ["ChecksummingWriter", "SaveAborted"]

_BATCH_BYTES = 64 << 20     # hand this much to one writev: big enough to stream, small enough
_BATCH_IOVECS = 900         # to start writing early; IOV_MAX is 1024 on Linux
_MIN_FILE_BYTES = 32 << 20  # below this per file, one more file only adds an fsync


class SaveAborted(RuntimeError):
    """The save was abandoned on purpose (an emergency save needed the disk)."""


def _writev_all(fd: int, bufs: list[Any]) -> None:
    """``os.writev`` until everything is written (regular files may return short on signals)."""
    views = [memoryview(b).cast("B") for b in bufs]
    views = [v for v in views if v.nbytes]
    while views:
        n = os.writev(fd, views)
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if n:
            views[0] = views[0][n:]


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
    the writer threads stop at the next record with ``SaveAborted``. After ``dcp.save``,
    ``files`` maps each file this rank wrote to ``{"size", "crc32", "rank", "records"}``;
    on the coordinator it also holds ``.metadata``.
    """

    def __init__(self, path: str | os.PathLike[str], *, threads: int = 2,
                 abort: threading.Event | None = None) -> None:
        super().__init__(path, single_file_per_rank=True, sync_files=True,
                         thread_count=threads, overwrite=False)
        self.threads = max(1, threads)
        self.abort = abort or threading.Event()
        self.files: dict[str, dict[str, Any]] = {}
        self.bytes_written = 0
        self.write_seconds = 0.0

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        prefix: _StoragePrefix = plan.storage_data
        buckets = self._buckets(plan.items)
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
        # O_EXCL: a fresh file in a fresh directory; never overwrite anything.
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        results: list[WriteResult] = []
        records: list[list[Any]] = []
        pending: list[Any] = []
        keep_alive: list[Any] = []     # tensors whose memory the pending iovecs point into
        pending_bytes = 0
        offset = 0
        crc = 0
        try:
            for item in items:
                if self.abort.is_set():
                    raise SaveAborted(f"save into {self.path} abandoned")
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    buf = data.getbuffer() if isinstance(data, io.BytesIO) else memoryview(data)
                    rcrc = zlib.crc32(buf)
                    parts = [buf]
                    length = buf.nbytes
                    rec: list[Any] = [offset, length, rcrc]
                else:
                    t = data.detach()
                    if t.device.type != "cpu":
                        t = t.cpu()
                    if not t.is_contiguous():
                        t = t.contiguous()
                    if recordfmt.fast_path_ok(t):
                        r = recordfmt.tensor_record(t)
                        parts = [r.prefix, r.data, r.suffix]
                        length, rcrc = r.length, r.crc
                        rec = [offset, length, rcrc, r.data_offset, str(t.dtype)]
                        keep_alive.append(t)
                    else:
                        # Rare dtypes/layouts: stock torch.save (still the same file format).
                        # torch.save writes a view's whole storage: clone to write only ours.
                        b = io.BytesIO()
                        torch.save(t.clone() if t.untyped_storage().nbytes()
                                   != t.numel() * t.element_size() else t, b)
                        buf = b.getbuffer()
                        parts, length, rcrc = [buf], buf.nbytes, zlib.crc32(buf)
                        rec = [offset, length, rcrc]
                crc = recordfmt.crc32_combine(crc, rcrc, length)
                records.append(rec)
                results.append(WriteResult(index=item.index, size_in_bytes=length,
                                           storage_data=_StorageInfo(name, offset, length)))
                pending += parts
                pending_bytes += length
                offset += length
                if pending_bytes >= _BATCH_BYTES or len(pending) >= _BATCH_IOVECS:
                    _writev_all(fd, pending)
                    pending, keep_alive, pending_bytes = [], [], 0
            _writev_all(fd, pending)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.files[name] = {"size": offset, "crc32": crc, "rank": self.rank or 0,
                            "records": records}
        self.bytes_written += offset
        return results

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Stock ``.metadata`` write (tmp, fsync, rename), then make the rename durable."""
        super().finish(metadata, results)
        fsync_dir(self.path)
        meta = Path(self.path) / ".metadata"
        self.files[".metadata"] = {"size": meta.stat().st_size, "crc32": file_crc(meta),
                                   "rank": self.rank or 0}
