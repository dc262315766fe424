"""The one table from what happened to the exit code (kempner_resilience.shutdown.outcome)."""

from __future__ import annotations

import itertools
import signal

from kempner_resilience.config import Action
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.shutdown.outcome import (DECIDED_ELSEWHERE, Ending, Outcome, Saved,
                                                 exit_code)


def _all_outcomes():
    for ending, signum, action, saved, requeue, forced in itertools.product(
            Ending, (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP),
            (Action.REQUEUE, Action.STOP), Saved,
            (None, ExitCode.REQUEUE, ExitCode.REQUEUE_FAILED, ExitCode.NO_REQUEUE),
            (None, 130, 143)):
        yield Outcome(ending, 7, signum, action, saved, requeue, forced)


def test_every_documented_exit_code_has_exactly_one_place_that_decides_it():
    produced = {exit_code(o) for o in _all_outcomes()}
    assert produced | set(DECIDED_ELSEWHERE) == set(ExitCode)
    assert ExitCode.USAGE not in produced and ExitCode.HANG not in produced


def test_a_failed_emergency_save_wins_over_the_signal_and_a_forced_peer_over_everything():
    failed = Outcome(Ending.SIGNAL, 3, signal.SIGUSR1, Action.REQUEUE, Saved.FAILED)
    assert exit_code(failed) == ExitCode.CHECKPOINT_FAILED
    failed.peer_forced_code = 143
    assert exit_code(failed) == ExitCode.SIGTERM


def test_a_committed_stop_exits_with_the_requeue_outcome_or_the_signal_convention():
    def code(sig, action, requeue=None):
        return exit_code(Outcome(Ending.SIGNAL, 3, sig, action, Saved.COMMITTED, requeue))
    assert code(signal.SIGUSR1, Action.REQUEUE, ExitCode.REQUEUE) == ExitCode.REQUEUE
    assert code(signal.SIGUSR1, Action.REQUEUE, ExitCode.NO_REQUEUE) == ExitCode.NO_REQUEUE
    assert code(signal.SIGTERM, Action.STOP) == 143
    assert code(signal.SIGINT, Action.STOP) == 130
    assert code(signal.SIGHUP, Action.STOP) == ExitCode.STOPPED
