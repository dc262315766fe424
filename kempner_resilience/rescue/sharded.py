"""The rescue of sharded state (HSDP): each shard from a surviving holder.

Under FSDP2 (``fully_shard``) each rank holds one shard of every parameter and of its optimizer
state (DTensors). On an HSDP mesh (``("replicate", "shard")``) each shard lives once per replica
group: the ranks with the same coordinates on the mesh's sharded dimensions (a *column*) hold
bitwise the same local tensors. When a rank or a whole node dies, every column still has a live
holder as long as one replica group survives, so the state of the last step boundary can be
written:

* ``detect`` (at start, every rank alike) finds the DTensors of the state, the one mesh they live
  on, the mesh dimensions on which every one of them is replicated, and each rank's column. With
  no replicated dimension (pure FSDP, a 1-D mesh) no survivor holds a dead rank's shards: the
  rescue is off, and ``detect`` says why in one line.
* ``contribute`` (a survivor that does not write, after a failure): its local shards at the
  boundary, copied once into one file of the rescue directory (``shards.c<col>.step<S>``), by the
  first holder of each column only (the file appears whole, created only if absent). A holder
  that cannot (its state moved past the boundary) says so (``noshards.<rank>``), so the writer
  stops waiting for a column whose holders all refused or never reached the rescue (dead).
* ``chunked`` (the writer): its own state dict with every DTensor replaced by all of its chunks
  (its own local shard and the other columns' from the files); ``ChunkPlanner`` writes them as
  one no-collective DCP save whose metadata describes each tensor by the same chunks (offsets,
  sizes) as a periodic save of that state at that world size, so any mesh loads it (DCP
  reshards).

Non-DTensor tensors (buffers, AdamW's ``step``) and other values are the same on every rank of a
DCP save (its planner keeps one copy): the writer's own.
"""

from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, NamedTuple

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                   TensorProperties)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from kempner_resilience.checkpoint.info import CheckpointError
from kempner_resilience.checkpoint.state import TrainState
from kempner_resilience.core.fileio import write_atomic
from kempner_resilience.core.log import get_logger

try:
    from torch.distributed.tensor import DTensor, Replicate
except ImportError:  # pragma: no cover - torch without DTensor
    DTensor = Replicate = None  # type: ignore[assignment,misc]

__all__ = ["ShardLayout", "detect", "is_dtensor", "local_shards", "contribute", "refuse", "columns_have", "refused",
           "load_column", "chunked", "ChunkPlanner"]

log = get_logger(__name__)

Path_ = tuple[Any, ...]          # where a value sits in a nested state dict


class ShardLayout(NamedTuple):
    """Which rank holds which shards: ranks of one column hold the same local tensors."""

    column: int                  # this rank's column
    columns: tuple[int, ...]     # the column of every rank (by global rank)
    mesh: str                    # the mesh, for the log line: "replicate=2 x shard=2"

    @property
    def count(self) -> int:
        return max(self.columns) + 1

    def holders(self, column: int) -> list[int]:
        return [r for r, c in enumerate(self.columns) if c == column]

    def describe(self) -> str:
        return (f"sharded state on mesh {self.mesh}, each of {self.count} shard columns held by "
                f"{len(self.columns) // self.count} ranks")


def _dtensor_params(state: TrainState) -> list[tuple[str, Any]]:
    if DTensor is None:
        return []
    return [(f"{name}.{pname}", p) for name, module in state.modules.items()
            for pname, p in module.named_parameters() if isinstance(p, DTensor)]


