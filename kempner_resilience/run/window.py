"""A stop agreed inside a gradient-accumulation window waits for the window's end.

Gradients accumulated over several steps (``optim.step()`` every A steps) are state the loop
carries from one step to the next. Two answers keep a resume exact: stop at the window's end, or
save the gradients. A stop waits for the window's end, because only that works under DDP's
``no_sync``: inside such a window no step has a collective, so the ranks drift apart by up to a
window, and a rank may already wait in the window's closing all-reduce while the rank that got
the signal reaches the agreed step; stopping there would leave that rank waiting until the
deadline. The window's closing step is a collective every rank reaches, so every rank stops at
the first boundary at or past the agreed step where no gradient is pending (a rank that saw the
agreement only past it stops where it is: the same boundary). The wait is bounded
(``MAX_WAIT_STEPS``, the same on every rank) and runs inside the signal's grace period; past
the bound the stop happens where it is and the checkpoint keeps the gradients. A single rank
never waits: nothing drifts, and its checkpoint keeps the gradients.

A periodic save inside a window (every rank saves at the same step, so no rank drifts past it)
keeps the pending gradients instead, and a resume puts them back (``checkpoint/carried.py``).
"""

from __future__ import annotations

from dataclasses import replace

from kempner_resilience.core.log import get_logger
from kempner_resilience.runstate import RunParts
from kempner_resilience.stop.agreement import StopDecision

__all__ = ["MAX_WAIT_STEPS", "WindowEnds", "stop_here"]

log = get_logger(__name__)

#: The most steps a stop waits past the agreed one for a window to close (then it stops, and
#: the checkpoint keeps the window's gradients).
MAX_WAIT_STEPS = 64


class WindowEnds:
    """Tells, at each boundary, whether the step just taken closed an accumulation window: it
    stepped an optimizer after a step that stepped none. The stop check right after it reads
    the store afresh (``StopAgreement.poll``'s ``fresh``): a rank that ran the window ahead
    issued its last check before the window's closing all-reduce. O(1) per step; a run that
    steps its optimizer every step never sees one."""

    def __init__(self, parts: RunParts) -> None:
        self._grads = parts.ckpt.state.grads if parts.ckpt is not None else None
        self._stepped = self._grads.steps if self._grads is not None else 0
        self._idle = False          # the step before the last one stepped no optimizer

    def closed(self) -> bool:
        """Call once per boundary."""
        if self._grads is None:
            return False
        steps = self._grads.steps
        closed = self._idle and steps != self._stepped
        self._idle, self._stepped = steps == self._stepped, steps
        return closed


def stop_here(parts: RunParts, step: int, decision: StopDecision) -> StopDecision | None:
    """The decision to stop at boundary ``step``, or None while an accumulation window the
    agreed stop fell into is still open."""
    # The bound counts from the agreed step, the same on every rank (a rank that saw the
    # agreement late decided at a later step of its own).
    agreed = parts.agreement.stop_at()
    agreed = decision.step if agreed is None else agreed
    # One rank has no peer to drift from: it stops at once, and the emergency checkpoint keeps
    # the window's gradients (exact too, and no step of the signal's grace spent on waiting).
    if decision.lease_lost or parts.ckpt is None or parts.agreement.world_size == 1 \
            or step >= agreed + MAX_WAIT_STEPS or not parts.ckpt.state.grads.pending():
        return replace(decision, step=step)
    if step == decision.step and parts.rank == 0:
        log.warning("the stop agreed for step %d falls inside a gradient-accumulation window: "
                    "training on to the window's end (its optimizer step) and stopping there, "
                    "at most %d steps", step, MAX_WAIT_STEPS)
    return None
