"""How good is the emergency-save time estimate? Estimate / actual for several state sizes.

    .venv/bin/python bench/save_estimate_bench.py [--sizes-mib 2,200,2048] [--ranks 1,2]
        [--dir /tmp/estbench]

For each state size and rank count: a DDP-style replicated model (SGD with momentum: params plus
one buffer of the same size) trained one step, ``--periodic`` saves with ``keep_last=1`` (a run
with ``checkpoint.every_steps`` in its steady state: on this machine's thin-provisioned disk the
first writes into never-used blocks run ~3x slower than later ones into freed blocks), then the estimate the emergency path uses
(every rank's estimate, the largest agreed) and the emergency save itself, timed on every rank
(the slowest counts). Target: estimate / actual between 0.8 and 2. Ranks are real gloo
processes; the disk is the real one under ``--dir``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

MIB = 2**20


def rank_main(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from kempner_resilience.checkpoint import CheckpointManager
    from kempner_resilience.config import CheckpointConfig

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    # params + momentum = size: a few large matrices and some small vectors.
    n_floats = args.size_mib * MIB // 4 // 2
    side = max(int((n_floats // 4) ** 0.5), 1)
    model = torch.nn.Sequential(*[torch.nn.Linear(side, side, bias=True) for _ in range(4)])
    optim = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    cfg = CheckpointConfig(dir=args.dir, keep_last=1)
    mgr = CheckpointManager(cfg, {"model": model, "optim": optim}, rank=rank, world_size=world)
    for step in range(1, args.periodic + 1):
        mgr.save(step)
    est = mgr._agreed_estimate(mgr.estimate())          # what emergency_save decides on
    if world > 1:
        dist.barrier()
    t0 = time.monotonic()
    info = mgr.emergency_save(args.periodic + 1, deadline=time.monotonic() + 3600)
    took = time.monotonic() - t0
    actual = mgr._fg.max(took)
    mgr.close()
    if rank == 0:
        print(json.dumps({"size_mib": args.size_mib, "ranks": world, "estimate_s": est,
                          "actual_s": actual, "state_bytes": mgr.state.nbytes(),
                          "committed": info is not None}), flush=True)
    if world > 1:
        dist.destroy_process_group()


def run_case(size_mib: int, ranks: int, root: Path, periodic: int) -> dict:
    d = root / f"{size_mib}mib-{ranks}r"
    shutil.rmtree(d, ignore_errors=True)
    from kempner_resilience.demo.launcher import free_port

    port = str(free_port())
    procs = []
    for r in range(ranks):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, __file__, "--rank-main", "--dir", str(d),
                                       "--size-mib", str(size_mib), "--periodic",
                                       str(periodic)], env=env,
                                      stdout=subprocess.PIPE, text=True))
    outs = [p.communicate(timeout=900)[0] for p in procs]
    shutil.rmtree(d, ignore_errors=True)
    if any(p.returncode for p in procs):
        raise SystemExit(f"case {size_mib} MiB x {ranks} ranks failed")
    return json.loads(outs[0].strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes-mib", default="2,200,2048")
    ap.add_argument("--ranks", default="1,2")
    ap.add_argument("--dir", default="/tmp/estbench")
    ap.add_argument("--periodic", type=int, default=4, help="periodic saves before the signal")
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--size-mib", type=int, default=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        rank_main(args)
        return
    root = Path(args.dir)
    root.mkdir(parents=True, exist_ok=True)
    print(f"{'state':>9} {'ranks':>5} {'estimate s':>11} {'actual s':>9} {'est/actual':>10}  ok")
    for size in [int(s) for s in args.sizes_mib.split(",")]:
        for ranks in [int(r) for r in args.ranks.split(",")]:
            r = run_case(size, ranks, root, args.periodic)
            ratio = r["estimate_s"] / r["actual_s"]
            print(f"{size:>5} MiB {ranks:>5} {r['estimate_s']:>11.3f} {r['actual_s']:>9.3f} "
                  f"{ratio:>10.2f}  {'yes' if 0.8 <= ratio <= 2 and r['committed'] else 'NO'}",
                  flush=True)


if __name__ == "__main__":
    main()
