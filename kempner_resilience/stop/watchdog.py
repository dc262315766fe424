"""Watchdogs that end a stuck process with a documented exit code and every thread's stack.

Two layers, because a hang may or may not hold the GIL:

* a Python thread waits for the deadline and then dumps stacks, runs a short last action (a
  requeue) and calls ``os._exit``. It works whenever the main thread released the GIL, which
  gloo/NCCL waits, sleeps and I/O do;
* a GIL-free backstop for a hang that holds the GIL, when no Python thread can run. Its signal
  is handled by faulthandler (C code: dumps all stacks) chained to libc's ``_exit`` installed as
  a plain signal handler. A handler receives the signal number as its argument, so the exit
  status is the signal number, which is why ``ExitCode.HANG`` and ``ExitCode.DEADLINE`` lie in
  the real-time signal range. The shutdown deadline's backstop is a kernel timer
  (``CExitTimer``, ``ctimer.py``); the hang watchdog's is a monitor process
  (``BackstopMonitor``, ``backstop.py``) because a stopped process is not hung.

A suspended job (``scontrol suspend``, ``PreemptMode=SUSPEND``, a cgroup freeze: every task
stopped, continued later) must not be taken for a hung one: the hang clock does not run while the
process is stopped. The hang thread wakes every ``PAUSE_TICK_S``; a wake-up much later than asked
means the process did not run (it was stopped), and the deadline moves by that much. The monitor
process does the same for the backstop (it sees the rank's stopped state, and its own gaps).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import threading
import time
from typing import Callable, Iterator

from kempner_resilience.stop.backstop import BackstopMonitor
from kempner_resilience.stop.ctimer import CExitTimer
from kempner_resilience.exitcodes import Ending, Facts, exit_code
from kempner_resilience.core.log import get_logger

__all__ = ["CExitTimer", "DeadlineWatchdog", "HangWatchdog", "dump_all_stacks", "hold_until_exit"]

log = get_logger(__name__)

# The C backstop fires this long after the Python watchdog would have, so the Python path
# (which can requeue and log) wins whenever it can run at all.
BACKSTOP_SLACK_S = 1.0
# The hang thread wakes at least this often, to see whether the process was stopped in between.
PAUSE_TICK_S = 0.5
# A wake-up later than asked by more than this is taken for a stop (SIGSTOP, a suspended job):
# that time is not counted as a hang. Scheduler delays are far shorter; a GIL held this long
# by a C call also reads as a stop, and then the backstop (which sees the difference) decides.
PAUSE_MIN_S = 1.0
# The codes of the two endings decided here, from the one table (they are also the signals of
# the backstops, see exitcodes.py).
HANG_CODE = int(exit_code(Facts(Ending.HANG)))
DEADLINE_CODE = int(exit_code(Facts(Ending.DEADLINE)))


def dump_all_stacks(header: str) -> None:
    """Write ``header`` and every Python thread's stack to fd 2 (works with pytest capture too)."""
    try:
        os.write(2, f"\n=== kempner_resilience: {header} ===\n".encode())
        faulthandler.dump_traceback(2, all_threads=True)
    except OSError:
        pass


def hold_until_exit(why: str) -> None:
    """Block the calling thread for good: another thread is ending the process with its own
    code (``os._exit``) and a deadline or backstop bounds that. Sleeps in slices so that the
    signal handlers of the main thread still run (they only record)."""
    log.warning("holding this thread: %s", why)
    never = threading.Event()
    while True:
        never.wait(60.0)


class _DeadlineThread:
    """A daemon thread that calls ``fire()`` once ``time.monotonic()`` reaches a deadline.

    With ``on_pause``, the clock stops while the process is stopped: the thread wakes at least
    every ``PAUSE_TICK_S``, and a wake-up later than asked by more than ``PAUSE_MIN_S`` moves
    the deadline by the delay and reports it (``on_pause(seconds)``) before anything fires.
    """

    def __init__(self, name: str, fire: Callable[[], None],
                 on_pause: Callable[[float], None] | None = None) -> None:
        self._cond = threading.Condition()
        self._deadline: float | None = None
        self._fire = fire
        self._on_pause = on_pause
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def set(self, deadline: float | None) -> None:
        with self._cond:
            self._deadline = deadline
            self._cond.notify()

    def get(self) -> float | None:
        return self._deadline

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _loop(self) -> None:
        with self._cond:
            while not self._closed:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    if self._on_pause is None:
                        self._cond.wait(left)
                        continue
                    asked = min(left, PAUSE_TICK_S)
                    woke = time.monotonic()
                    self._cond.wait(asked)
                    late = time.monotonic() - woke - asked
                    if late > PAUSE_MIN_S and self._deadline is not None:
                        self._deadline += late
                        self._cond.release()
                        try:
                            self._on_pause(late)
                        finally:
                            self._cond.acquire()
                    continue
                self._deadline = None
                self._cond.release()
                try:
                    self._fire()
                finally:
                    self._cond.acquire()


