"""submitit's signals in the job process, taken over so that ``ResilientRun`` handles them.

submitit's preemption handler checkpoints and requeues from inside the handler, mid-step, and
it ignores SIGTERM. ``SignalTakeover`` replaces both before the submitted function runs.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

from kempner_resilience.config import normalize_signal
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.startup import record_early_signal

__all__ = ["SignalTakeover", "in_submitit_job", "in_local_task", "preempt_signal"]

# One logger for the whole integration: users filter their logs on it.
log = get_logger("kempner_resilience.supervise.submitit.jobs")


def preempt_signal() -> int:
    """submitit's preemption signal (``$SUBMITIT_PREEMPT_SIGNAL``, default ``SIGUSR2``)."""
    name = os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2")
    return int(getattr(signal, normalize_signal(name)))


def in_local_task() -> bool:
    """True in a task that submitit's local executor started."""
    return (os.environ.get("SUBMITIT_EXECUTOR") == "local"
            and "SUBMITIT_LOCAL_GLOBALID" in os.environ)


def in_submitit_job() -> bool:
    """True in a job process that submitit started, under SLURM or its local executor."""
    return bool(os.environ.get("SUBMITIT_FOLDER")) and (bool(os.environ.get("SLURM_JOB_ID"))
                                                        or in_local_task())


def _run_active() -> bool:
    """True while a ``ResilientRun``'s ShutdownHandler is installed in this process."""
    from kempner_resilience.stop.signals import active_handlers

    return bool(active_handlers())


class SignalTakeover:
    """Replaces submitit's job-process handlers for the preemption signal and SIGTERM.

    The preemption signal is the run's inside a ``ResilientRun``, kept for the run to replay
    before one, ignored after the function returned. SIGTERM: ignored as submitit does, or
    with ``sigterm="stop"`` the default action outside a run and the run's STOP inside one.
    """

    def __init__(self, preempt_signum: int, sigterm: str = "ignore") -> None:
        self.preempt = preempt_signum
        self.sigterm = sigterm
        self.pending: int | None = None
        self._done = threading.Event()
        self._previous: dict[int, Any] = {}

    def install(self) -> "SignalTakeover":
        signums = [self.preempt]
        if self.preempt != signal.SIGTERM:
            signums.append(signal.SIGTERM)
        for s in signums:
            self._previous[s] = signal.getsignal(s)
        signal.signal(self.preempt, self._on_preempt)
        if self.preempt != signal.SIGTERM:
            if self.sigterm == "ignore":
                signal.signal(signal.SIGTERM, self._on_term_ignored)
            else:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
        log.debug("took over %s and SIGTERM from %s", signal.Signals(self.preempt).name,
                  _describe_handler(self._previous.get(self.preempt)))
        return self

    def finish(self) -> None:
        """The function returned (or raised). In a submitit job our handlers stay, so a late
        signal cannot make submitit requeue a finished job; elsewhere the old ones come back."""
        self._done.set()
        if not in_submitit_job() and threading.current_thread() is threading.main_thread():
            for s, prev in self._previous.items():
                signal.signal(s, prev if prev is not None else signal.SIG_DFL)

    # handlers (main thread, between bytecodes)

    def _on_preempt(self, signum: int, frame: Any) -> None:
        if _run_active():
            return  # chained from ResilientRun's handler: the run handles it
        if self._done.is_set():
            log.warning("%s after the training function returned: ignored (the result is "
                        "being written)", signal.Signals(signum).name)
            return
        if self.pending is not None:
            return
        self.pending = signum
        log.warning("%s before the training entered ResilientRun: it is handled as soon as "
                    "the run starts", signal.Signals(signum).name)
        # The run's ShutdownHandler replays it, so the stop comes at the run's first step
        # boundary with its deadline counted from now. A thread that re-sent the signal once
        # a run was active woke too late on a loaded machine: several steps ran first.
        record_early_signal(signum)

    def _on_term_ignored(self, signum: int, frame: Any) -> None:
        log.warning("SIGTERM ignored, as submitit does (its preemption signal is %s; "
                    "pass sigterm='stop' to act on SIGTERM)", signal.Signals(self.preempt).name)

def _describe_handler(h: Any) -> str:
    if callable(h):
        owner = getattr(h, "__self__", None)
        return f"{type(owner).__name__}.{h.__name__}" if owner is not None else repr(h)
    return str(h)
