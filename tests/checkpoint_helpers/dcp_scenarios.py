"""Two gloo ranks run torch's own DCP test scenarios with our storage plugins: ShardedTensors
saved under one sharding and loaded under another (and swapped with a plain tensor), bytes
items, repeated saves into one directory, 1 and 2 writer threads; DTensors saved under one
placement and loaded under another. Prints ``OK <cases>``.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python dcp_scenarios.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
from torch.distributed._shard import sharded_tensor
from torch.distributed._shard.sharding_spec import (ChunkShardingSpec, EnumerableShardingSpec,
                                                    ShardMetadata)
from torch.distributed.checkpoint import load, save

from kempner_resilience.checkpoint.reader import VerifyingReader
from kempner_resilience.checkpoint.writer import ChecksummingWriter

N = 32


def main() -> None:
    warnings.simplefilter("ignore")          # ShardedTensor's deprecation, no_dist notes
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    paths = [tempfile.mkdtemp()] if rank == 0 else [None]
    dist.broadcast_object_list(paths)
    path = paths[0]
    specs = [
        ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1"]),
        ChunkShardingSpec(dim=0, placements=["rank:0", "rank:1", "rank:1", "rank:0"]),
        EnumerableShardingSpec(shards=[
            ShardMetadata(shard_offsets=[0], shard_sizes=[8], placement="rank:1"),
            ShardMetadata(shard_offsets=[8], shard_sizes=[N - 8], placement="rank:0")]),
    ]
    cases = 0
    for threads in (1, 2):
        for saved_as in specs:
            for loaded_as in specs:
                torch.manual_seed(100 * cases + rank)
                saved = {"sharded": sharded_tensor.rand(saved_as, N), "replicated": torch.rand(N),
                         "bytes": [1, "text"]}
                dist.broadcast(saved["replicated"], src=0)
                # Into the same directory every time, as torch's tests do (overwrite=True).
                save(saved, storage_writer=ChecksummingWriter(path, thread_count=threads))
                got = {"sharded": torch.zeros(N), "replicated": sharded_tensor.zeros(loaded_as, N),
                       "bytes": [2]}
                load(got, storage_reader=VerifyingReader(path))
                whole_saved, whole_got = _gather(saved["sharded"]), _gather(got["replicated"])
                if rank == 0:
                    assert torch.equal(whole_saved, got["sharded"]), (saved_as, loaded_as)
                    assert torch.equal(saved["replicated"], whole_got), (saved_as, loaded_as)
                assert got["bytes"] == [1, "text"]
                cases += 1
    # DTensors: saved under one placement, loaded under another (uneven sizes included).
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    placements = [[Shard(0)], [Shard(1)], [Replicate()]]
    for saved_as in placements:
        for loaded_as in placements:
            torch.manual_seed(cases)                       # the same whole tensor on both
            whole = torch.randn(7, 5)
            save({"d": distribute_tensor(whole, mesh, saved_as)},
                 storage_writer=ChecksummingWriter(path))
            got = {"d": distribute_tensor(torch.zeros(7, 5), mesh, loaded_as)}
            load(got, storage_reader=VerifyingReader(path))
            assert torch.equal(got["d"].full_tensor(), whole), (saved_as, loaded_as)
            cases += 1
    dist.barrier()
    print(f"OK {cases}", flush=True)
    # torch's gloo teardown races the peer's exit now and then (an abort with or without our
    # plugins): the result is printed, so leave without it.
    os._exit(0)


def _gather(t):
    out = torch.zeros(t.shape) if dist.get_rank() == 0 else None
    t.gather(out=out)
    return out


if __name__ == "__main__":
    sys.exit(main())
