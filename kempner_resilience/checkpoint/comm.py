"""The few collectives the checkpoint manager needs, over one process group, and no-ops for a
single process without ``torch.distributed`` initialized."""

from __future__ import annotations

import contextlib
import datetime
from typing import Any, Iterator

import torch
import torch.distributed as dist

__all__ = ["Comm"]


class Comm:
    """Collectives on ``group`` (a gloo group, so CPU objects and tensors work); world 1: local."""

    def __init__(self, group: Any, rank: int, world_size: int) -> None:
        self.group = group
        self.rank = rank
        self.world_size = world_size

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def dcp_group(self) -> Any:
        """What to pass as DCP's ``process_group`` (None runs DCP without collectives)."""
        return self.group if self.distributed else None

    @property
    def dcp_no_dist(self) -> bool:
        """What to pass as DCP's ``no_dist``: a single process runs DCP without collectives even
        when torch.distributed is initialized, whose default group may be NCCL only (a one-GPU
        job): DCP would otherwise run its gathers there."""
        return not self.distributed

    @contextlib.contextmanager
    def bounded(self, seconds: float | None) -> Iterator[None]:
        """Every collective started on this group inside the block (DCP's included) waits at
        most ``seconds`` for the other ranks, then raises (gloo's per-operation timeout); the
        group's previous timeout is back after it. ``None``, one process or a backend without
        the setting: the group's own timeout (gloo's default: 30 min).

        After such a timeout the group is unusable (gloo closes the pairs: every later
        operation raises at once) and the process cannot leave normally while the peer lives
        (gloo's teardown waits for it): the caller treats it as a lost peer and leaves with
        ``os._exit``, as the exit path does for a process group with a dead member."""
        backend = self._backend() if seconds is not None and self.distributed else None
        old = getattr(getattr(backend, "options", None), "_timeout", None)
        if backend is None or old is None:
            yield
            return
        backend._set_default_timeout(datetime.timedelta(seconds=max(float(seconds), 0.001)))
        try:
            yield
        finally:
            backend._set_default_timeout(old)

    def _backend(self) -> Any:
        """The group's gloo backend, if it has one this torch can re-time (private API:
        ``_set_default_timeout`` is what ``dist.distributed_c10d._set_pg_timeout`` calls)."""
        try:
            backend = self.group._get_backend(torch.device("cpu"))
        except (AttributeError, RuntimeError):
            return None
        return backend if hasattr(backend, "_set_default_timeout") else None

    def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.group, 0)
                                   if self.group is not None else 0, group=self.group)
        return box[0]

    def max(self, value: float) -> float:
        if not self.distributed:
            return value
        t = torch.tensor([float(value)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return float(t.item())

    def max_async(self, value: float) -> "PendingMax":
        """Start a MAX all-reduce now, read it later (hides the latency behind a training step)."""
        return PendingMax(self, value)


class PendingMax:
    """An all-reduce in flight; ``result()`` waits for it."""

    def __init__(self, comm: Comm, value: float) -> None:
        self._t = torch.tensor([float(value)], dtype=torch.float64)
        self._work = None
        if comm.distributed:
            self._work = dist.all_reduce(self._t, op=dist.ReduceOp.MAX, group=comm.group,
                                         async_op=True)

    def result(self) -> float:
        if self._work is not None:
            self._work.wait()
        return float(self._t.item())
