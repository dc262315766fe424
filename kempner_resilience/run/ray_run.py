"""RayRun: a ResilientRun in a Ray driver whose loop is the driver's (SkyRL's trainer shape).

```python
ray.init()
policy, ref = WorkerGroup(PolicyWorker, 2), WorkerGroup(RefWorker, 1)
with RayRun(cfg, state={"data": loader, "trainer": counters, "policy": policy,
                        "ref": ref}) as run:
    for step in run.steps(total):              # the driver's loop, one step's orchestration
        batch = next(batches)
        episodes = asyncio.run(generate(batch))
        ref.call("forward", episodes); policy.call("train_step", episodes)
```

What the run adds to a ResilientRun, and why:

* The worker groups are entries of ``state`` like the data loader: on entry each group is
  formed (its actors created, their process group joined, the config handed over), then the
  newest committed checkpoint is loaded into the driver's parts and, by the actors themselves,
  into each group (``checkpoint/delegated.py``). A save writes the driver's own state, then
  each group's into ``<step>/<name>/``, and the driver commits the one manifest.
* Ray's SIGTERM handler in the driver raises ``SystemExit`` wherever the main thread is; it is
  cleared before the run's handlers go in, so a signal (Ctrl+C, SLURM's USR1, the parent's
  SIGTERM) stops at the driver's step boundary, with the emergency save of every part. A
  parent's SIGTERM that comes with the Ctrl+C is the same stop (``driver_forces``).
* A group's actor that died or fell silent raises ``GroupLost`` out of the step: the run ends
  as a rank that lost a peer ends (PEER_LOST, 81, nothing saved: the actors' state is gone),
  and every group's actors are killed. Under ``supervise_loop`` the one policy
  (``supervise/policy.py``: the restart budget, the no-progress guard) decides: the driver's
  function runs again, its run resumes from the newest commit with new groups, and the steps
  redone are said; or the driver leaves with the policy's code. Never 0, never 1. There the
  live actors are parked instead of killed, and the new groups take them back, reborn in
  their own processes (``supervise/ray/parking.py``).
* The run leaves by raising (``raise`` exit mode): the driver's process goes on to shut Ray
  down, or to run the loop again. After a requeue under SLURM the run shuts Ray down itself
  (``_after_end``).
"""

from __future__ import annotations

import atexit
import contextvars
import os
import signal
from typing import Any, Callable, Mapping, TypeVar

from kempner_resilience.checkpoint.layout import newest_committed
from kempner_resilience.config import ExitMode
from kempner_resilience.core.log import get_logger, set_role
from kempner_resilience.core.runpaths import RunPaths
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.supervise.ray.driver import (clear_ray_handlers, driver_forces,
                                                     shutdown_ray)
from kempner_resilience.supervise.ray.group import GroupLost, WorkerGroup
from kempner_resilience.supervise.ray.parking import parking_for
from kempner_resilience.run.resilient import ResilientRun
from kempner_resilience.supervise.policy import Action, Commits, Evidence, RankEnd, decide

__all__ = ["RayRun", "supervise_loop"]

log = get_logger(__name__)

T = TypeVar("T")

# Set by ``supervise_loop`` while it runs the driver's function: a lost group is then the
# supervisor's to decide on; outside it the driver leaves with PEER_LOST for its launcher.
_SUPERVISED: contextvars.ContextVar[bool] = contextvars.ContextVar("kr_ray_supervised",
                                                                    default=False)


class RayRun(ResilientRun):
    """A ResilientRun in a Ray driver (entered after ``ray.init``, on the main thread):
    ``state`` holds the driver's own parts and its ``WorkerGroup`` s. Arguments as
    ``ResilientRun``'s; ``exit_mode`` defaults to ``raise``."""

    _forces = staticmethod(driver_forces)

    def __init__(self, config: Any = None, state: Mapping[str, Any] | None = None,
                 **kwargs: Any) -> None:
        kwargs.setdefault("exit_mode", ExitMode.RAISE)
        super().__init__(config, state, **kwargs)
        self.groups = {k: v for k, v in (state or {}).items() if isinstance(v, WorkerGroup)}
        self.lost: GroupLost | None = None
        self._role: str | None = None
        _LAST_RUN.set(self)

    def __enter__(self) -> "RayRun":
        import ray

        if not ray.is_initialized():
            raise RuntimeError("RayRun is entered after ray.init()")
        clear_ray_handlers(self._handler.signals)
        self._role = set_role("ray driver")     # not a rank, whatever RANK says
        try:
            for name, group in self.groups.items():    # formed before the resume loads them
                group.start(name, self.config)
            super().__enter__()
        except BaseException:
            self._stop_groups()
            set_role(self._role)
            raise
        for name, group in self.groups.items():
            # Killed, or parked for the next incarnation under supervise_loop.
            self.add_cleanup(group.release, name=f"{name} group's actors")
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        lost = exc if isinstance(exc, GroupLost) else None
        signalled = self._handler.request is not None
        stop_code = exc.code if isinstance(exc, SystemExit) and signalled else None
        try:
            return super().__exit__(exc_type, exc, tb)
        except SystemExit as e:
            stop_code = e.code if signalled else None
            raise
        except GroupLost as e:       # the run's failure path ended, raised again (raise mode)
            lost = e
            if _SUPERVISED.get():       # supervise_loop says it, with what follows
                raise
            log.error("%s at step %d: its group's state is gone; the newest commit is step %s "
                      "(%d step(s) to redo); exit %d", e, self.step, *self._redo(),
                      int(ExitCode.PEER_LOST))
            raise SystemExit(int(ExitCode.PEER_LOST)) from None
        finally:
            if lost is not None:
                self.lost = lost
            if stop_code is not None and self.exit_code is None:   # else `_after_end` did
                _keep_the_stop_code(stop_code)
            self._stop_groups()
            set_role(self._role)

    def _after_end(self, code: int) -> dict[int, Any]:
        if code == int(ExitCode.REQUEUE) and self._state.parts.slurm is not None:
            # The job is requeued: SLURM ends its processes within KillWait, and its SIGTERM
            # is on its way. Ray goes now, while the run's handlers still stand, since Ray's
            # shutdown sets SIGTERM back to the default action (``shutdown_ray``), and one
            # left for the caller would meet that SIGTERM with nothing to keep the code.
            shutdown_ray()
        # A stop by a signal: the run's handlers give way to ones that keep its code.
        if self._handler.request is not None:
            return _stop_code_keepers(code)
        return super()._after_end(code)

    def _redo(self) -> tuple[int | None, int]:
        """The newest committed step, and how many steps of this run are to be redone."""
        committed = newest_committed(RunPaths.from_config(self.config))
        return committed, self.step - (committed or 0)

    def _stop_groups(self) -> None:
        for group in self.groups.values():
            group.release()


