"""A DCP StorageReader that verifies record checksums while loading and reads straight into place.

The stock ``FileSystemReader`` runs ``torch.load`` per tensor and checks nothing. Here, for every
record the manifest describes, the bytes are CRC-checked as they are read; for tensors written by
our writer whose destination is a contiguous CPU tensor of the same dtype and shape, the raw data
is ``readinto`` the destination itself (no temporary, no unpickling of the tensor record). For
such a record whose destination is on the GPU, the data is read into the reused host chunks of
``hostbuf``, checksummed there and copied to the device (from pinned memory without blocking,
while the next chunk is read): no ``torch.load``, no second host copy. Anything else
(resharding, records from other writers) takes the stock path: ``torch.load`` of the record,
narrowed and copied. Files are read in parallel, one thread each; the CRCs go through
``crc.crc32`` (libdeflate where present: on a busy host the checksum's CPU time is what a
verified read loses to a plain one, docs/benchmarks.md).

Before any record, DCP's metadata is checked as resume checks it (``integrity``): its bytes
against the manifest's checksum, before they are unpickled, and each entry's (file, offset,
length) against the manifest's record there. A record the manifest does not know is never read
unverified. So a ``.metadata`` re-pickled to point one tensor at another's record fails the
load instead of loading the wrong weights.

A mismatch raises ``CheckpointCorrupt``; DCP gathers it from every rank, so all ranks see the
load fail together and can fall back to an older checkpoint together.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import torch
from torch.futures import Future
from kempner_resilience.core.torch_private import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem

from kempner_resilience.checkpoint import integrity, recordfmt
from kempner_resilience.checkpoint.crc import crc32
from kempner_resilience.checkpoint.hostbuf import HostStaging, Slot, caller_streams, flat_bytes
from kempner_resilience.checkpoint.info import CheckpointCorrupt, CheckpointDamaged
from kempner_resilience.checkpoint.layout import NotCommitted, read_manifest

__all__ = ["VerifyingReader"]


def _committed_manifest(path: Path) -> dict[str, Any] | None:
    try:
        manifest = read_manifest(path)
    except NotCommitted:
        return None
    integrity.check_manifest(path, manifest)    # its records are what every read trusts
    return integrity.part(manifest)     # the parts other processes saved are theirs to read


def _read_exact(f: Any, view: memoryview, where: str) -> None:
    while view.nbytes:
        n = f.readinto(view)
        if not n:
            raise CheckpointDamaged(f"{where}: file ends early (truncated)")
        view = view[n:]


class _Ring:
    """Where the next staged bytes of one file go: the slot's two chunks in turn, each reused
    only after the device copies out of it have completed."""

    def __init__(self, slot: Slot) -> None:
        self.slot = slot
        self.chunk_i = 0
        self.used = 0

    def room(self) -> tuple[Any, int]:
        """(chunk, offset) of the next free bytes."""
        chunk = self.slot.chunks[self.chunk_i]
        if self.used == chunk.nbytes:
            chunk.seal()
            self.chunk_i ^= 1
            self.used = 0
            chunk = self.slot.chunks[self.chunk_i]
            chunk.wait()
        return chunk, self.used


# ``manifest`` not given: read the one committed beside the checkpoint, if any.
_FROM_DIR: Any = object()


class VerifyingReader(FileSystemReader):
    """``FileSystemReader`` that checks each record against ``manifest`` CRCs when ``verify``.

    A drop-in ``storage_reader`` for ``dcp.load``: ``VerifyingReader(path)`` reads the
    manifest our checkpoint manager committed in ``path`` (``MANIFEST.json``) and verifies
    against it; a directory without one (any other DCP checkpoint) is read unverified, as
    torch's reader reads it; a manifest that is there but unreadable raises
    ``CheckpointCorrupt``. With a manifest, DCP's metadata is checked against it first
    (checksum, each entry's record) and a record it does not list is refused, as resume
    checks them. ``manifest=None`` verifies nothing. ``staging``, when given,
    carries the records of the destinations it ``wants`` (GPU tensors) through its reused
    host buffers. Other keyword arguments go to torch's ``FileSystemReader``."""

    def __init__(self, path: str | os.PathLike[str], manifest: dict[str, Any] | None = _FROM_DIR,
                 *, verify: bool = True, threads: int = 2,
                 staging: HostStaging | None = None, **torch_options: Any) -> None:
        super().__init__(path, **torch_options)
        self.verify = verify
        self.threads = max(1, threads)
        self.staging = staging
        self._caller_streams: dict[int, Any] = {}
        self._from_dir = manifest is _FROM_DIR
        self._use(_committed_manifest(Path(path)) if self._from_dir else manifest)
        self.bytes_read = 0

    def _use(self, manifest: dict[str, Any] | None) -> None:
        self.manifest = manifest
        self.records: dict[tuple[str, int], list[Any]] = {}
        for name, meta in ((manifest or {}).get("files") or {}).items():
            for rec in meta.get("records", ()):
                self.records[(name, rec[0])] = rec
        self._metadata_name = integrity.METADATA_NAME
        self._problem: CheckpointCorrupt | None = None

    @property
    def _checking(self) -> bool:
        return self.verify and self.manifest is not None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        """Another load (``dcp.load`` may name another ``checkpoint_id``): the manifest is
        the one committed there."""
        super().reset(checkpoint_id)
        if self._from_dir:
            self._use(_committed_manifest(Path(self.path)))
        else:
            self._problem = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata (``.metadata``, or ``__<rank>.metadata`` when ``rank`` is given), its
        bytes checked against the manifest before they are unpickled. A mismatch is raised by
        ``set_up_storage_reader`` on every rank: raised here, DCP would take it for a missing
        file and look for rank-local metadata instead."""
        if not self._checking:
            return super().read_metadata(*args, **kwargs)
        rank = kwargs.get("rank")
        name = integrity.metadata_name(rank)
        with self.fs.create_stream(self._get_metadata_path(rank), "rb") as f:
            raw = f.read()      # missing: DCP's fall-back to rank-local metadata, as torch's
        self._metadata_name = name
        self._problem = self._metadata_problem(name, raw)
        if self._problem is not None:
            return Metadata(state_dict_metadata={}, storage_data={})   # never unpickled
        metadata = pickle.loads(raw)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _metadata_problem(self, name: str, raw: bytes) -> CheckpointCorrupt | None:
        """Why the metadata bytes ``raw`` (file ``name``) are not the ones committed, if so."""
        where = Path(self.path) / name
        meta = (self.manifest or {})["files"].get(name)
        if meta is None:
            return CheckpointCorrupt(f"{where}: not listed in the manifest of {self.path} "
                                     "(written after the commit, or the manifest damaged)")
        if len(raw) == meta["size"] and zlib.crc32(raw) == meta["crc32"]:
            return None
        # Damaged for sure; name the entry that went wrong where the parsed entries show it
        # (parsed without running code: the bytes are not the committed ones).
        try:
            integrity.check_metadata(Path(self.path), integrity.parse_metadata(where, raw),
                                     self.manifest or {}, name,
                                     complete=name == integrity.METADATA_NAME)
            detail = "file damaged"
        except CheckpointCorrupt as e:
            detail = str(e).removeprefix(f"{where}: ")
        return CheckpointDamaged(f"{where}: checksum mismatch with the manifest ({detail})")

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        """Every rank, before any record is read: the metadata matches the manifest."""
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        if not self._checking:
            return
        if self._problem is not None:
            raise self._problem
        integrity.check_metadata(Path(self.path), metadata, self.manifest or {},
                                 self._metadata_name,
                                 complete=self._metadata_name == integrity.METADATA_NAME)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        if any(getattr(self.storage_data[req.storage_index], "transform_descriptors", None)
               for req in plan.items):
            # Written through stream extensions (compression, encryption: a plain dcp.save
            # with torch's _extensions): torch's reader undoes them. Our records carry none.
            return super().read_data(plan, planner)
        per_file: dict[str, list[tuple[ReadItem, Any]]] = {}
        for req in plan.items:
            md = self.storage_data[req.storage_index]
            target = None if req.type == LoadItemType.BYTE_IO else \
                planner.resolve_tensor(req).detach()
            per_file.setdefault(md.relative_path, []).append((req, target))
        if self.staging is not None:
            self._caller_streams = caller_streams()
        with ThreadPoolExecutor(max_workers=min(self.threads, max(len(per_file), 1)),
                                thread_name_prefix="ckpt-read") as pool:
            futs = [pool.submit(self._read_file, name, jobs) for name, jobs in per_file.items()]
            loaded = [f.result() for f in futs]
        # Planner callbacks mutate the state dict: run them on this thread only.
        for out in loaded:
            for req, value in out:
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, io.BytesIO(value))
                else:
                    planner.commit_tensor(req, value)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _check(self, crc: int, rec: list[Any] | None, where: str) -> None:
        if self.verify and rec is not None and crc != rec[2]:
            raise CheckpointDamaged(f"{where}: checksum mismatch (file damaged)")

    def _read_file(self, name: str, jobs: list[tuple[ReadItem, Any]]) -> list[tuple[ReadItem, Any]]:
        staging = self.staging
        lease = staging.lease() if staging is not None else contextlib.nullcontext()
        with lease as slot:
            ring = None
            if slot is not None:
                slot.begin(self._caller_streams)
                ring = _Ring(slot)
            return self._read_jobs(name, jobs, ring)

    def _read_jobs(self, name: str, jobs: list[tuple[ReadItem, Any]],
                   ring: _Ring | None) -> list[tuple[ReadItem, Any]]:
        path = os.path.join(self.path, name)
        out: list[tuple[ReadItem, Any]] = []
        jobs.sort(key=lambda j: self.storage_data[j[0].storage_index].offset)
        with open(path, "rb", buffering=0) as f:
            for req, target in jobs:
                md = self.storage_data[req.storage_index]
                rec = self.records.get((name, md.offset))
                if rec is None and self._checking:
                    raise CheckpointCorrupt(
                        f"{path}@{md.offset}: {req.storage_index.fqn!r} is stored where the "
                        "manifest has no record (.metadata or manifest damaged); not read")
                if rec is not None and rec[1] != md.length:
                    raise CheckpointCorrupt(f"{path}@{md.offset}: manifest and .metadata disagree")
                where = f"{path}@{md.offset}"
                f.seek(md.offset)
                self.bytes_read += md.length
                if target is not None and rec is not None and self._direct(target, rec, md.length):
                    if ring is not None and self.staging is not None \
                            and self.staging.wants(target):
                        out.append((req, self._read_staged(f, target, rec, md.length, where,
                                                           ring)))
                        continue
                    if target.device.type == "cpu":
                        out.append((req, self._read_direct(f, target, rec, md.length, where)))
                        continue
                buf = bytearray(md.length)
                _read_exact(f, memoryview(buf), where)
                if self.verify and rec is not None:
                    self._check(crc32(buf), rec, where)
                if req.type == LoadItemType.BYTE_IO:
                    out.append((req, bytes(buf)))
                    continue
                tensor = cast(torch.Tensor, torch.load(io.BytesIO(buf), map_location="cpu",
                                                       weights_only=True))
                tensor = narrow_tensor_by_index(tensor, req.storage_offsets, req.lengths)
                if target.size() != tensor.size():
                    raise CheckpointCorrupt(f"{where}: size {tuple(tensor.size())} does not "
                                            f"match the destination {tuple(target.size())}")
                target.copy_(tensor)
                out.append((req, target))
        if ring is not None:
            ring.slot.quiesce()     # every device copy done before DCP hands the tensors on
        return out

    @staticmethod
    def _direct(target: torch.Tensor, rec: list[Any], length: int) -> bool:
        """Whether the record is exactly one of our raw tensor records shaped like ``target``
        (which may live on any device)."""
        if len(rec) < 5 or not recordfmt.encodable(target) or not target.is_contiguous():
            return False
        if str(target.dtype) != rec[4]:
            return False
        prefix, _, suffix, _ = recordfmt._template(target.dtype, tuple(target.shape))
        return rec[3] == len(prefix) and length == len(prefix) + \
            target.numel() * target.element_size() + len(suffix)

    def _read_prefix(self, f: Any, target: torch.Tensor, where: str) -> int:
        """Read and check the record's header; returns its CRC."""
        prefix_t, prefix_crc, _, _ = recordfmt.record_template(target.dtype, tuple(target.shape))
        prefix = bytearray(len(prefix_t))
        _read_exact(f, memoryview(prefix), where)
        if prefix != prefix_t:      # shape/dtype differ from what the record says: not ours
            raise CheckpointCorrupt(f"{where}: record header does not match the destination")
        return prefix_crc

    def _read_suffix(self, f: Any, crc: int, nbytes: int, rec: list[Any], where: str) -> None:
        """Read the record's tail and check the record's CRC (``crc`` covers all before it)."""
        suffix = bytearray(rec[1] - rec[3] - nbytes)
        _read_exact(f, memoryview(suffix), where)
        if self.verify:
            self._check(recordfmt.crc32_combine(crc, zlib.crc32(suffix), len(suffix)), rec, where)

    def _read_staged(self, f: Any, target: torch.Tensor, rec: list[Any], length: int,
                     where: str, ring: _Ring) -> torch.Tensor:
        """The record's data through the staging chunks into ``target`` (any device)."""
        crc = self._read_prefix(f, target, where)
        nbytes = target.numel() * target.element_size()
        dst = flat_bytes(target) if nbytes else None
        done, data_crc = 0, 0
        while done < nbytes:
            chunk, at = ring.room()
            n = min(nbytes - done, chunk.nbytes - at)
            staged = chunk.view[at:at + n]
            _read_exact(f, staged, where)
            if self.verify:
                data_crc = crc32(staged, data_crc)
            ring.slot.to_device(dst[done:done + n], chunk, at)
            ring.used += n
            done += n
        crc = recordfmt.crc32_combine(crc, data_crc, nbytes)
        self._read_suffix(f, crc, nbytes, rec, where)
        return target

    def _read_direct(self, f: Any, target: torch.Tensor, rec: list[Any], length: int,
                     where: str) -> torch.Tensor:
        prefix_crc = self._read_prefix(f, target, where)
        data = recordfmt.bytes_view(target)
        _read_exact(f, data, where)
        crc = recordfmt.crc32_combine(prefix_crc, crc32(data), data.nbytes) \
            if self.verify else 0
        self._read_suffix(f, crc, data.nbytes, rec, where)
        return target
