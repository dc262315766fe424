"""Start ``world`` real processes of a helper script with a gloo rendezvous on a free port."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from kempner_resilience.demo.launcher import free_port
from helpers import spawn_script

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def run_ranks(script: str, args: list[str], world: int, timeout: float = 120) -> list[str]:
    """Run ``script`` on ``world`` ranks; raise with every rank's output if any fails, else
    return each rank's output (stdout and stderr)."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", LOCAL_RANK=str(rank))
        procs.append(spawn_script([sys.executable, str(HERE / script), *args], env=env,
                                  cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise AssertionError("\n".join(f"--- rank {r} exit {p.returncode}:\n{o}"
                                       for r, (p, o) in enumerate(zip(procs, outs))))
    return outs
