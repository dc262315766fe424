"""The demo trainer as a function to submit with submitit: ``kempner_resilience.integrations.
submitit.submit(train_demo, ...)`` tries the integration out without writing a training script."""

from __future__ import annotations

import os
from typing import Any, Sequence

from kempner_resilience.demo.compare import weights_digest

__all__ = ["train_demo"]


def train_demo(steps: int = 40, step_time: float = 0.0, out: str | None = None,
               progress: str | None = None, quiet: bool = False,
               overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Run ``kempner_resilience.demo.train`` (an MLP under ResilientRun, DDP over gloo when the
    job has several tasks) with the job's configuration; a ready-made function to submit.

    Returns ``{"rank", "world", "steps", "exit", "restart_count", "digest"}``; ``digest``
    (rank 0, with ``out``) is ``weights_digest`` of the final weights.
    """
    from kempner_resilience.demo import train

    argv = ["--steps", str(steps), "--step-time", str(step_time)]
    if os.environ.get("KEMPNER_RESILIENCE_CONFIG"):
        argv += ["--config", os.environ["KEMPNER_RESILIENCE_CONFIG"]]
    for o in overrides:
        argv += ["--set", o]
    if out:
        argv += ["--out", str(out)]
    if progress:
        argv += ["--progress", str(progress)]
    if quiet:
        argv.append("--quiet")
    code = train.main(argv)
    rank = int(os.environ.get("RANK", "0"))
    restart = os.environ.get("SLURM_RESTART_COUNT") or os.environ.get("KEMPNER_RESTART_COUNT", "")
    return {"rank": rank, "world": int(os.environ.get("WORLD_SIZE", "1")), "steps": steps,
            "exit": code, "restart_count": int(restart) if restart.isdigit() else 0,
            "digest": weights_digest(out) if out and rank == 0 else None}
