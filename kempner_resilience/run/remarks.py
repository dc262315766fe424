"""What rank 0 says about the training loop itself, one line each: what a resumed run has left
to train, and a run whose script never iterated ``run.steps()`` (it exits 0 without a single
checkpoint, so a requeue would start the script over and nobody would notice)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kempner_resilience.core.log import announce, get_logger
from kempner_resilience.runstate import RunParts

if TYPE_CHECKING:
    from kempner_resilience.checkpoint.info import CheckpointInfo

__all__ = ["say_what_remains", "say_if_never_looped"]

log = get_logger(__name__)


def say_what_remains(parts: RunParts, step: int, total: int) -> None:
    """Rank 0, when ``steps`` starts after a resume: a run that already reached ``total``
    says it is complete and trains nothing; one whose loop had finished before says it
    trains longer."""
    if parts.rank != 0 or parts.resumed_from is None or parts.ckpt is None:
        return
    done = parts.completed_step        # read from run.json at the start (begin.py)
    if step >= total:
        announce(log, "run %s is complete: it resumed at step %d and run.steps(%d) has no "
                 "step left to train. To train longer, raise the total; to start a new run "
                 "in this directory, set checkpoint.resume: false (this run's checkpoints "
                 "are kept)", parts.run_id, step, total)
    elif done is not None and done < total:
        announce(log, "run %s finished run.steps(%d) before; training longer: steps %d to "
                 "%d", parts.run_id, done, step, total)


def say_if_never_looped(parts: RunParts, looped: bool, saved: CheckpointInfo | None) -> None:
    """Rank 0, at a clean exit: a run with state whose script never iterated ``run.steps()``
    and saved nothing by hand had no step boundary, so nothing could stop, save or resume."""
    if looped or parts.ckpt is None or parts.rank != 0 or saved is not None:
        return
    log.warning("the run ended without iterating run.steps(): no step boundary, so no "
                "checkpoint in %s and a requeue would start the script over. Train inside "
                "`for step in run.steps(total):` in the `with ResilientRun(...)` block",
                parts.ckpt.paths.root)