def _keep_the_stop_code(code: Any) -> None:
    """After a stop by a signal the driver still shuts Ray down (``raise`` mode), with the run's
    handlers gone. A dying parent's SIGTERM that comes late (``uv run`` sends it right after
    the Ctrl+C, a loaded machine delays it) must not kill the driver with another code: it is
    ignored, said once; a second Ctrl+C leaves at once, with the stop's code."""
    try:
        for signum, handler in _stop_code_keepers(code).items():
            signal.signal(signum, handler)
    except ValueError:          # not the main thread: nothing can be installed
        pass


def _stop_code_keepers(code: Any) -> dict[int, Callable[[int, Any], None]]:
    """SIGTERM and SIGINT handlers for a driver leaving with ``code`` (``_keep_the_stop_code``)."""
    leave = code if isinstance(code, int) else int(ExitCode.ERROR)
    said: list[int] = []

    def late(signum: int, _frame: Any) -> None:
        if signum == signal.SIGINT:
            os._exit(leave)
        if not said:
            said.append(signum)
            log.warning("%s after the stop: the driver still leaves with %d",
                        signal.Signals(signum).name, leave)

    def ignore_at_exit() -> None:
        # The interpreter's finalisation puts SIG_DFL back in place of every Python handler,
        # and a SIGTERM then (a requeue's, while Ray's core worker shuts down) would end the
        # driver with 143. SIG_IGN is left in place.
        if signal.getsignal(signal.SIGTERM) is late:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    atexit.register(ignore_at_exit)
    return {signal.SIGTERM: late, signal.SIGINT: late}


def supervise_loop(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run ``fn(*args, **kwargs)`` (the driver's training: a ``RayRun`` and its loop) until it
    returns; when a worker group is lost the one policy decides: ``fn`` runs again (its run
    resumes from the newest commit with new groups) within ``requeue.max_restarts`` and the
    no-progress guard, or the driver leaves with the policy's code (``SystemExit``)."""
    token = _SUPERVISED.set(True)
    role = set_role("ray driver")       # its lines are the driver's, between the runs too
    restarts, stalled, before = 0, 0, None
    try:
        # A lost group's live actors wait in the parking for the next run (killed at its end).
        with parking_for():
            while True:
                try:
                    return fn(*args, **kwargs)
                except GroupLost as e:
                    run = _LAST_RUN.get()
                    if run is None:          # lost outside a RayRun: nothing to resume from
                        raise
                    config = run.config
                    now, redo = run._redo()
                    decision = decide(Evidence(
                        (RankEnd(int(ExitCode.PEER_LOST)),), restarts=restarts,
                        max_restarts=config.requeue.restart_limit, commits=Commits(before, now),
                        stalled=stalled, max_no_progress=config.requeue.max_no_progress))
                    if decision.action is Action.LEAVE:
                        log.error("%s at step %d: %s; the newest commit is step %s; exit %d", e,
                                  run.step, decision.why, now, decision.code)
                        raise SystemExit(decision.code) from None
                    restarts, stalled, before = restarts + 1, decision.stalled, now
                    # One line per loss: what was lost, where, what is redone, why it goes on.
                    log.warning("%s at step %d: the worker groups are recreated and the loop "
                                "resumes from step %s, %d step(s) to redo (restart %d: %s)", e,
                                run.step, now, redo, restarts, decision.why)
    finally:
        _SUPERVISED.reset(token)
        set_role(role)


# The last RayRun built in this context (``supervise_loop`` reads its budget and its step).
_LAST_RUN: contextvars.ContextVar[Any] = contextvars.ContextVar("kr_ray_run", default=None)
