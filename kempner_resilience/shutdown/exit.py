"""Leaving: how a run that ended hands its exit code to the process, within a bounded time.

Two ways to leave, chosen by ``watchdog.exit_mode`` (or ``ResilientRun(exit_mode=...)``):

* ``exit``: the process ends with the run (a batch rank). The exit deadline stays armed while
  the interpreter exits (executor threads, gloo/NCCL teardown, torch's finalisation) and fires
  with the run's code after ``watchdog.exit_timeout_s``; once the ``SystemExit`` has unwound the
  stack, the interpreter's slow finalisation is skipped (``os._exit`` with the same code).
* ``raise``: the caller lives on after the ``SystemExit`` (a notebook, a test runner, a program
  that catches it): nothing of the run stays armed. The interpreter's later exit belongs to the
  caller, with its own exit code (a test runner exiting 1 must not leave with the run's code, or
  be cut off because its own finalisation is slow), unless the run's teardown left something
  behind that could hold that exit forever (a cleanup or executor task that did not finish, a
  process group with a dead member): then the exit is bounded, from the moment it starts
  (``threading``'s exit hook), by ``watchdog.exit_timeout_s``, with the run's code. The
  interpreter's finalisation stays (see ``RunExit``).
* ``auto`` (default): ``raise`` in an IPython shell or kernel (``get_ipython`` in builtins, which
  IPython puts there) and in an interactive interpreter; ``exit`` in a scheduled or launched rank
  (``SLURM_JOB_ID`` or ``RANK`` in the environment); ``raise`` otherwise. Nothing is inferred
  from which modules are loaded.
"""

from __future__ import annotations

import atexit
import builtins
import os
import sys
import threading
import time
from typing import NoReturn, Sequence

from kempner_resilience.config import ExitMode
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.procs import thread_states
from kempner_resilience.stop.teardown import flush_logs
from kempner_resilience.stop.watchdog import DeadlineWatchdog

__all__ = ["ExitMode", "RunExit", "resolve", "leave", "bound_exit", "exit_status"]

log = get_logger(__name__)

# Set when a run left in `exit` mode: atexit
# (registered at import, so it runs after the handlers registered later, the user's and their
# libraries') then skips the interpreter's finalisation: with 1 GiB of tensors, 1-2 s of freeing
# them object by object, module teardown and torch's C++ destructors, after every byte is durable.
_fast_exit_code: list[int] = []


class RunExit(SystemExit):
    """The ``SystemExit`` a run leaves with (``code``: the run's exit code).

    In ``raise`` mode the interpreter's finalisation is NOT skipped when it reaches a script's
    top level: when it is dropped there, nothing tells whether the interpreter exits with its
    code or with another exception's that it is the context of (``except SystemExit:
    sys.exit(3)``; submitit's local task turns 75 into 144 that way), and a wrong exit code is
    worse than a slow exit. Launched and SLURM ranks run in ``exit`` mode, where it is skipped.
    """


# torch's gloo worker threads (the name torch gives them) and how long the exit waits for them.
_GLOO_WORKER = b"pt_gloo_runloop"
_SETTLE_S = 0.5


def settle_gloo_workers(timeout_s: float = _SETTLE_S) -> bool:
    """Wait, at most ``timeout_s``, until no gloo worker thread is running; True once idle.

    Why: a gloo worker drops a finished collective after the waiting rank was told it is done.
    The collective holds its tensors, and dropping a tensor that Python knew takes the GIL. A
    rank that ends right after its last collective (rank 1 after a full state dict gathered
    for rank 0) may reach the interpreter's finalisation first; under load the worker is then
    still to run. On Python 3.11 a thread that takes the GIL during finalisation exits at once
    (``pthread_exit``) from inside torch's C++: ``terminate called without an active
    exception``, SIGABRT, exit 134 for a run that completed. Waiting here, before finalisation
    and with the GIL released by each sleep, lets the worker finish its drop."""
    deadline = time.monotonic() + timeout_s
    idle = 0
    while True:
        states = thread_states(_GLOO_WORKER)
        if not states:
            return True              # no gloo in this process: one look
        idle = 0 if b"R" in states else idle + 1
        if idle == 2:                # two looks in a row: one may fall between two steps
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)            # the GIL released: a worker that waits for it runs


