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
  (``threading``'s exit hook), by ``watchdog.exit_timeout_s``, with the run's code. A script
  that lets the ``SystemExit`` reach its top level has no caller that lives on: the interpreter
  drops the exception and exits with its code, and there the slow finalisation is skipped as in
  ``exit`` (see ``RunExit``).
* ``auto`` (default): ``raise`` in an IPython shell or kernel (``get_ipython`` in builtins, which
  IPython puts there) and in an interactive interpreter; ``exit`` in a scheduled or launched rank
  (``SLURM_JOB_ID`` or ``RANK`` in the environment); ``raise`` otherwise. Nothing is inferred
  from which modules are loaded.
"""

from __future__ import annotations

import atexit
import builtins
import gc
import os
import sys
import threading
import time
from typing import NoReturn, Sequence

from kempner_resilience.config import ExitMode
from kempner_resilience.log import get_logger
from kempner_resilience.teardown import flush_logs
from kempner_resilience.watchdog import DeadlineWatchdog

__all__ = ["ExitMode", "RunExit", "resolve", "leave", "bound_exit"]

log = get_logger(__name__)

# Set when a run left in `exit` mode, or its SystemExit ended a script (RunExit): atexit
# (registered at import, so it runs after the handlers registered later, the user's and their
# libraries') then skips the interpreter's finalisation: with 1 GiB of tensors, 1-2 s of freeing
# them object by object, module teardown and torch's C++ destructors, after every byte is durable.
_fast_exit_code: list[int] = []


class RunExit(SystemExit):
    """The ``SystemExit`` a run leaves with (``code``: the run's exit code).

    In ``raise`` mode a caller may catch it and live on, or it may reach the top of a script,
    where the interpreter drops it and exits with its code. Only that second case is known when
    it is dropped (``__del__``): on the main thread, with no Python frame running (a caller that
    caught it, a test runner, IPython, a ``try`` in the script, drops it from its own code), not
    from the garbage collector (a cycle freed while the top level handles another exit), the
    interpreter neither finalising nor interactive (``-i`` keeps the session). Then the process
    leaves as in ``exit`` mode, after the user's atexit handlers; in any other case nothing
    changes (at worst the finalisation stays slow).
    """

    def __del__(self) -> None:
        try:
            if _ends_the_script(self):
                _fast_exit_code[:] = [int(self.code)]
        except Exception:            # never an error from a destructor
            pass


_collecting = [False]


def _gc_phase(phase: str, info: dict[str, int]) -> None:
    _collecting[0] = phase == "start"


def _ends_the_script(exc: BaseException) -> bool:
    """Called from ``RunExit.__del__``: see its docstring."""
    code = getattr(exc, "code", None)
    if not isinstance(code, int) or isinstance(code, bool) or _fast_exit_code or _collecting[0]:
        return False
    if threading.current_thread() is not threading.main_thread() or sys.is_finalizing():
        return False
    if sys.flags.interactive or sys.flags.inspect or hasattr(sys, "ps1"):
        return False
    try:
        sys._getframe(2)        # 0: here, 1: __del__, 2: the code that dropped it
    except ValueError:          # nobody: the interpreter's top level
        return True
    return False


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


atexit.register(_fast_exit)


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
    elif _gc_phase not in gc.callbacks:
        gc.callbacks.append(_gc_phase)   # told apart from the top level's drop: RunExit
    if error is not None and (keep_traceback or mode is ExitMode.RAISE):
        raise error
    raise RunExit(int(code)) from None