def detect(state: TrainState, world_size: int) -> tuple[ShardLayout | None, str | None]:
    """``(None, None)``: no DTensor in the state (DDP or replicated modules). ``(layout, None)``:
    sharded with a replica dimension, rescuable. ``(None, why)``: sharded, not rescuable."""
    params = _dtensor_params(state)
    if not params:
        return None, None
    mesh = params[0][1].device_mesh
    ranks = mesh.mesh
    names = mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(ranks.ndim))
    shape = " x ".join(f"{n}={s}" for n, s in zip(names, ranks.shape))
    for name, p in params:
        if p.device_mesh != mesh:
            return None, (f"{name} lives on another device mesh than {params[0][0]}; the "
                          "rescue of sharded state supports one mesh")
    replicated = [d for d in range(ranks.ndim)
                  if all(isinstance(p.placements[d], Replicate) for _, p in params)]
    if not any(ranks.shape[d] > 1 for d in replicated):
        return None, (f"sharded without a replica dimension (FSDP on mesh {shape}): no "
                      "surviving rank holds a lost rank's shards, so the run falls back to its "
                      "newest checkpoint; HSDP (a (\"replicate\", \"shard\") mesh) is rescued")
    if ranks.numel() != world_size or sorted(ranks.flatten().tolist()) != list(range(world_size)):
        return None, (f"the device mesh {shape} does not span the {world_size} ranks of the run")
    sharded_dims = [d for d in range(ranks.ndim) if d not in replicated]
    cols = [0] * world_size
    # The column: the coordinates on the sharded dimensions, numbered in mesh order.
    moved = ranks.permute(*replicated, *sharded_dims).reshape(
        -1, max(1, int(torch.tensor([ranks.shape[d] for d in sharded_dims]).prod())))
    for row in moved.tolist():
        for col, rank in enumerate(row):
            cols[rank] = col
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    return ShardLayout(cols[rank], tuple(cols), shape), None


def _walk(value: Any, path: Path_ = ()) -> Iterator[tuple[Path_, Any]]:
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _walk(v, path + (k,))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            yield from _walk(v, path + (i,))
    else:
        yield path, value


def local_shards(sd: Mapping[str, Any]) -> dict[Path_, tuple[tuple[int, ...], torch.Tensor]]:
    """Every DTensor of a state dict: its path -> (global offsets, local tensor: live)."""
    out = {}
    for path, value in _walk(sd):
        if DTensor is not None and isinstance(value, DTensor):
            chunk = value.__create_chunk_list__()[0]
            out[path] = (tuple(chunk.offsets), value.to_local())
    return out


def is_dtensor(value: Any) -> bool:
    return DTensor is not None and isinstance(value, DTensor)


def _name(column: int, step: int) -> str:
    return f"shards.c{column}.step{step}"


def contribute(directory: Path, state: TrainState, layout: ShardLayout, step: int,
               still_valid: Callable[[], str | None]) -> str | None:
    """Write this rank's local shards at boundary ``step`` for its column, unless a holder of
    that column already did. Returns why not (None: written, or already there)."""
    target = directory / _name(layout.column, step)
    if target.exists():
        return None
    shards = local_shards(state.tensor_state())
    buf = io.BytesIO()
    torch.save({"step": step, "column": layout.column,
                "shards": {path: (off, t.detach().cpu()) for path, (off, t) in shards.items()}},
               buf)
    # The bytes are a copy: checked after it, they are the boundary's or nothing is offered.
    why = still_valid()
    if why is not None:
        return why
    # Created only if absent: a column's first holder wins, and the file appears whole.
    write_atomic(target, buf.getvalue(), exclusive=True, durable=False, mode=0o600)
    return None


def offer(directory: Path, state: TrainState, layout: ShardLayout, rank: int,
          step: int | None, still_valid: Callable[[], str | None]) -> None:
    """A survivor that does not write: offer its shards of boundary ``step`` (``contribute``),
    or say that it has none (``step`` None: its state is not at the boundary). Never raises."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        why = "its state is not at the boundary" if step is None else contribute(
            directory, state, layout, step, still_valid)
        if why is not None:
            refuse(directory, rank)
            log.warning("rescue: this rank offers no shards: %s", why)
    except (OSError, RuntimeError) as e:
        log.warning("rescue: cannot offer this rank's shards in %s: %s", directory, e)
        with contextlib.suppress(OSError):
            refuse(directory, rank)


def missing(directory: Path, layout: ShardLayout, step: int) -> set[int]:
    """The columns other than the writer's whose shards of ``step`` are not offered yet."""
    return set(range(layout.count)) - {layout.column} - columns_have(directory, step,
                                                                     layout.count)