def _at_exit() -> None:
    """The last atexit handler (registered at import): after a run that left in ``exit``
    mode, the finalisation skipped; else gloo's workers settled before it begins."""
    _fast_exit()
    settle_gloo_workers()


def _fast_exit() -> None:
    if not _fast_exit_code:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    flush_logs()
    os._exit(_fast_exit_code[0])


atexit.register(_at_exit)


def _in_ipython() -> bool:
    get_ipython = getattr(builtins, "get_ipython", None)
    return callable(get_ipython) and get_ipython() is not None


def resolve(mode: ExitMode) -> ExitMode:
    """``auto`` made concrete (see the module docstring)."""
    if mode is not ExitMode.AUTO:
        return mode
    if _in_ipython() or sys.flags.interactive or hasattr(sys, "ps1"):
        return ExitMode.RAISE
    if "SLURM_JOB_ID" in os.environ or "RANK" in os.environ:
        return ExitMode.EXIT
    return ExitMode.RAISE


def bound_exit(deadline: DeadlineWatchdog, code: int, mode: ExitMode, exit_timeout_s: float,
               left_behind: Sequence[str] = ()) -> None:
    """Bound the rest of this process's life (``exit``), or in ``raise`` mode its interpreter
    exit, but only when ``left_behind`` names what could hold it (see the module docstring)."""
    if mode is ExitMode.EXIT:
        if not deadline.armed:       # a stop no signal started: bound the exit too
            deadline.arm(time.monotonic() + exit_timeout_s,
                         "interpreter exit after a completed shutdown")
        deadline.finished(code, exit_timeout_s)
        return
    deadline.disarm()
    if not left_behind:
        return
    log.warning("%s still running: the interpreter's exit, when it comes, is cut off after "
                "%.0f s with %d", ", ".join(left_behind), exit_timeout_s, code)
    # Runs when the main thread is done and the interpreter starts to join threads (a stuck
    # executor's worker would block that join). Private but stable since Python 3.9; atexit
    # (after the joins) is the fallback.
    register = getattr(threading, "_register_atexit", atexit.register)
    try:
        register(lambda: _arm_at_interpreter_exit(deadline, code, exit_timeout_s))
    except RuntimeError:             # the interpreter is already shutting down
        pass


def _arm_at_interpreter_exit(deadline: DeadlineWatchdog, code: int, exit_timeout_s: float) -> None:
    deadline.arm(time.monotonic() + exit_timeout_s, "interpreter exit after a run ended")
    deadline.finished(code, exit_timeout_s)


def leave(deadline: DeadlineWatchdog, code: int, mode: ExitMode, exit_timeout_s: float,
          error: BaseException | None = None, keep_traceback: bool = False,
          left_behind: Sequence[str] = ()) -> NoReturn:
    """Raise ``SystemExit(code)`` with the exit bounded. An ``error`` that ended the run is
    re-raised instead when ``keep_traceback`` (the user's bug: Python prints it, exit 1) or in
    ``raise`` mode (an in-process caller sees what happened)."""
    bound_exit(deadline, code, mode, exit_timeout_s, left_behind)
    if mode is ExitMode.EXIT:
        _fast_exit_code[:] = [int(code)]
    if error is not None and (keep_traceback or mode is ExitMode.RAISE):
        raise error
    raise RunExit(int(code)) from None


def exit_status(exc: BaseException | None) -> int:
    """The process's exit status for a ``SystemExit`` ``exc``, as the interpreter computes it
    (None: 0; an integer: itself; anything else: 1)."""
    code = getattr(exc, "code", None)
    if code is None:
        return 0
    return code if isinstance(code, int) and not isinstance(code, bool) else 1