_COMPLETED = "interpreter exit after a completed shutdown"


class DeadlineWatchdog:
    """The shutdown deadline: armed at the first signal, it outlives checkpoint, requeue and exit.

    When the deadline passes it dumps every thread's stack and ``os._exit``s with
    ``ExitCode.DEADLINE``, or, once the shutdown itself finished (``finished(code)``), with the
    code the shutdown chose: then only the interpreter's own exit was slow and the work is safe.
    """

    def __init__(self) -> None:
        self._thread: _DeadlineThread | None = None
        self._backstop: CExitTimer | None = None
        self._code = DEADLINE_CODE
        self._reason = ""
        self._lock = threading.Lock()

    @property
    def deadline(self) -> float | None:
        return self._thread.get() if self._thread else None

    @property
    def armed(self) -> bool:
        return self.deadline is not None

    def remaining(self) -> float | None:
        d = self.deadline
        return None if d is None else d - time.monotonic()

    def arm(self, deadline: float, reason: str) -> None:
        """Arm at ``deadline`` (monotonic); if already armed, keep the earlier deadline."""
        with self._lock:
            if self._thread is None:
                # No pause detection here, and a kernel timer as the backstop: the grace
                # window is real time (SLURM's KillWait, a time limit), stopped or not.
                self._thread = _DeadlineThread("kempner-deadline", self._expire)
                self._backstop = CExitTimer(DEADLINE_CODE)
            current = self._thread.get()
            if current is not None and current <= deadline:
                return
            self._reason = reason
            self._thread.set(deadline)
            assert self._backstop is not None
            self._backstop.arm(deadline - time.monotonic() + BACKSTOP_SLACK_S)

    def tighten(self, deadline: float) -> bool:
        """Move an armed deadline earlier; returns whether it moved."""
        current = self.deadline
        if current is None or deadline >= current:
            return False
        self.arm(deadline, self._reason)
        return True

    def expect_exit(self, code: int, within_s: float, reason: str) -> None:
        """No signal came, but the process is on its way out (an error ended the loop): arm the
        deadline ``within_s`` from now (an earlier one stays) and exit with ``code`` at it."""
        self.arm(time.monotonic() + within_s, reason)
        self._code = int(code)
        self._reason = reason

    def finished(self, code: int, exit_timeout_s: float) -> None:
        """Our shutdown is done: from now on a late exit uses ``code``, within ``exit_timeout_s``."""
        self._code = int(code)
        self._reason = _COMPLETED
        if self._thread is not None:
            self.tighten(time.monotonic() + exit_timeout_s)

    def disarm(self) -> None:
        with self._lock:
            if self._thread is not None:
                self._thread.set(None)
            if self._backstop is not None:
                self._backstop.disarm()

    def _expire(self) -> None:
        if self._code == DEADLINE_CODE:
            log.error("shutdown deadline passed (%s): forcing exit with %d", self._reason,
                      self._code)
            dump_all_stacks(f"shutdown deadline passed ({self._reason}); stacks of all threads")
        else:
            log.warning("%s exceeded its time: forcing exit with %d", self._reason, self._code)
            if self._reason != _COMPLETED:
                dump_all_stacks(f"{self._reason}: forced exit; stacks of all threads")
        os._exit(self._code)


