"""RayDriver: a Ray driver whose signals are always seen, and whose stop is every actor's stop.

``ray.init`` installs a SIGTERM handler that raises ``SystemExit`` anywhere and ``ray.get``
blocks in C. So the driver installs the ShutdownHandler after ``ray.init`` and waits with
``ray.wait(timeout=)`` in a loop. The stop's steps (``_stop_all``) are in docs/ray.md.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from typing import Any, Iterable, Sequence

from kempner_resilience.config import Action, ResilienceConfig, SignalsConfig, load_config
from kempner_resilience.core.log import get_logger, set_role
from kempner_resilience.core.procs import descendants
from kempner_resilience.core.runpaths import RunPaths
from kempner_resilience.exitcodes import (Ending, ExitCode, Facts, Saved, Verdict, after_requeue,
                                          exit_code)
from kempner_resilience.supervise.ray.actor import (ActorEnding, actor_died, actor_ends,
                                                    call_error, ending_of, kill_actors)
from kempner_resilience.supervise.ray.board import create_board
from kempner_resilience.slurm.env import SlurmJob
from kempner_resilience.slurm.requeue import REQUESTED, requeue_run
from kempner_resilience.stop.signals import ShutdownHandler, ShutdownRequest
from kempner_resilience.supervise.channel import newest_commit
from kempner_resilience.supervise.policy import Action as Next, Evidence, Guard, RankEnd, decide

__all__ = ["RayDriver", "driver_forces", "clear_ray_handlers", "shutdown_ray"]

log = get_logger(__name__)

#: Seconds of the signal's grace kept for Ray's own shutdown after the actors are done.
_MARGIN_S = 5.0


class RayDriver:
    """The driver's context, entered after ``ray.init`` on the main thread (example:
    docs/ray.md). A stopped job never returns results as if it were done: ``SystemExit``."""

    def __init__(self, config: ResilienceConfig | SignalsConfig | None = None, *,
                 stop_timeout_s: float | None = None, poll_s: float = 0.2) -> None:
        if config is None:
            config = load_config()
        self.signals = config.signals if isinstance(config, ResilienceConfig) else config
        # The whole config (checkpoint.dir, requeue.*): what a requeue under SLURM needs.
        self.config = config if isinstance(config, ResilienceConfig) else None
        self.signals.validate()
        self.stop_timeout_s = stop_timeout_s
        self.poll_s = poll_s
        self.board: Any = None
        self.actors: list[Any] = []
        self.results: list[Any] = []      # what the refs returned in the stop, in order
        self._handler = ShutdownHandler(self.signals, forces=driver_forces)
        self._stop = threading.Event()
        self._stopping = False
        self._role: str | None = None
        self._requeuing = False           # this driver asked SLURM to requeue the job

    def __enter__(self) -> "RayDriver":
        import ray

        if not ray.is_initialized():
            raise RuntimeError("RayDriver is entered after ray.init()")
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("RayDriver must be entered on the main thread (Python only "
                               "delivers signals there)")
        clear_ray_handlers(self._handler.signals)
        self._role = set_role("ray driver")     # not a rank, whatever RANK says
        self._handler.install()
        self._handler.add_listener(lambda req: self._stop.set())
        self._handler.add_forced_exit_hook(self._force)
        self.board = create_board()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        try:
            req = self._handler.request
            if exc_type is None and req is not None and not self._stopping:
                # A signal after the last get(): the stop still happens, with nothing to wait on.
                self._stop_all(req.signum, [], [])
        finally:
            # SLURM answers our requeue with a SIGTERM to every process of the job, often as
            # this one leaves: it must not end it with 143 instead of the code decided.
            leaving = self._requeuing and exc_type is SystemExit
            self._handler.uninstall(instead={signal.SIGTERM: signal.SIG_IGN} if leaving else None)
            set_role(self._role)

    @property
    def request(self) -> ShutdownRequest | None:
        """The first shutdown signal the driver received, or None."""
        return self._handler.request

    def track(self, *actors: Any) -> list[Any]:
        """Actors a forced stop kills (``ray.kill``); returns them as a list."""
        self.actors.extend(actors)
        return list(actors)

    def untrack(self, *actors: Any) -> None:
        """Actors no longer to kill on a forced stop (a supervisor killed them already)."""
        self.actors = [a for a in self.actors if all(a is not b for b in actors)]

    def get(self, refs: Sequence[Any], *, cancel: Sequence[Any] = ()) -> list[Any]:
        """Wait for the training calls ``refs`` and return their results. ``cancel``: calls
        that live as long as the training (rollouts), cancelled without force at its end. A
        signal, a call's own error or a lost ``cancel`` call (75) stops everything."""
        refs, cancel = list(refs), list(cancel)
        # How long the survivors of a lost training actor get to rescue and end.
        bound = (self.config.rescue.budget_s if self.config is not None else 120.0) + 30.0
        killed = self._wait_training(refs, cancel, bound, stop_on_error=True)
        if killed:
            log.error("rank(s) %s did not end %.0f s after the loss: killing every actor",
                      killed, bound)
            kill_actors(self.actors)
        self.finish(cancel)
        results = [_result_of(r) for r in refs]
        # Any value but an ending (or an error) is a completed call.
        ends = actor_ends([r if isinstance(ending_of(r), (ActorEnding, BaseException))
                           else ActorEnding(0) for r in results], killed, driver_stopping=False)
        if any(e.code != 0 for e in ends):
            self._leave_after(ends)
        return results

    def run_group(self, actor_cls: Any, world_size: int, method: str, *args: Any,
                  cancel: Sequence[Any] = (), backend: str = "gloo",
                  options: dict[str, Any] | None = None, warm: bool = False,
                  **kwargs: Any) -> list[Any]:
        """What ``method`` returned on each rank of ``world_size`` ``actor_cls`` actors (a
        plain class gets 1 CPU). A lost actor's group comes back while the policy says so
        (``relaunch.supervise``; ``warm``: with the live actors, reborn), else ``SystemExit``."""
        import ray

        from kempner_resilience.supervise.ray.relaunch import supervise

        if hasattr(actor_cls, "remote"):
            make = actor_cls.options(**options) if options else actor_cls
        else:
            make = ray.remote(actor_cls).options(**{"num_cpus": 1, **(options or {})})
        config = self.config if self.config is not None else load_config()
        outcomes = supervise(self, make.remote, world_size,
                             lambda actor, rank: actor.kr_call.remote(method, args, kwargs),
                             config, cancel=cancel, backend=backend, warm=warm)
        return [o["result"] if isinstance(o, dict) and "result" in o else o for o in outcomes]

    def wait_group(self, refs: Sequence[Any], actors: Sequence[Any], *,
                   cancel: Sequence[Any] = (), bound: float = 150.0
                   ) -> tuple[list[Any], list[int]]:
        """One incarnation of a group: each call's outcome, and the ranks killed for not
        ending ``bound`` s after the first failed (the survivors rescue and end alone)."""
        refs = list(refs)
        killed = self._wait_training(refs, list(cancel), bound, stop_on_error=False)
        for r in killed:
            log.error("rank %d did not end %.0f s after the loss: killing its actor", r, bound)
        kill_actors([actors[r] for r in killed])
        return [_result_of(r) for r in refs], killed

    def finish(self, cancel: Sequence[Any]) -> None:
        """The training is over: cancel ``cancel`` without force and wait for it (bounded)."""
        self._cancel_and_wait(list(cancel), self._bound(signal.SIGTERM))

    def requeue(self, why: str, *, exclude: Iterable[str] = (),
                ends: tuple[RankEnd, ...] = REQUESTED) -> Verdict | None:
        """Under SLURM, requeue the job as rank 0 would (the driver is the job's one SLURM
        process); None when no requeue was tried."""
        job = SlurmJob.from_env()
        if job is None or self.config is None:
            return None
        paths = RunPaths.from_config(self.config)
        # SLURM's SIGTERM may come before `scontrol requeue` returns.
        self._requeuing = True
        self._handler.expect(signal.SIGTERM)
        decision, result = requeue_run(job, paths, self.config.requeue, newest_commit(paths),
                                       ends=ends, exclude=exclude, min_nodes=job.nnodes)
        if decision.guard is Guard.NOTHING_COMMITTED:
            log.warning("%s: not requeued, nothing committed to come back to", why)
            return None
        if result is None:
            return decision.verdict
        log.warning("%s: %s", why, result.message)
        return result.verdict

    def _wait_training(self, refs: list[Any], cancel: list[Any], bound: float, *,
                       stop_on_error: bool) -> list[int]:
        """The ranks not ended ``bound`` s after the first was lost. ``stop_on_error``: a
        call's own error stops everything."""
        import ray

        # The errors a call's outcome may be; any other one is the driver's own bug.
        errors = (ray.exceptions.RayTaskError, ray.exceptions.RayActorError,
                  ray.exceptions.TaskCancelledError)
        pending = refs + cancel
        until: float | None = None
        while not self._stop.is_set() and any(r in pending for r in refs) \
                and (until is None or time.monotonic() <= until):
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=self.poll_s)
            for ref in done:
                err = call_error(ref, errors)
                if err is None:
                    continue
                if ref in cancel and (_cancelled(err) or actor_died(err)):
                    # A rollout's call ended unasked: every actor stops with its checkpoint.
                    why = "was stopped (its tasks cancelled)" if _cancelled(err) else "is gone"
                    log.error("a rollout or helper actor %s (%s): stopping the training to run "
                              "again", why, type(err).__name__)
                    self._stop_all(signal.SIGTERM, refs, cancel, run_again=f"a helper actor {why}")
                if ref in refs and (actor_died(err) or not stop_on_error):
                    if until is None:
                        log.error("a training actor is lost (%s): waiting up to %.0f s for the "
                                  "others' rescue", type(err).__name__, bound)
                        until = time.monotonic() + bound
                    continue
                log.error("a task failed (%s): stopping every actor", type(err).__name__)
                self._stop_all(signal.SIGTERM, refs, cancel, error=err)
        if self._stop.is_set():
            req = self._handler.request
            assert req is not None
            self._stop_all(req.signum, refs, cancel)
        return [r for r, ref in enumerate(refs) if ref in pending]

    def _leave_after(self, ends: Sequence[RankEnd]) -> None:
        """Not every training call completed: requeue if the policy says so, then leave."""
        decision = decide(Evidence(tuple(ends)))
        code = decision.code
        if decision.action is not Next.LEAVE:
            code = after_requeue(code, self.requeue(decision.why, ends=tuple(ends)))
        log.warning("the training group ended %s before its last step: %s; exit %d",
                    [e.code for e in ends], decision.why, code)
        shutdown_ray()
        raise SystemExit(code)

    def _stop_all(self, signum: int, refs: list[Any], cancel: list[Any], *,
                  error: BaseException | None = None, run_again: str | None = None) -> None:
        """Post the stop on the board, cancel ``cancel``, wait within the grace, shut Ray
        down, leave with the table's code. ``run_again``: why the job runs again unasked."""
        self._stopping = True
        started = time.monotonic()
        log.warning("%s: stopping every actor (%d training calls, %d to cancel)",
                    "a task failed" if error else signal.Signals(signum).name, len(refs),
                    len(cancel))
        self.board.set.remote(signum)
        pending = self._cancel_and_wait(cancel, self._bound(signum), also=refs)
        self.results = [_result_of(r) for r in refs]
        if pending:
            log.error("%d calls not done %.0f s after the stop: killing their actors",
                      len(pending), time.monotonic() - started)
            kill_actors(self.actors)
            code = int(ExitCode.DEADLINE)
        elif error is not None:
            code = int(ExitCode.ERROR)
        else:
            failed = any(isinstance(e, ActorEnding) and e.code == ExitCode.CHECKPOINT_FAILED
                         for e in map(ending_of, self.results))
            saved = Saved.FAILED if failed else Saved.COMMITTED
            if run_again is not None:
                verdict = self.requeue(run_again) if saved is Saved.COMMITTED else None
                verdict = verdict or Verdict.REQUEUED
            else:
                if signal.SIGINT in self._handler.deliveries:
                    signum = signal.SIGINT   # the parent's SIGTERM may have come first: a Ctrl+C
                # A signal whose action is ``requeue`` (USR1), once every actor committed.
                name = signal.Signals(signum).name
                asks = self.signals.handled().get(name) is Action.REQUEUE
                verdict = self.requeue(name) if asks and saved is Saved.COMMITTED else None
            code = int(exit_code(Facts(Ending.SIGNAL, signum=signum, saved=saved, requeue=verdict)))
        log.warning("every actor done %.1f s after the stop; shutting Ray down, exit %d",
                    time.monotonic() - started, code)
        shutdown_ray()
        if error is not None:
            raise error
        raise SystemExit(code)

    def _cancel_and_wait(self, cancel: list[Any], bound: float, *,
                         also: Sequence[Any] = ()) -> list[Any]:
        """Cancel ``cancel`` without force; what of it and ``also`` is not done in ``bound``."""
        import ray

        for ref in cancel:
            try:
                ray.cancel(ref, force=False)
            except Exception as e:  # already done, or its actor gone
                log.debug("cancel %s: %s", ref, e)
        until = time.monotonic() + bound
        pending = list(also) + list(cancel)
        while pending and time.monotonic() < until:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=self.poll_s)
        return pending

    def _bound(self, signum: int) -> float:
        if self.stop_timeout_s is not None:
            return self.stop_timeout_s
        req = self._handler.request
        if req is not None:   # the deadline counts from the first signal, SIGTERM may tighten it
            return max(1.0, req.deadline - time.monotonic() - _MARGIN_S)
        return max(1.0, self.signals.grace_for(signal.Signals(signum).name) - _MARGIN_S)

    def _force(self, code: int) -> None:
        """A second Ctrl+C: kill the actors, then every process this driver started (a bare
        ``os._exit`` would leave the local Ray node behind)."""
        log.error("forced: killing %d actors and the local Ray node", len(self.actors))
        kill_actors(self.actors)
        for pid in reversed(descendants(os.getpid())):     # the deepest first
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


