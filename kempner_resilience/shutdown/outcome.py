"""The one way an ending is recorded, whichever path ended the run.

The exit code comes from the one table, ``exitcodes.exit_code`` (what happened, ``Facts``, to
the code; it lives in ``exitcodes`` so that the core layer's deciders, the signal thread and the
watchdogs, use it too). ``record`` then says how the attempt ended, the same way for every
ending: the run ledger's ``exit`` event, the trackers' finish (bounded), the run report and,
under a supervisor, rank 0's word to it (``supervise/channel.py``); without one, another rank's
word to rank 0 (``supervise/endings.py``).

Callers: the shutdown sequence's paths (``complete``, ``stop``, ``fail``, ``give_up``,
``hang``, in the hang watchdog's thread), which note the ending in the run's progress first. A hang that holds the GIL runs no Python in
the process: there the backstop's monitor process writes the ``exit`` event and the report
(``HangWatchdog.last_words``, ``backstop.py``); no tracker can be told.
"""

from __future__ import annotations

from typing import Any

from kempner_resilience.exitcodes import Ending, ExitCode, Facts, Saved, Verdict, exit_code
from kempner_resilience.runstate import RunState
from kempner_resilience.shutdown.report import build_report, report_path, write_report
from kempner_resilience.shutdown.timing import shutdown_times
from kempner_resilience.stop.teardown import TeardownStack

__all__ = ["Ending", "Saved", "Verdict", "Facts", "exit_code", "record", "hang_words"]


def record(state: RunState, facts: Facts) -> int:
    """The code for ``facts`` (the table's); the ledger's ``exit`` event, the trackers' finish,
    the run report and the supervisor say so. Returns the code; writes nothing into ``state``
    (the caller notes the ending in its progress)."""
    parts, progress = state.parts, state.progress
    code = int(exit_code(facts))
    parts.ledger.event("exit", code=code, ending=facts.ending.value, step=progress.step,
                       loop_end_t=progress.loop_end_wall,
                       **shutdown_times(progress.timings, parts.handler.request,
                                        None if code == ExitCode.OK else parts.exit_mode))
    parts.ledger.close()
    _finish_trackers(state, code)
    write_report(state, code, facts)
    state.tell_supervisor(code)
    state.note_ending(facts.ending.value, code)    # rank 0 without a supervisor reads it
    return code


def _finish_trackers(state: RunState, code: int) -> None:
    """Tell the trackers how the attempt ends, within a cleanup's time and the deadline (an
    online W&B run uploads what is left when it finishes)."""
    parts = state.parts
    if parts.trackers.active:
        stack = TeardownStack(parts.config.watchdog.cleanup_timeout_s)
        stack.add(lambda: parts.trackers.finish(code), name="finish the tracker runs")
        stack.run(deadline=parts.handler.deadline.deadline)


def hang_words(state: RunState) -> dict[str, Any]:
    """What ``record`` would write for a hang, for the hang backstop's monitor process to write
    in its stead when no Python runs in the process (``HangWatchdog.last_words``): the ledger's
    ``exit`` event (``by: backstop``; the monitor adds the time, and knows no step) and the run
    report, as of now. Refreshed when that changes (a resume, a save); nothing per step."""
    facts = Facts(Ending.HANG, state.step)
    code = int(exit_code(facts))
    words: dict[str, Any] = {}
    ledger = state.parts.ledger
    if ledger.path is not None and ledger.only is None:
        words["append"] = [str(ledger.path), {
            "ev": "exit", "t": None, "attempt": ledger.attempt, "run_id": ledger.run_id,
            "code": code, "ending": facts.ending.value, "by": "backstop"}]
    path = report_path(state)
    if path is not None:
        report = build_report(state, code, facts)
        report.update(ending=facts.ending.value, step=None, timings={})
        words["replace"] = [path, report]
    return words
