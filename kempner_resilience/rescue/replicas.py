"""Does every rank hold the full training state? Only then can one survivor write all of it.

Decided once at start, from the state itself: sharded parameters (FSDP, ``fully_shard``, any
DTensor) or a sharded optimizer (``ZeroRedundancyOptimizer``) rule the rescue out. DDP keeps its
module replicated (it broadcasts at construction and applies the same averaged gradients
everywhere); modules outside DDP are compared across ranks through a checksum of their tensors
(``fingerprint``), so a model-parallel shard held as plain tensors is not mistaken for a replica.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from kempner_resilience.checkpoint.state import TrainState

__all__ = ["local_problem", "fingerprint"]


def _sharding_types() -> tuple[type, ...]:
    found: list[type] = []
    try:
        from torch.distributed.tensor import DTensor
        found.append(DTensor)
    except ImportError:  # pragma: no cover - torch without DTensor
        pass
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
        found.append(FullyShardedDataParallel)
    except ImportError:  # pragma: no cover
        pass
    try:
        from torch.distributed.fsdp import FSDPModule
        found.append(FSDPModule)
    except ImportError:  # pragma: no cover
        pass
    return tuple(found)


def local_problem(state: TrainState, sharded_ok: bool = False) -> str | None:
    """Why this rank's state is not a full replica, or None. ``sharded_ok``: DTensors and
    ``fully_shard`` modules are allowed (``rescue.sharded`` found the replicas of each shard)."""
    sharded = () if sharded_ok else _sharding_types()
    for name, module in state.modules.items():
        for sub in module.modules():
            if sharded and isinstance(sub, sharded):
                return (f"state[{name!r}] is sharded ({type(sub).__name__}): each rank holds "
                        "a part; the rescue supports DDP and replicated modules only")
        for p in module.parameters():
            if sharded and isinstance(p, sharded):
                return (f"state[{name!r}] has sharded parameters (DTensor): each rank holds a "
                        "part; the rescue supports DDP and replicated modules only")
    for name in state.apps:
        return (f"state[{name!r}] holds sharded state (DTensor): each rank holds a part; the "
                "rescue supports DDP and replicated modules only")
    for name, (optim, _) in state.optims.items():
        if type(optim).__name__ == "ZeroRedundancyOptimizer":
            return (f"state[{name!r}] is a ZeroRedundancyOptimizer: the optimizer state is "
                    "sharded over the ranks")
    return None


def _crc(t: torch.Tensor, crc: int) -> int:
    t = t.detach()
    t = t.to_local() if hasattr(t, "to_local") else t      # a DTensor: this rank's shard
    if t.numel() == 0:
        return crc
    raw = t.contiguous().reshape(-1).view(torch.uint8).cpu()
    return zlib.crc32(raw.numpy(), crc)


def fingerprint(state: TrainState) -> int:
    """A checksum of the tensors of the modules not wrapped in DDP (0 when every module is):
    equal on every rank when they are replicas (sharded modules: their local shards, equal on
    the ranks that hold the same shards)."""
    crc = 0
    for name, module in sorted(state.modules.items()):
        if isinstance(module, DDP):
            continue
        assert isinstance(module, nn.Module)
        for key, value in module.state_dict().items():
            if isinstance(value, torch.Tensor):
                crc = zlib.crc32(key.encode(), crc)
                crc = _crc(value, crc)
    return crc