def hopeless(directory: Path, layout: ShardLayout, missing_cols: set[int], offered: set[int],
             waited_s: float, give_up_s: float) -> bool:
    """A missing column is not coming: each of its holders said it has nothing, or (after
    ``give_up_s`` of waiting) never offered anything at all (``offered``: the ranks that
    reached the rescue; a live holder is woken over the buddy links within that time)."""
    if not missing_cols:
        return False
    said = refused(directory)
    return any(all(h in said or (h not in offered and waited_s >= give_up_s)
                   for h in layout.holders(c)) for c in missing_cols)


def collect(directory: Path, layout: ShardLayout, step: int, missing_cols: set[int]
            ) -> tuple[list[dict] | None, str | None]:
    """The other columns' shards for the writer, or why there are none."""
    if missing_cols:
        return None, (f"no shards of step {step} for shard column(s) {sorted(missing_cols)} "
                      f"(held by ranks {[layout.holders(c) for c in sorted(missing_cols)]}: "
                      "gone, or past the boundary)")
    try:
        return [load_column(directory, c, step) for c in range(layout.count)
                if c != layout.column], None
    except (OSError, RuntimeError, KeyError, CheckpointError) as e:
        return None, f"a shard file of step {step} cannot be read ({type(e).__name__}: {e})"


def refuse(directory: Path, rank: int) -> None:
    """Say that this rank offers no shards (its state is not at the boundary)."""
    write_atomic(directory / f"noshards.{rank}", b"", durable=False, mode=0o600)


def columns_have(directory: Path, step: int, count: int) -> set[int]:
    return {c for c in range(count) if (directory / _name(c, step)).exists()}


def refused(directory: Path) -> set[int]:
    """The ranks that said they offer no shards."""
    return {int(p.name.split(".", 1)[1]) for p in directory.glob("noshards.*")
            if p.name.split(".", 1)[1].isdigit()}


def load_column(directory: Path, column: int, step: int) -> dict[Path_, tuple]:
    """One column's shards as a holder wrote them (``contribute``)."""
    raw = torch.load(directory / _name(column, step), map_location="cpu", weights_only=True)
    if raw["step"] != step or raw["column"] != column:
        raise CheckpointError(f"the shard file of column {column} holds step {raw['step']}, "
                              f"column {raw['column']}")
    return raw["shards"]


class _Chunks:
    """All chunks of one DTensor, as a DCP save of it on every rank would describe them."""

    def __init__(self, like: Any, chunks: list[tuple[tuple[int, ...], torch.Tensor]]) -> None:
        self.size = like.size()
        self.chunks = {torch.Size(off): t for off, t in chunks}

    def __create_write_items__(self, fqn: str, _obj: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, off), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=off, sizes=t.size()),
                              properties=TensorProperties.create_from_tensor(t),
                              size=self.size))
                for off, t in self.chunks.items()]


def chunked(sd: dict[str, Any], own: Mapping[Path_, tuple], others: list[Mapping[Path_, tuple]]
            ) -> dict[str, Any]:
    """``sd`` (the writer's state dict) with each DTensor replaced by all its chunks: the
    writer's own (``own``, from ``local_shards``) and the other columns' (``others``).
    Raises CheckpointError when a column lacks a tensor the writer has."""
    def put(container: Any, path: Path_, value: Any) -> None:
        for key in path[:-1]:
            container = container[key]
        container[path[-1]] = value

    # The containers copied (not the tensors): an optimizer's state dict may share its dicts
    # with the live optimizer, which must not see the placeholders.
    sd = _containers(sd)
    for path, (off, local) in own.items():
        chunks = [(off, local)]
        for column in others:
            if path not in column:
                raise CheckpointError(f"a shard file lacks {'.'.join(map(str, path))}")
            chunks.append(column[path])
        like = sd
        for key in path:
            like = like[key]
        put(sd, path, _Chunks(like, chunks))
    return sd


def _containers(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _containers(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_containers(v) for v in value]
    return value


class ChunkPlanner(DefaultSavePlanner):
    """DCP's default save planner, which also finds each chunk of a ``_Chunks`` value."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict[index.fqn]
        if isinstance(obj, _Chunks):
            return obj.chunks[torch.Size(index.offset)]
        return super().lookup_object(index)
