"""The rescue step of a failure ending (a lost peer, a hang): the survivors write the last step
boundary as a checkpoint (``kempner_resilience.rescue``) before the requeue and the exit, and
the stop on purpose that turns it off."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kempner_resilience.runstate import RunState
from kempner_resilience.supervise.rank import note_ranks_died

if TYPE_CHECKING:
    from kempner_resilience.rescue.rescuer import RescueResult

__all__ = ["rescue", "close_rescue"]


def rescue(state: RunState, why: str) -> RescueResult | None:
    """Within ``rescue.budget_s`` (the caller's deadline is the backstop). The rescuer logs the
    outcome; the ledger records it (the writer a commit, rank 0 a failure). Returns what the
    rescue did (None without a rescuer): a committed rescue is the checkpoint a requeue comes
    back to, which the caller notes."""
    parts = state.parts
    r = parts.rescue
    if r is None:
        return None
    result = r.rescue(why, state.committed_step())
    # After the rescue, which gave the link time to see its end: the ranks that died without a
    # word, for a torchrun agent that drops their node from its rendezvous at once.
    note_ranks_died(r.died())
    committed = result.info is not None
    if (committed and result.writer == state.rank) or (state.rank == 0 and not committed):
        # A committed rescue is recorded by its writer (rank 0 may be the rank that died),
        # one that committed nothing by rank 0 (the writer may be gone): each once.
        parts.ledger.event("rescue", step=result.step, committed=committed,
                           writer=result.writer, why=result.why, reason=why,
                           seconds=round(result.seconds, 4), rank=state.rank)
    return result


def close_rescue(state: RunState, clean: bool = True) -> None:
    """No rescue from here on. A stop on purpose (signal, completion, failing saves) tells the
    buddy goodbye; ``clean=False`` (a failure ending) leaves it woken, as a dead rank would."""
    if state.parts.rescue is not None:
        state.parts.rescue.close(clean=clean)
