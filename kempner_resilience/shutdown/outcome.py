"""What happened to a run, and the one place that turns it into an exit code.

Every ending of a ``ResilientRun`` is described by an ``Outcome``; ``exit_code`` is the table from
outcome to code (docs/exit-codes.md says the same in words, and a test checks each row). Codes
decided elsewhere, where no Python may run any more, are listed in ``DECIDED_ELSEWHERE``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from kempner_resilience.config import Action
from kempner_resilience.exitcodes import ExitCode, for_signal_stop

__all__ = ["Ending", "Saved", "Outcome", "exit_code", "DECIDED_ELSEWHERE"]


class Ending(enum.Enum):
    """Why the training loop ended."""

    COMPLETED = "completed"            # every step ran
    SIGNAL = "signal"                  # a shutdown signal on some rank; all stopped at one step
    SAVES_FAILING = "saves-failing"    # checkpoint.max_failed_saves periodic saves in a row failed
    PEER_LOST = "peer-lost"            # a collective failed because another rank is gone
    ERROR = "error"                    # the user's code raised


class Saved(enum.Enum):
    """The emergency checkpoint."""

    COMMITTED = "committed"            # written and committed (or the step was already)
    FAILED = "failed"                  # failed or refused; the previous checkpoint is intact
    NOTHING = "nothing"                # no state to save (ResilientRun without state=)


@dataclass
class Outcome:
    ending: Ending
    step: int
    signum: int | None = None
    action: Action | None = None
    saved: Saved = Saved.NOTHING
    requeue_code: int | None = None    # rank 0's requeue decision, shared with every rank
    peer_forced_code: int | None = None  # another rank was forced out with 130/143


def exit_code(o: Outcome) -> ExitCode:
    """The exit code for ``o``; the rows are in the order they take precedence."""
    if o.peer_forced_code is not None:             # the job ends as the forced-out rank did
        return ExitCode(o.peer_forced_code)
    if o.ending is Ending.COMPLETED:
        return ExitCode.OK
    if o.ending is Ending.ERROR:
        return ExitCode.ERROR
    if o.ending is Ending.PEER_LOST:
        return ExitCode.PEER_LOST
    if o.ending is Ending.SAVES_FAILING or o.saved is Saved.FAILED:
        return ExitCode.CHECKPOINT_FAILED
    if o.action is Action.REQUEUE and o.requeue_code is not None:
        return ExitCode(o.requeue_code)            # REQUEUE, REQUEUE_FAILED or NO_REQUEUE
    assert o.signum is not None
    return for_signal_stop(o.signum)               # 130, 143, or STOPPED


# Codes no Outcome produces, and who decides them instead.
DECIDED_ELSEWHERE: dict[ExitCode, str] = {
    ExitCode.USAGE: "the CLI, for a wrong command line",
    ExitCode.CONFIG: "startup.py, for a start-up error nothing caught",
    ExitCode.HANG: "the hang watchdog (watchdog.py), possibly from a kernel timer",
    ExitCode.DEADLINE: "the deadline watchdog (watchdog.py) when a shutdown overran its grace",
    ExitCode.SIGINT: "signals.py, at once, for a repeated SIGINT (also by Outcome)",
    ExitCode.SIGTERM: "signals.py, at once, for a repeated SIGTERM (also by Outcome)",
}