def driver_forces(signum: int, earlier: list[int]) -> bool:
    """Only a second SIGINT, or a second SIGTERM, forces the driver out: a dying parent's
    SIGTERM (``uv run`` sends one on the Ctrl+C) may come first, and that SIGINT is part of
    the stop under way."""
    return signum in (signal.SIGINT, signal.SIGTERM) and signum in earlier


def shutdown_ray() -> None:
    """``ray.shutdown()``, then SIGTERM's handler put back in place.

    Ray's shutdown resets SIGTERM's kernel action to the default behind Python's back
    (``getsignal`` still names Python's handler): SLURM's SIGTERM answering our requeue
    turned a driver leaving with 75 into 143. Installing the handler again fixes the kernel's."""
    import ray

    ray.shutdown()
    if threading.current_thread() is threading.main_thread():
        handler = signal.getsignal(signal.SIGTERM)
        if handler is not None:
            signal.signal(signal.SIGTERM, handler)


def clear_ray_handlers(signums: Sequence[int]) -> None:
    """Ray's handlers (``SystemExit`` at an arbitrary point) must not be chained by ours, and
    Ray's shutdown must not put SIGTERM back to its default action (``_keep_actions``)."""
    for signum in signums:
        prev = signal.getsignal(signum)
        if callable(prev) and (getattr(prev, "__module__", "") or "").startswith("ray"):
            signal.signal(signum, signal.SIG_DFL)
    _keep_actions()


