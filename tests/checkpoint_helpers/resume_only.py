"""Subprocess entry point: resume the toy from ``--dir`` on ``WORLD_SIZE`` gloo ranks and print
what happened (no training, no saving).

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=... python resume_only.py --dir D
        [--probe FILE]

With ``--probe``, first prints ``probe readable: yes|no``: whether this process can read FILE,
so a test can check that the permissions it set really apply to this process. Then prints
``resumed STEP`` (or ``resumed none``). Log lines go to stderr.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from checkpoint_helpers import toy  # noqa: E402
from kempner_resilience.checkpoint import CheckpointManager  # noqa: E402
from kempner_resilience.config import CheckpointConfig  # noqa: E402
from kempner_resilience.core.log import configure  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--probe")
    args = ap.parse_args()
    configure("INFO")
    torch.set_num_threads(1)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if args.probe:
        try:
            with open(args.probe, "rb"):
                readable = "yes"
        except OSError:
            readable = "no"
        print(f"probe readable: {readable}", flush=True)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    state = toy.build(rank)
    mgr = CheckpointManager(CheckpointConfig(dir=args.dir, keep_last=5), state, rank=rank,
                            world_size=world)
    info = mgr.resume()
    print(f"resumed {info.step if info else 'none'}", flush=True)
    mgr.close()
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