class HangWatchdog:
    """Exits with ``ExitCode.HANG`` when no heartbeat arrives for ``timeout_s``.

    ``beat()`` is the per-step heartbeat and must stay cheap: it stores a timestamp and re-arms
    the backstop (one store into a page shared with its monitor process) only every
    ``rearm_every_s``. Time in which the process was stopped is not counted. ``busy()`` widens
    the budget while a checkpoint is written or read, so a slow save is never taken for a hang.
    ``on_hang`` runs in the watchdog thread after the stack dump (for a requeue) and must be
    bounded in time; the int it returns, if any, is the exit code instead of HANG (a peer's own
    ending decided the job's code).

    Once it has decided (``decided``), the decision is final: a stall that ends while the hang
    path runs (a data-loader or NFS stall, a continued peer) must not let the training thread
    save, step or leave with another code. ``on_decide`` (cheap, any thread-safe call: the
    rescue freezes the step boundary with it) runs first, and ``hold()``, which ``beat()`` and
    the run's safe points call, keeps every other thread there until the hang path's
    ``os._exit`` (the backstop bounds it).
    """

    def __init__(self, timeout_s: float, *, busy_timeout_s: float | None = None,
                 on_hang: Callable[[], int | None] | None = None,
                 on_hang_budget_s: float = 30.0,
                 on_decide: Callable[[], None] | None = None) -> None:
        self.timeout_s = float(timeout_s)
        self.busy_timeout_s = float(busy_timeout_s if busy_timeout_s is not None else timeout_s)
        self.on_hang = on_hang
        self.on_hang_budget_s = on_hang_budget_s
        self.on_decide = on_decide
        self.decided = False              # the hang path runs: the process ends with HANG
        self._decider: int | None = None  # the thread running it (never held)
        self.rearm_every_s = min(0.5, self.timeout_s / 20)
        self._budget = self.timeout_s
        self._last = time.monotonic()
        self._last_arm = 0.0
        self._busy = 0
        # Stopped time not counted, as (the _last it applies to, seconds): it applies only while
        # no beat came since (a beat after a resume starts a fresh window anyway). One tuple,
        # replaced whole: the watchdog thread writes it, beat() never touches it.
        self._paused: tuple[float, float] = (-1.0, 0.0)
        self._thread: _DeadlineThread | None = None
        self._backstop: BackstopMonitor | CExitTimer | None = None
        self.enabled = self.timeout_s > 0

    def reserve_for_on_hang(self, seconds: float) -> None:
        """Give ``on_hang`` ``seconds`` more before the backstop ends the process: for a part
        that joins the hang path after the watchdog started (the rescue, set up after the
        resume, which the watchdog already guards)."""
        self.on_hang_budget_s += seconds

    def start(self) -> "HangWatchdog":
        if self.enabled and self._thread is None:
            self._backstop = BackstopMonitor(HANG_CODE)
            if not self._backstop.available:
                log.warning("no monitor process for the hang backstop: using a kernel timer, "
                            "which a suspended job (SIGSTOP) outlives as a hang")
                self._backstop = CExitTimer(HANG_CODE)
            self._thread = _DeadlineThread("kempner-hang-watchdog", self._expire,
                                           on_pause=self._on_pause)
            self.beat(force=True)
        return self

    def last_words(self, words: dict) -> None:
        """What the GIL-free backstop writes if it ends the process (a hang that holds the GIL,
        or an ``on_hang`` over its budget): see ``BackstopMonitor.last_words``. Nothing with the
        kernel-timer fallback, which runs no code of ours."""
        if isinstance(self._backstop, BackstopMonitor):
            self._backstop.last_words(words)

    def hold(self) -> None:
        """Never returns once the hang path has decided (except in its own thread): the caller
        waits there for the hang path's exit. A plain attribute test otherwise (per step)."""
        if self.decided and threading.get_ident() != self._decider:
            hold_until_exit("the hang path is ending the process")

    def beat(self, force: bool = False) -> None:
        if self.decided:
            self.hold()
        now = time.monotonic()
        self._last = now
        if self._thread is None:
            return
        if force or now - self._last_arm >= self.rearm_every_s:
            self._last_arm = now
            # Python path fires at exactly the budget; the GIL-free backstop a little later.
            self._thread.set(now + self._budget)
            self._backstop.arm(self._budget + BACKSTOP_SLACK_S)  # type: ignore[union-attr]

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        """Use the (longer) busy budget inside this block; a heartbeat is given on both ends."""
        self._busy += 1
        self._budget = max(self.timeout_s, self.busy_timeout_s)
        self.beat(force=True)
        try:
            yield
        finally:
            self._busy -= 1
            if self._busy == 0:
                self._budget = self.timeout_s
            self.beat(force=True)

    def stop(self) -> None:
        if self._thread is not None:
            self._thread.close()
            self._thread = None
        if self._backstop is not None:
            self._backstop.close()
            self._backstop = None

    def _on_pause(self, seconds: float) -> None:
        """The watchdog thread woke ``seconds`` late: the process was stopped (a suspended
        job), which is not a hang. Not counted until the next beat."""
        last = self._last
        since, paused = self._paused
        if last < time.monotonic() - seconds:   # else a beat came after the resume: fresh
            self._paused = (last, paused + seconds if since == last else seconds)
        log.warning("process was stopped for %.1f s; hang clock paused", seconds)

    def _idle(self, now: float) -> float:
        """Seconds since the last beat, stopped time left out."""
        last = self._last
        since, paused = self._paused
        return now - last - (paused if since == last else 0.0)

    def _expire(self) -> None:
        # The thread's deadline is only refreshed every rearm_every_s: check the real age.
        now = time.monotonic()
        idle = self._idle(now)
        if idle < self._budget and self._thread is not None:
            self._thread.set(now + self._budget - idle)
            return
        # Decided, before anything slow: from here the training thread is held at its next
        # safe point (beat, the optimizer step through on_decide) and the process ends with HANG.
        self._decider = threading.get_ident()
        self.decided = True
        if self._backstop is not None:
            self._backstop.arm(self.on_hang_budget_s + BACKSTOP_SLACK_S)
        if self.on_decide is not None:
            try:
                self.on_decide()
            except Exception:
                log.exception("hang decision hook failed")
        log.error("no progress for %.1f s (budget %.1f s): hang detected, exiting with %d",
                  idle, self._budget, HANG_CODE)
        dump_all_stacks(f"hang detected: no step finished for {idle:.1f} s; stacks of all "
                        "threads")
        code = HANG_CODE
        if self.on_hang is not None:
            try:
                decided = self.on_hang()
                if isinstance(decided, int) and not isinstance(decided, bool):
                    code = decided
            except Exception:
                log.exception("hang action failed")
        os._exit(code)
