"""Writing the rescue checkpoint: one process, no collective, a normal committed checkpoint.

The writer holds a full replica (DDP), so its live parameters and optimizer state, still at the
boundary (``Boundary`` refused otherwise), with the persistent buffers and the optimizers'
param-group settings put back to their boundary copies, are the whole tensor state. Sharded
(HSDP): its own shards and, from the rescue files, one holder's shards of every other column
(``sharded``), written as all the chunks of each DTensor, as a periodic save describes them.
The per-rank blobs (RNG streams, data position, scheduler) of every rank come from the
snapshots: its own, and the others' from the rescue files.
DCP writes them without a process group (``no_dist``: one ``__0_0.distcp`` file that any world
size loads) through the package's checksumming writer into a fresh step directory, and the
manifest commit makes it visible, exactly as for any save. Nothing is committed on any error:
the partial directory is removed (or, if the process dies, left uncommitted; resume skips it).
"""

from __future__ import annotations

import contextlib
import io
import time
from typing import Any, Callable, Mapping

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from kempner_resilience.checkpoint import commit, layout, retention
from kempner_resilience.checkpoint.ddp_buckets import RECORD_KEY
from kempner_resilience.checkpoint.info import CheckpointError, CheckpointInfo, describe_error
from kempner_resilience.checkpoint.state import TrainState, rank_key
from kempner_resilience.checkpoint.writer import ChecksummingWriter
from kempner_resilience.core.gcpause import gc_paused
from kempner_resilience.core.runpaths import RunPaths
from kempner_resilience.rescue import sharded
from kempner_resilience.rescue.boundary import Boundary, decode

__all__ = ["write_rescue"]


def _state_dict(state: TrainState, boundary: Boundary, blobs: Mapping[int, bytes],
                step: int, shards: list[Mapping[Any, tuple]] | None) -> dict[str, Any]:
    sd = state.tensor_state()
    buffers = boundary.boundary_buffers()
    if buffers:
        for name in state.modules:
            sd[name] = {k: buffers.get(v.data_ptr(), v)
                        if isinstance(v, torch.Tensor) and v.numel()
                        and not sharded.is_dtensor(v) else v
                        for k, v in sd[name].items()}
    for name, settings in boundary.boundary_settings().items():
        # The step after the boundary may have set its own lr already: the boundary's values.
        groups = sd.get(name, {}).get("param_groups") if isinstance(sd.get(name), dict) else None
        if groups is not None and len(groups) == len(settings):
            sd[name]["param_groups"] = [{**live, **saved} for live, saved in zip(groups, settings)]
    if shards is not None:
        # Sharded (HSDP): every DTensor as all its chunks, this rank's and the other columns'.
        sd = sharded.chunked(sd, sharded.local_shards(sd), shards)
    record = state.buckets.record(observe=False) if state.buckets.ddps else None
    for rank, payload in sorted(blobs.items()):
        blob = decode(payload)
        if blob["step"] != step:
            raise CheckpointError(f"rank {rank}'s snapshot is of step {blob['step']}, not {step}")
        if record is not None:
            blob[RECORD_KEY] = record
        # The optimizers that had not stepped (TrainState.tensor_state): a resume from this
        # rescue leaves them without state, as they were.
        blob["fresh_optims"] = list(state.fresh_optims)
        buf = io.BytesIO()
        torch.save(blob, buf)
        sd[rank_key(rank)] = buf.getvalue()
    return sd


@gc_paused()       # the process's last save: no full collections during it
def write_rescue(state: TrainState, boundary: Boundary, blobs: Mapping[int, bytes], step: int,
                 *, paths: RunPaths, run_id: str | None, io_threads: int, world_size: int,
                 extra: Mapping[str, Any], shards: list[Mapping[Any, tuple]] | None = None,
                 still_valid: Callable[[], str | None] = lambda: None) -> CheckpointInfo:
    """Write and commit the state of boundary ``step`` in the run's directory (``paths``);
    ``blobs`` holds every rank's snapshot of it. ``extra`` goes into the manifest (run id, job,
    the rescue's record). ``shards`` (sharded state): the other columns' local shards
    (``sharded.load_column``), which with this rank's own make up every DTensor.
    ``still_valid`` runs after the write, before the commit: a reason there (the live state
    moved during the write) commits nothing. Raises CheckpointError (nothing committed) on any
    failure."""
    t0 = time.monotonic()
    sd = _state_dict(state, boundary, blobs, step, shards)
    try:
        path = layout.create_step_dir(paths, step, run_id)
    except OSError as e:
        raise CheckpointError(f"rescue of step {step}: cannot create its directory under "
                              f"{paths}: {describe_error(e)}") from None
    status: str | None = None
    manifest: dict[str, Any] = {}
    try:
        writer = ChecksummingWriter(path, overwrite=False, threads=io_threads)
        planner = DefaultSavePlanner() if shards is None else sharded.ChunkPlanner()
        dcp.save(sd, storage_writer=writer, planner=planner, no_dist=True)
        # What was checked before the write, checked again: the files hold the live tensors
        # as they were while written, so they are the boundary's only if nothing stepped.
        status = still_valid()
        if status is None:
            status = commit.commit(path, step, "rescue", [(writer.files, None)], t0, 0.0,
                                   world_size, manifest, {"run_id": run_id, **extra})
    except (Exception, CheckpointException) as e:
        status = describe_error(e)
    if status is not None:
        with contextlib.suppress(OSError):
            retention.remove_dir(path)
        raise CheckpointError(f"rescue of step {step} into {path} failed: {status}; the "
                              "partial directory was removed")
    return CheckpointInfo(step=step, path=path, reason="rescue",
                          committed_at=manifest["committed_at"], nbytes=manifest["nbytes"],
                          world_size=world_size, save_seconds=time.monotonic() - t0,
                          blocked_seconds=time.monotonic() - t0)
