"""Sharded state (FSDP2 ``fully_shard``, HSDP, any DTensor): what the checkpoint code needs to
know about it, in one place.

DCP already saves and loads DTensors: each rank writes the chunks its local shard holds, a
chunk replicated over several ranks (HSDP's replica groups) is written once (DCP's planner
keeps one writer per chunk), and a load reshards to whatever mesh the destination has. What is
ours:

* ``local`` / ``rewrap``: a background save snapshots a DTensor's local shard (never the
  global tensor: that would gather) and hands DCP a DTensor over the snapshot;
* ``describe_mesh``: the device mesh the model was sharded over, recorded in the manifest so
  ``ls`` and ``verify`` show what a checkpoint was written with;
* ``blob_source``: whose per-rank state (RNG, data position) each rank takes at another world
  size, and the line rank 0 logs about it (docs/sharded.md);
* ``sharded_parts``: whether a ``Stateful`` "app state" holds an FSDP2 model (its state then goes
  through DCP, not into a rank's private blob).
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = None  # type: ignore[assignment,misc]

__all__ = ["is_dtensor", "local", "rewrap", "describe_mesh", "mesh_field", "saved_ranks",
           "blob_source", "world_change_line", "sharded_parts"]


def is_dtensor(t: Any) -> bool:
    """Is ``t`` a DTensor (a sharded or replicated parameter, or optimizer state of one)."""
    return DTensor is not None and isinstance(t, DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, else ``t`` itself."""
    return t._local_tensor if is_dtensor(t) else t   # type: ignore[attr-defined]


def rewrap(buf: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``buf`` (a copy of ``like``'s local shard) as a DTensor with ``like``'s mesh, placements,
    global shape and stride, so DCP plans and writes it as it would ``like``. No collective
    (``run_check=False``); the local tensor may live on another device than the mesh (a host
    snapshot of GPU shards), as in torch's own staged async save."""
    if not is_dtensor(like):
        return buf
    return DTensor.from_local(buf, like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def describe_mesh(modules: Iterable[nn.Module]) -> dict[str, Any] | None:
    """``{"dims": [...], "shape": [...]}`` of the device mesh the modules' DTensor parameters
    live on (the largest one, if several), or None when no parameter is a DTensor (plain or DDP
    models). Dimension names are DeviceMesh's (``None`` where the user gave none)."""
    best: Any = None
    for module in modules:
        for p in module.parameters():
            if is_dtensor(p):
                mesh = p.device_mesh
                if best is None or mesh.size() > best.size():
                    best = mesh
    if best is None:
        return None
    names = best.mesh_dim_names
    return {"dims": list(names) if names else [None] * best.ndim,
            "shape": [int(s) for s in best.shape]}


def mesh_field(modules: Iterable[nn.Module]) -> dict[str, Any]:
    """``{"mesh": describe_mesh(modules)}`` for the manifest of a sharded model, ``{}`` for a
    plain or DDP one (``ls`` then shows the world size)."""
    mesh = describe_mesh(modules)
    return {} if mesh is None else {"mesh": mesh}


def saved_ranks(keys: Iterable[str], prefix: str = "rank_state.rank") -> int:
    """How many ranks wrote a checkpoint, from its per-rank blob keys (0 when it has none)."""
    ranks = [int(k[len(prefix):]) for k in keys
             if k.startswith(prefix) and k[len(prefix):].isdigit()]
    return max(ranks) + 1 if ranks else 0


def blob_source(rank: int, world: int, saved: int) -> int | None:
    """Whose per-rank state (RNG streams, data position, other objects) ``rank`` of ``world``
    takes from a checkpoint written by ``saved`` ranks: its own where it was saved, else that of
    saved rank ``rank % saved``. None when the checkpoint has no per-rank state.

    Per-rank state cannot be resharded (a data position and an RNG stream belong to one rank).
    Weights, optimizer state and the step are exact at any world size; for per-rank state the
    choice that loses least is: shrinking, every rank keeps its own (the saved ranks beyond the
    new world are dropped); growing, the new ranks copy existing ranks round-robin, so each
    saved stream is repeated by as few ranks as possible (all copying rank 0 would give every
    new rank rank 0's dropout masks and data position).
    """
    if saved <= 0:
        return None
    return rank if rank < saved else rank % saved


def world_change_line(world: int, saved: int) -> str | None:
    """The one line rank 0 logs when a checkpoint of ``saved`` ranks resumes on ``world``."""
    if saved <= 0 or saved == world:
        return None
    if world < saved:
        dropped = _ranks(world, saved - 1)
        return (f"checkpoint written by {saved} ranks, resuming on {world}: weights, optimizer "
                f"state and step are resharded exactly; each rank takes its own per-rank state "
                f"(RNG streams, data position, scheduler/other objects) and that of saved "
                f"{dropped} is dropped (docs/sharded.md)")
    written = f"{saved} ranks" if saved > 1 else "1 rank"
    return (f"checkpoint written by {written}, resuming on {world}: weights, optimizer "
            f"state and step are resharded exactly; rank r takes the per-rank state (RNG "
            f"streams, data position, scheduler/other objects) of saved rank r % {saved}, so "
            f"{_ranks(saved, world - 1)} repeat{'s' if world - saved == 1 else ''} the random "
            f"streams and data position of {_ranks(0, min(saved, world - saved) - 1)} "
            f"(docs/sharded.md)")


def _ranks(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}-{last}"


def sharded_parts(obj: Any) -> tuple[list[nn.Module], list[torch.optim.Optimizer]]:
    """The FSDP2/HSDP modules (a DTensor parameter) and the optimizers of DTensor parameters
    that ``obj`` (a ``Stateful`` "app state") holds as attributes or items of a list, tuple or
    dict attribute; none unless it holds such a module. Looked at without calling
    ``obj.state_dict()``: ``get_optimizer_state_dict`` on a fresh optimizer runs a step to
    create its state (Adam's step count then starts at 1)."""
    modules: list[nn.Module] = []
    optims: list[torch.optim.Optimizer] = []
    try:
        attrs = list(vars(obj).values())
    except TypeError:       # no __dict__
        return modules, optims
    for value in attrs:
        items = list(value.values()) if isinstance(value, dict) else \
            list(value) if isinstance(value, (list, tuple)) else [value]
        for item in items:
            if isinstance(item, nn.Module) and any(is_dtensor(p) for p in item.parameters()):
                modules.append(item)
            elif isinstance(item, torch.optim.Optimizer) and any(
                    is_dtensor(p) for g in item.param_groups for p in g["params"]):
                optims.append(item)
    # An LR scheduler holds the optimizer too, but its state is the rank's own (the blob): only
    # an object that holds a sharded module is an app state.
    return (modules, optims) if modules else ([], [])