# Ray's core worker installs abseil's failure-signal handler (SIGTERM is one of its signals)
# when the driver connects, and its shutdown sets each of those signals back to SIG_DFL at the
# kernel, 0.04-0.3 s into a shutdown that takes a second or more. A SIGTERM in that window (a
# dying parent's after a Ctrl+C, SLURM's after a requeue) ends the driver with 143, whatever its
# run decided. Ray resets them only while this flag of its C++ logger is set. The flag is a
# private symbol of ray._raylet: where it is missing, ``shutdown_ray``'s re-install is all.
_RAY_FAILURE_HANDLER_FLAG = "_ZN3ray6RayLog36is_failure_signal_handler_installed_E"


def _keep_actions() -> None:
    try:
        import ctypes

        import ray._raylet as raylet

        flag = ctypes.c_bool.in_dll(ctypes.CDLL(raylet.__file__), _RAY_FAILURE_HANDLER_FLAG)
    except (ImportError, OSError, ValueError) as e:
        log.debug("Ray's shutdown may set SIGTERM back to its default action for about a "
                  "second (%s not found: %s)", _RAY_FAILURE_HANDLER_FLAG, e)
        return
    ctypes.memset(ctypes.addressof(flag), 0, ctypes.sizeof(flag))      # false


def _cancelled(err: BaseException) -> bool:
    return any(c.__name__ == "TaskCancelledError" for c in type(err).__mro__)


def _result_of(ref: Any) -> Any:
    import ray

    try:
        return ray.get(ref, timeout=0)
    except Exception as e:   # cancelled, failed or not done: the exception is the result
        return e
