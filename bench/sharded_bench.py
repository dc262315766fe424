"""The save of sharded state per byte, against the DDP save of the same state.

    .venv/bin/python bench/sharded_bench.py [--size-gib 0.75] [--rounds 3] [--dir /tmp/shbench]
    .venv/bin/python bench/sharded_bench.py --modes ddp,fsdp --ranks 2

A model of ``--size-gib / 3`` in parameters (a few large matrices, many small vectors, as in
``checkpoint_bench.py``) plus Adam's two moments after one step: ``--size-gib`` of state in all.
For each mode, ``--ranks`` gloo processes on this machine hold it as

* ``ddp``:  DDP, every rank a full replica (DCP writes each replicated tensor once, the writes
  spread over the ranks);
* ``fsdp``: ``fully_shard`` on a 1-D mesh, each rank a 1/``ranks`` shard;
* ``hsdp``: ``fully_shard`` on a 2-D ``("replicate", "shard")`` mesh, 2 replica groups (each
  shard written once, by one of them);

and write ``--rounds`` emergency checkpoints (``CheckpointManager.emergency_save``: DCP through
the checksumming writer, committed by rank 0), each into a fresh directory. Prints, per mode,
the checkpoint's bytes (the manifest's ``nbytes``) over the slowest rank's save time, in GiB/s
(median of the rounds), and the ratio to the DDP figure. ``dd conv=fsync`` of the same bytes
is printed for the disk's speed in the same run; the 1-minute load average goes with the
figures (other jobs on the machine skew them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GIB = 2**30


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from bench.checkpoint_bench import Params
    from kempner_resilience.checkpoint import CheckpointManager
    from kempner_resilience.config import CheckpointConfig

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model: torch.nn.Module = Params(int(args.size_gib * GIB / 3), args.tensors // 4)
    if args.mode == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        shape = (2, world // 2) if args.mode == "hsdp" else (world,)
        names = ("replicate", "shard") if args.mode == "hsdp" else ("shard",)
        fully_shard(model, mesh=init_device_mesh("cpu", shape, mesh_dim_names=names))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    optim.zero_grad(set_to_none=True)
    root = Path(args.dir) / args.mode
    cfg = CheckpointConfig(dir=str(root), keep_last=1, ledger=False)
    mgr = CheckpointManager(cfg, {"model": model, "optim": optim}, rank=rank, world_size=world)
    times, nbytes = [], 0
    for i in range(args.rounds):
        dist.barrier()
        t0 = time.perf_counter()
        info = mgr.emergency_save(i + 1)
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)      # the slowest rank's save
        times.append(float(t))
        nbytes = info.nbytes
    mgr.close()
    if rank == 0:
        print(json.dumps({"mode": args.mode, "nbytes": nbytes, "seconds": times}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


def run_mode(args: argparse.Namespace, mode: str) -> dict:
    from kempner_resilience.demo.launcher import free_port

    world = 4 if mode == "hsdp" and args.ranks < 4 else args.ranks
    port = str(free_port())
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(
            [sys.executable, __file__, "--rank-main", "--mode", mode, "--size-gib",
             str(args.size_gib), "--tensors", str(args.tensors), "--rounds", str(args.rounds),
             "--dir", args.dir], env=env, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"{mode}: a rank failed: {[p.returncode for p in procs]}")
    result = json.loads(outs[0].strip().splitlines()[-1])
    result["world"] = world
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-gib", type=float, default=0.75)
    ap.add_argument("--tensors", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--modes", default="ddp,fsdp,hsdp")
    ap.add_argument("--dir", default="/tmp/shbench")
    ap.add_argument("--rank-main", action="store_true")
    ap.add_argument("--mode", default="ddp")
    args = ap.parse_args()
    if args.rank_main:
        rank_main(args)
        return
    from bench.checkpoint_bench import dd_write

    shutil.rmtree(args.dir, ignore_errors=True)
    Path(args.dir).mkdir(parents=True)
    dd = dd_write(Path(args.dir) / "dd.bin", int(args.size_gib * GIB))
    (Path(args.dir) / "dd.bin").unlink()
    print(f"state {args.size_gib} GiB, {args.rounds} rounds; dd write+fsync {dd:.2f} GiB/s; "
          f"load {os.getloadavg()[0]:.2f}")
    base = None
    for mode in args.modes.split(","):
        r = run_mode(args, mode)
        gbs = r["nbytes"] / statistics.median(r["seconds"]) / GIB
        base = gbs if mode == "ddp" else base
        vs = f"{gbs / base:.2f}x ddp" if base else ""
        rounds = ", ".join(f"{r['nbytes'] / s / GIB:.2f}" for s in r["seconds"])
        print(f"{mode:5s} world {r['world']}: checkpoint {r['nbytes'] / GIB:.3f} GiB, "
              f"median {gbs:.2f} GiB/s ({rounds}); {vs} {dd and gbs / dd:.2f}x dd; "
              f"load {os.getloadavg()[0]:.2f}", flush=True)
        shutil.rmtree(Path(args.dir) / mode, ignore_errors=True)


if __name__ == "__main__":
    main()
