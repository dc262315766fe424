"""What ``import kempner_resilience`` sets up before anything else: the process's start-up guards.

This module imports only the standard library, so the package can install it first, before its
own heavier imports (YAML, the config schema) and before the user's (torch, the model).

Two guards:

* The early signal recorder (SLURM jobs only). A ``--signal`` warning that arrives while the
  script is still importing torch or building the model would kill the rank (SIGUSR1's default
  action) without a checkpoint; recorded instead, it is handled by the first ShutdownHandler.
* The start-up error exit. A ``StartupError`` (an invalid configuration, a checkpoint directory
  that cannot hold checkpoints) that nothing catches ends a batch script with exit code 78
  (CONFIG) and its message on stderr instead of exit 1 and a traceback. Python consults
  ``sys.excepthook`` only for an exception that reached the top level of a script, never for one
  a notebook cell, a test runner or the user's own ``try`` caught, so those callers see the
  exception exactly as raised; under ``python -i`` the traceback is kept for the session.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from types import TracebackType
from typing import Any

__all__ = ["StartupError", "install_early_recorder", "install_exit_hook", "record_early_signal"]

# ExitCode.CONFIG; exitcodes.py is not imported here so this module stays first and light.
CONFIG_EXIT_CODE = 78


class StartupError(Exception):
    """Marks an error that means "this run cannot start as configured": the process exits with
    78 (CONFIG) when a script lets it go uncaught.

    ``ConfigError`` and ``CheckpointDirError`` carry it. Their messages name the problem and the
    fix; in-process callers (notebooks, tests, a ``try`` around the set-up) catch them as usual.
    """


# ------------------------------------------------------------------------ early signal recorder

_early: list[tuple[int, float]] = []


def record_early_signal(signum: int) -> None:
    """Keep ``signum``, arrived now before any run, for the run's ShutdownHandler to replay
    when it is installed (its deadline counted from this arrival)."""
    _early.append((signum, time.monotonic()))


def _early_record(signum: int, frame: Any) -> None:
    record_early_signal(signum)


#: Set by an srun task's shim (``supervise/srun/shim.py``, which names it too: it imports
#: nothing of the package) in a warm rank's environment: ``"RT:SIG,..."``, the real-time
#: signal it passes each signal on as.
FORWARDED_ENV = "KEMPNER_RESILIENCE_FORWARDED_SIGNALS"


def forwarded_signals(environ: Any = None) -> dict[int, int]:
    """``$KEMPNER_RESILIENCE_FORWARDED_SIGNALS`` as {real-time signal: the signal it stands
    for}; empty when unset or not real-time signal numbers."""
    raw = (os.environ if environ is None else environ).get(FORWARDED_ENV, "")
    lo, hi = getattr(signal, "SIGRTMIN", 0), getattr(signal, "SIGRTMAX", -1)
    out = {}
    for pair in raw.split(","):
        rt, _, sig = pair.partition(":")
        if rt.strip().isdigit() and sig.strip().isdigit() and lo <= int(rt) <= hi:
            out[int(rt)] = int(sig)
    return out


def install_early_recorder(signals: tuple[int, ...] = (signal.SIGUSR1, signal.SIGUSR2)) -> None:
    """Record ``signals`` that arrive before a ShutdownHandler is installed, instead of dying.

    Python start-up and model building can take longer than a short ``--signal`` lead leaves:
    USR1's default action would kill the rank without a checkpoint, and a job killed at its time
    limit is never requeued. ``import kempner_resilience`` calls this inside SLURM jobs, before
    it imports anything else; the first ShutdownHandler replays what was recorded. Only default
    dispositions are replaced.
    """
    if threading.current_thread() is not threading.main_thread():
        return
    # A warm rank's shim passes them on as real-time signals: those are recorded too (the
    # handler reads them as the signals they stand for).
    signals = (*signals, *(rt for rt, s in forwarded_signals().items() if s in signals))
    for signum in signals:
        if signal.getsignal(signum) == signal.SIG_DFL:
            signal.signal(signum, _early_record)


# ----------------------------------------------------------------------------- start-up errors

_exit_code: list[int] = []
_installed: list[bool] = []


def _interactive_session_follows() -> bool:
    # `python -i` / PYTHONINSPECT: the user gets a prompt after the error and wants the
    # traceback there, not an exit.
    return bool(sys.flags.interactive or sys.flags.inspect or os.environ.get("PYTHONINSPECT"))


def _make_excepthook(previous: Any) -> Any:
    def excepthook(exc_type: type[BaseException], exc: BaseException,
                   tb: TracebackType | None) -> None:
        if not isinstance(exc, StartupError) or _interactive_session_follows():
            previous(exc_type, exc, tb)
            return
        # This replaces Python's traceback, which goes to stderr whatever logging is set up to
        # do, so the message goes there too.
        stream = sys.stderr or sys.__stderr__
        if stream is not None:
            try:
                stream.write(f"kempner_resilience: {exc}\nThe run did not start; exiting with "
                             f"{CONFIG_EXIT_CODE} (CONFIG).\n")
                stream.flush()
            except Exception:
                pass
        _exit_code[:] = [CONFIG_EXIT_CODE]

    return excepthook


def _exit_with_startup_code() -> None:
    # Registered at import, so atexit (last in, first out) runs it after the handlers the user
    # and their libraries register later; the interpreter would otherwise exit with 1.
    if not _exit_code:
        return
    import logging

    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except Exception:
            pass
    logging.shutdown()
    os._exit(_exit_code[0])


def install_exit_hook() -> None:
    """Chain ``sys.excepthook`` so that an uncaught ``StartupError`` exits with 78 (CONFIG) and
    its message, without a traceback. Any other exception goes to the previous hook. Idempotent."""
    if _installed:
        return
    _installed.append(True)
    sys.excepthook = _make_excepthook(sys.excepthook)
    atexit.register(_exit_with_startup_code)
