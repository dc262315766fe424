"""One part of a checkpoint, written and loaded by the processes that hold it (a Ray worker
group's actors, over their own process group), into the subdirectory the committing process
gave them (``delegated.py``).

Each process's state is a ``TrainState`` as a rank's is: its modules and optimizers through
DCP's state-dict API, everything else (RNG streams, objects) in its rank's blob. The files go
through ``ChecksummingWriter``, whose table (sizes, CRC-32s, records) is what ``save_part``
returns for the manifest; ``load_part`` reads through ``VerifyingReader`` against the part of
the manifest that describes them, so a damaged byte fails the load as it fails any resume.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from kempner_resilience.checkpoint.reader import VerifyingReader
from kempner_resilience.checkpoint.state import TrainState
from kempner_resilience.checkpoint.writer import ChecksummingWriter

__all__ = ["save_part", "load_part"]


def _dist(group: Any) -> tuple[Any, bool]:
    """(DCP's process group, no_dist): the default group when one is up, else none."""
    import torch.distributed as dist

    live = dist.is_available() and dist.is_initialized()
    return (group if live else None), not live


def save_part(state: TrainState, directory: Path, step: int, rank: int,
              group: Any = None) -> dict[str, Any]:
    """Write this process's ``state`` of ``step`` into ``directory`` (collective over
    ``group``, default the default group); this rank's file table (with ``.metadata`` on
    rank 0)."""
    pg, no_dist = _dist(group)
    writer = ChecksummingWriter(directory, overwrite=False)
    dcp.save(state.capture(step, rank), storage_writer=writer, process_group=pg,
             no_dist=no_dist)
    return dict(writer.files)


def load_part(state: TrainState, directory: Path, manifest: Mapping[str, Any], rank: int,
              world_size: int, group: Any = None) -> int | None:
    """Load ``state`` from ``directory``, checked against ``manifest`` (the part's, names
    relative to ``directory``); the saved step (None without a blob). Collective."""
    pg, no_dist = _dist(group)
    reader = VerifyingReader(directory, dict(manifest))
    metadata = reader.read_metadata()
    sd, blob_key = state.load_template(rank, set(metadata.state_dict_metadata), world_size)
    dcp.load(sd, storage_reader=reader, planner=DefaultLoadPlanner(), process_group=pg,
             no_dist=no_dist)
    return state.restore(sd, blob_key)
