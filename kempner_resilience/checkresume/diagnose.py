"""The likely cause of an inexact resume, read from what differs at the first step that differs.

The first diverging checkpoint says the most: later ones differ everywhere, because a different
update spreads through every weight. What differs there, and how many steps after the stop,
points at the usual traps (issue 31):

- only the optimizer's learning rate, and no scheduler in the checkpoint: an LR scheduler not
  in ``state`` restarted at the resume (the optimizer's restored lr is right for one step, then
  the scheduler's own count sets another);
- a scheduler's own entries: it is in ``state`` but restored differently;
- the data position: the loader is not in ``state``, or batches were drawn outside the steps;
- RNG streams: a global RNG drawn from where the checkpoint cannot see it (a batch drawn before
  the loop, a sampler or augmentation with an RNG of its own);
- model and optimizer only, with the data position and RNG streams equal: the step trained on
  something the checkpoint does not hold, a variable carried from one step to the next. Right
  after the stop that is typically a prefetched batch; some steps after it, gradients
  accumulated over a window the stop cut (the optimizer steps only at the window's end);
- any of these before the first stop: the script does not repeat itself even uninterrupted.
"""

from __future__ import annotations

from typing import Iterable

from kempner_resilience.checkresume.compare import EntryDiff
from kempner_resilience.checkresume.snapshot import Kind

__all__ = ["likely_causes", "CARRIED", "ACCUMULATED", "SCHEDULER", "NONDETERMINISTIC"]

CARRIED = ("a variable carried from one step to the next is not in state (a prefetched batch, "
           "accumulated gradients, a running value the update uses): the first step after the "
           "resume trained on something else than the uninterrupted run's step did. Everything "
           "the loop carries across steps goes in state (a custom object with state_dict() and "
           "load_state_dict()), or is recomputed at the top of each step (fetch the batch "
           "inside the loop, not at the end of the previous step)")
ACCUMULATED = ("gradients accumulated over several steps were lost at the stop (a gradient-"
               "accumulation window cut by the stop): model and optimizer stayed equal after "
               "the resume until the window's optimizer step, which then used fewer "
               "micro-batches. Stop only at a window's end, or keep the accumulated gradients "
               "in state")
SCHEDULER = ("an LR scheduler not in state: the resumed run's scheduler started again from its "
             "first step, so the optimizer's learning rate differs from the step after the "
             "resume on; put the scheduler in state={..., \"sched\": scheduler}")
NONDETERMINISTIC = ("the runs differ before any interruption: the script does not repeat "
                    "itself even uninterrupted (an unseeded initialisation or RNG, "
                    "nondeterministic kernels, data that depends on time or order of arrival); "
                    "seed it and make it deterministic so that a resume can be checked")


def _names(diffs: Iterable[EntryDiff], kind: Kind) -> list[str]:
    return sorted({d.key for d in diffs if d.kind is kind})


def likely_causes(diffs: list[EntryDiff], step: int, stop: int | None,
                  has_scheduler: bool) -> list[str]:
    """The likely causes of ``diffs`` at ``step``, the first step that differs; ``stop`` is the
    last stop of the interrupted run before it (None: it differs before any stop);
    ``has_scheduler``: the checkpoints hold a scheduler's state."""
    if stop is None:
        return [NONDETERMINISTIC]
    kinds = {d.kind for d in diffs}
    causes = []
    if Kind.SCHEDULER in kinds:
        causes.append(f"the LR scheduler's state is restored differently ({', '.join(_names(diffs, Kind.SCHEDULER)[:3])}): "
                      "its load_state_dict() or the order of its steps after the resume")
    elif Kind.LR in kinds:
        causes.append(SCHEDULER if not has_scheduler else
                      "the optimizer's learning rate differs after the resume: something sets "
                      "it outside state (a schedule computed from a counter of its own)")
    if Kind.LOADER in kinds:
        causes.append("the data loader's position differs: the loader is not in state, or "
                      "batches were drawn outside run.steps (a batch fetched before the loop "
                      "or after the last step), or zip(loader, run.steps(n)) with the loader "
                      "first, which draws one batch more at every stop")
    if Kind.RNG in kinds:
        causes.append("a global RNG used outside state: the resumed run drew random numbers "
                      "the uninterrupted one did not, or in another order (a batch drawn "
                      "before the loop, at start-up after the resume; a sampler, augmentation "
                      "or dropout with an RNG of its own)")
    if Kind.OBJECT in kinds:
        causes.append(f"the state of {', '.join(_names(diffs, Kind.OBJECT)[:3])} differs: "
                      "its state_dict() does not hold everything it carries across steps")
    if not causes and kinds <= {Kind.MODEL, Kind.OPTIMIZER}:
        causes.append(CARRIED if step - stop <= 1 else
                      f"{ACCUMULATED} (first difference {step - stop} steps after the stop)")
    if not causes:
        causes.append("bookkeeping entries differ: " + ", ".join(sorted(d.key for d in diffs)[:3]))
    return causes
