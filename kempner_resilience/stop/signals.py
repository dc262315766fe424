"""ShutdownHandler: see a shutdown signal at once, even while the main thread is stuck in C.

Python runs signal handlers only on the main thread, between bytecodes, so a handler never runs
while the main thread waits in a gloo/NCCL collective: exactly when the deadline matters most.
The C-level part of CPython's handler runs at once, though, and with ``signal.set_wakeup_fd`` it
writes the signal number to a pipe. A dedicated thread blocks on that pipe; it wakes within
microseconds whenever the main thread has released the GIL (collectives, sleeps and I/O do) and
arms the shutdown deadline. The Python-level handler only records and chains.

A launcher that gives its workers a parent-death signal (``PR_SET_PDEATHSIG``: the
``kempner-resilience torchrun`` agent) gives them ``PARENT_DEATH_SIGNAL`` and names it in
``$KEMPNER_RESILIENCE_PARENT_DEATH_SIGNAL``. Linux sends that signal as each thread of a dying
multi-threaded parent exits (the child passes to the next thread, which exits too), so one death
arrives as several signals within milliseconds: as SIGTERM it would be "a second SIGTERM" and
force the worker out without its checkpoint. A signal of its own tells the two apart: its first
delivery is a SIGTERM-class stop (SIGTERM's action and grace, 143), its repeats are the same
event, and a user's SIGTERM never counts as its repeat (nor it as a second SIGTERM).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from kempner_resilience.config import Action, SignalsConfig
from kempner_resilience.exitcodes import Ending, Facts, exit_code
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.startup import (_early, _early_record, forwarded_signals,
                                             install_early_recorder)
from kempner_resilience.stop.watchdog import DeadlineWatchdog

__all__ = ["ShutdownHandler", "ShutdownRequest", "active_handlers", "install_early_recorder",
           "repeat_forces",
           "PARENT_DEATH_SIGNAL", "PARENT_DEATH_ENV", "parent_death_signal"]

log = get_logger(__name__)

_STOP_BYTE = 0  # no signal has number 0: tells the reader thread to leave

#: The parent-death signal launchers give their workers: a real-time signal nobody else sends
#: (SIGRTMIN + 10, 44 on Linux; 42 and 43 are the watchdogs' kernel timers). Real-time signals
#: queue, so every delivery reaches the handler and none is mistaken for another signal. Its
#: default action ends the process, as SIGTERM's would, where no handler is installed yet.
PARENT_DEATH_SIGNAL = int(getattr(signal, "SIGRTMIN", 34)) + 10
#: Set by the launcher in the workers' environment: the signal number it gave them as their
#: parent-death signal. ShutdownHandler handles it only when this says so.
PARENT_DEATH_ENV = "KEMPNER_RESILIENCE_PARENT_DEATH_SIGNAL"


def parent_death_signal(environ: Mapping[str, str] | None = None) -> int | None:
    """The parent-death signal ``$KEMPNER_RESILIENCE_PARENT_DEATH_SIGNAL`` names, or None (unset;
    not a real-time signal number: logged and ignored, the launcher's bug is not the run's)."""
    env = os.environ if environ is None else environ
    raw = env.get(PARENT_DEATH_ENV, "").strip()
    if not raw:
        return None
    lo, hi = getattr(signal, "SIGRTMIN", None), getattr(signal, "SIGRTMAX", None)
    try:
        signum = int(raw)
    except ValueError:
        signum = -1
    if lo is None or hi is None or not lo <= signum <= hi:
        log.warning("%s=%r is not a real-time signal number: ignored (the parent's death then "
                    "ends this process without a checkpoint)", PARENT_DEATH_ENV, raw)
        return None
    return signum


@dataclass(frozen=True)
class ShutdownRequest:
    """The first shutdown signal: what arrived, when, and what it asks for."""

    signum: int
    action: Action
    received_at: float  # time.monotonic()
    received_wall: float  # time.time(), for logs
    grace_s: float

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def deadline(self) -> float:
        """``time.monotonic()`` value by which the process must be gone."""
        return self.received_at + self.grace_s


_active: "weakref.WeakSet[ShutdownHandler]" = weakref.WeakSet()


def active_handlers() -> list["ShutdownHandler"]:
    """The ShutdownHandlers installed in this process right now (for launcher adapters)."""
    return [h for h in list(_active) if h._installed]


def _reset_in_forked_child() -> None:
    # A forked child (a DataLoader worker) must not run our handlers: it would swallow the
    # signal meant to end it, and its wakeup bytes would land in the parent's pipe.
    for handler in list(_active):
        handler._forget_after_fork()


os.register_at_fork(after_in_child=_reset_in_forked_child)


class ShutdownHandler:
    """Installs handlers for the configured signals and turns the first one into a request.

    ``install()`` must run on the main thread. The first signal creates ``request``, arms the
    deadline watchdog (forced ``os._exit(DEADLINE)`` when the grace runs out) and calls the
    listeners from the signal thread. A repeated SIGINT, or a second SIGTERM, during a graceful
    shutdown exits at once with 130/143; any other later signal only tightens the deadline (a
    SIGTERM at the time limit must not throw away a checkpoint that is almost written).
    """

    def __init__(self, config: SignalsConfig | None = None, *,
                 deadline: DeadlineWatchdog | None = None,
                 forces: Callable[[int, list[int]], bool] | None = None) -> None:
        self.config = config or SignalsConfig()
        self.deadline = deadline or DeadlineWatchdog()
        # (signal, the signals delivered before it) -> does it force the exit. A Ray driver
        # passes its own: there a parent's SIGTERM can be handled before the Ctrl+C's SIGINT.
        self._forces = forces or repeat_forces
        self._actions = {getattr(signal, n): a for n, a in self.config.handled().items()}
        # Our launcher's parent-death signal: a SIGTERM-class stop, repeats included once.
        pdeath = parent_death_signal()
        self._parent_death = pdeath if pdeath not in self._actions else None
        # A warm rank under srun: its task's shim passes the task's signals on as these.
        self._forwarded = {rt: s for rt, s in forwarded_signals().items()
                           if s in self._actions and rt not in self._actions
                           and rt != self._parent_death}
        self._paths: dict[tuple[bool, int], int] = {}   # (forwarded, signal) -> deliveries
        self._expected: set[int] = set()     # signals this process brought on itself (expect)
        self._previous: dict[int, Any] = {}
        self._listeners: list[Callable[[ShutdownRequest], None]] = []
        self._forced_exit_hooks: list[Callable[[int], None]] = []
        # Reentrant: the Python-level handler takes it in the main thread, and a second signal's
        # handler can run inside the first one's critical section (Python runs handlers between
        # any two bytecodes). With a plain Lock the main thread then waited on itself, and the
        # signal thread behind it: no log, no deadline, a rank stuck for good (seen with three
        # SIGTERMs sent back to back).
        self._lock = threading.RLock()
        self._request: ShutdownRequest | None = None
        self._deliveries: list[int] = []
        self._rfd = self._wfd = -1
        self._old_wakeup_fd = -1
        self._thread: threading.Thread | None = None
        self._installed = False
        self._pid = os.getpid()
        self._parent_pid = os.getppid()   # for the log when it dies

    # ------------------------------------------------------------------ public API

    @property
    def request(self) -> ShutdownRequest | None:
        """The first shutdown signal received, or None."""
        return self._request

    def requested(self) -> bool:
        return self._request is not None

    @property
    def signals(self) -> list[int]:
        return sorted(self._actions)

    @property
    def deliveries(self) -> tuple[int, ...]:
        """Every handled signal received so far, in the order the signal thread saw them."""
        return tuple(self._deliveries)

    def expect(self, signum: int) -> None:
        """From now on ``signum`` is this process's own doing and never forces the exit: our
        ``scontrol requeue`` makes SLURM SIGTERM every process of the job, and a batch shell
        that passes signals on to its child (the Ray template) delivers that SIGTERM twice."""
        self._expected.add(signum)

    def add_listener(self, fn: Callable[[ShutdownRequest], None]) -> None:
        """Call ``fn(request)`` from the signal thread on the first signal (must be quick)."""
        self._listeners.append(fn)
        if self._request is not None:
            fn(self._request)

    def add_forced_exit_hook(self, fn: Callable[[int], None]) -> None:
        """Call ``fn(code)`` just before a repeated signal forces the process out with ``code``
        (130/143). Hooks get about a second in all, in a thread of their own, so one that
        blocks (a store whose other end is busy or gone) cannot delay the exit for long."""
        self._forced_exit_hooks.append(fn)

    def install(self) -> "ShutdownHandler":
        if self._installed:
            return self
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("ShutdownHandler.install() must run on the main thread: Python "
                               "only lets the main thread set signal handlers")
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._wfd, False)
        for fd in (self._rfd, self._wfd):
            os.set_inheritable(fd, False)
        for signum in self._handled():
            prev = signal.getsignal(signum)
            # The early recorder's job ends here: restore the default afterwards, never chain it.
            self._previous[signum] = signal.SIG_DFL if prev is _early_record else prev
            signal.signal(signum, self._python_handler)
        self._old_wakeup_fd = signal.set_wakeup_fd(self._wfd, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._reader, name="kempner-signal-thread",
                                        daemon=True)
        self._thread.start()
        self._installed = True
        _active.add(self)
        self._replay_early()
        log.debug("handling %s", ", ".join(f"{signal.Signals(s).name}={a.value}"
                                           for s, a in self._actions.items()))
        return self

    def uninstall(self, *, keep_deadline: bool = False,
                  instead: Mapping[int, Any] | None = None) -> None:
        """Restore the previous handlers and wakeup fd, and disarm the deadline.

        ``keep_deadline=True`` leaves an armed deadline armed: ResilientRun uses it to bound the
        interpreter's exit after a completed shutdown. ``instead``: handlers put in place of
        the previous ones, with no moment between ours and them (a process that requeued its
        job leaves while SLURM's SIGTERM comes: the default action would end it with 143).
        """
        instead = dict(instead or {})
        if not keep_deadline:
            self.deadline.disarm()
        if not self._installed:
            return
        self._installed = False
        _active.discard(self)
        if os.getpid() == self._pid and threading.current_thread() is threading.main_thread():
            current = signal.set_wakeup_fd(self._old_wakeup_fd)
            if current not in (self._wfd, -1):
                # Someone set their own wakeup fd after us; leave theirs in place.
                signal.set_wakeup_fd(current)
            for signum, prev in self._previous.items():
                if signum not in instead:
                    signal.signal(signum, prev if prev is not None else signal.SIG_DFL)
            for signum, handler in instead.items():
                signal.signal(signum, handler)
        try:
            os.write(self._wfd, bytes([_STOP_BYTE]))
        except OSError:
            pass
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        self._close_pipe()

    def _close_pipe(self) -> None:
        for fd in (self._rfd, self._wfd):
            try:
                os.close(fd)
            except OSError:
                pass
        self._rfd = self._wfd = -1

    def __enter__(self) -> "ShutdownHandler":
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    # ------------------------------------------------------------------ internals

    def _handled(self) -> list[int]:
        return [*self._actions, *self._forwarded] + \
            ([self._parent_death] if self._parent_death else [])

    def _make_request(self, signum: int, at: float | None = None) -> ShutdownRequest:
        signum = self._forwarded.get(signum, signum)
        if signum == self._parent_death:
            signum = signal.SIGTERM   # the launcher died: stop as a SIGTERM would (143)
        with self._lock:
            if self._request is None:
                name = signal.Signals(signum).name
                now = time.monotonic()
                at = now if at is None else at
                self._request = ShutdownRequest(
                    signum=signum, action=self._actions.get(signum, Action.STOP),
                    received_at=at, received_wall=time.time() - (now - at),
                    grace_s=self.config.grace_for(name))
            return self._request

    def _replay_early(self) -> None:
        # A warm rank's shim stand-ins are replayed as the signals they stand for.
        pending = [(self._forwarded.get(s, s), t) for s, t in _early]
        pending = [(s, t) for s, t in pending if s in self._actions]
        _early.clear()
        for signum, at in pending:
            log.warning("%s arrived %.1f s before the run started; handling it now",
                        signal.Signals(signum).name, time.monotonic() - at)
            self._make_request(signum, at)  # the deadline counts from the real arrival
            try:
                os.write(self._wfd, bytes([signum]))
            except OSError:
                pass

    def _python_handler(self, signum: int, frame: Any) -> None:
        # Only record, then chain. The reader thread does the rest (it usually got there first).
        self._make_request(signum)
        prev = self._previous.get(signum)
        # default_int_handler would raise KeyboardInterrupt in the middle of a step.
        if callable(prev) and prev is not signal.default_int_handler:
            prev(signum, frame)

    def _reader(self) -> None:
        while True:
            try:
                data = os.read(self._rfd, 256)
            except InterruptedError:
                continue
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum == _STOP_BYTE:
                    return
                self._forward(signum)
                if signum in self._forwarded:
                    if not self._mirrors(self._forwarded[signum], True):
                        self._on_delivery(self._forwarded[signum])
                elif signum in self._actions:
                    if not self._mirrors(signum, False):
                        self._on_delivery(signum)
                elif signum == self._parent_death:
                    self._on_parent_death(signum)

    def _forward(self, signum: int) -> None:
        # A wakeup fd installed before ours (another library's) still gets its bytes.
        if self._old_wakeup_fd not in (-1, self._wfd):
            try:
                os.write(self._old_wakeup_fd, bytes([signum]))
            except OSError:
                pass

    def _mirrors(self, signum: int, forwarded: bool) -> bool:
        """Whether this delivery is one that already came the other way. A signal for the
        whole job reaches a warm rank twice: from the step it lives in (the standby's) and
        through its srun task's shim. The n-th of each path is one event, so a second
        SIGTERM is a second one only when it comes a second time."""
        if not self._forwarded:
            return False
        n = self._paths.get((forwarded, signum), 0)
        self._paths[(forwarded, signum)] = n + 1
        if n < self._paths.get((not forwarded, signum), 0):
            log.debug("%s again, the other way to this warm rank: the same signal",
                      signal.Signals(signum).name)
            return True
        return False

    def _on_delivery(self, signum: int) -> None:
        earlier = list(self._deliveries)
        self._deliveries.append(signum)
        name = signal.Signals(signum).name
        if not earlier:
            self._first(signum, f"{name} received")
            return
        if signum not in self._expected and self._forces(signum, earlier):
            code = int(exit_code(Facts(Ending.FORCED, signum=signum)))   # 130 or 143
            log.error("second %s during shutdown: exiting at once with %d", name, code)
            self._run_forced_exit_hooks(code)
            os._exit(code)
        self._tighten(self.config.grace_for(name), f"{name} during shutdown")

    def _on_parent_death(self, signum: int) -> None:
        earlier = list(self._deliveries)
        self._deliveries.append(signum)
        if signum in earlier:
            # The kernel sends it again as each thread of the dying parent exits: one event.
            log.debug("parent-death signal again (another thread of the launcher exited)")
            return
        if not earlier:
            self._first(signum, f"the launcher (pid {self._parent_pid}) died, so: as for "
                                "SIGTERM")
            return
        # Already shutting down (say the launcher forwarded a SIGTERM, then was killed): a
        # later signal, never "a second SIGTERM", so it only tightens the deadline.
        self._tighten(self.config.grace_for("SIGTERM"), "the launcher died during shutdown")

    def _first(self, signum: int, what: str) -> None:
        """The first shutdown signal: the request, the deadline, the listeners."""
        req = self._make_request(signum)
        self.deadline.arm(req.deadline, what)
        log.warning("%s: %s; graceful shutdown at the next step boundary, forced exit in %.0f s",
                    what, _describe(req.action), req.grace_s)
        for fn in list(self._listeners):
            try:
                fn(req)
            except Exception:  # a listener must never kill the signal thread
                log.exception("shutdown listener %r failed", fn)

    def _tighten(self, grace_s: float, what: str) -> None:
        if self.deadline.tighten(time.monotonic() + grace_s):
            log.warning("%s: deadline moved to %.0f s from now", what, grace_s)

    def _run_forced_exit_hooks(self, code: int, budget_s: float = 1.0) -> None:
        def run() -> None:
            for fn in list(self._forced_exit_hooks):
                try:
                    fn(code)
                except Exception as e:  # the exit goes ahead whatever a hook does
                    log.warning("forced-exit hook %r failed: %s", fn, e)

        if not self._forced_exit_hooks:
            return
        t = threading.Thread(target=run, name="kempner-forced-exit", daemon=True)
        t.start()
        t.join(budget_s)

    def _forget_after_fork(self) -> None:
        self._installed = False
        try:
            if threading.current_thread() is threading.main_thread():
                signal.set_wakeup_fd(-1)
                for signum, prev in self._previous.items():
                    signal.signal(signum, prev if prev is not None else signal.SIG_DFL)
        except (ValueError, OSError):
            pass
        self._close_pipe()
        self._thread = None


def repeat_forces(signum: int, earlier: list[int]) -> bool:
    """The default rule: a SIGINT during a shutdown, or a second SIGTERM, forces the exit."""
    return signum == signal.SIGINT or (signum == signal.SIGTERM and signal.SIGTERM in earlier)


def _describe(action: Action) -> str:
    return {Action.REQUEUE: "checkpoint and requeue", Action.STOP: "checkpoint and stop"}.get(
        action, action.value)
