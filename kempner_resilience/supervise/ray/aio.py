"""An asyncio Ray actor's work: one main task whose stop cancels everything under it.

A stop must be a cancellation, so every ``finally`` runs. Ray's SIGTERM handler runs on the
main thread, where no actor code runs, then waits for tasks that never end: ``main()`` hooks
the exit it calls so the main tasks are cancelled first (docs/ray.md has the measurements).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import warnings
import weakref
from typing import Any, Awaitable, Coroutine, Iterable

from kempner_resilience.core.log import get_logger, label, set_role

__all__ = ["supervise_tasks", "supervise", "AsyncActor"]

log = get_logger(__name__)

# The AsyncActors of this process that ran a main task: a SIGTERM stops them all.
_ACTORS: "weakref.WeakSet[AsyncActor]" = weakref.WeakSet()
_MARGIN_S = 5.0


async def supervise_tasks(coros: Iterable[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Run ``coros`` as one task group and return their results in order. One that raises,
    or the caller's cancellation, cancels the others; every ``finally`` has run on return."""
    # A TaskGroup, not gather: gather leaves a failed task's siblings running.
    tasks: list[asyncio.Task[Any]] = []
    try:
        async with asyncio.TaskGroup() as group:
            tasks.extend(group.create_task(coro) for coro in coros)
    except asyncio.CancelledError:
        log.warning("cancelled: %d tasks cancelled and cleaned up", len(tasks))
        raise
    except BaseExceptionGroup as eg:
        log.error("%d of %d tasks failed; the others were cancelled and cleaned up",
                  len(eg.exceptions), len(tasks))
        raise
    return [t.result() for t in tasks]


async def supervise(coros: Iterable[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Deprecated name of ``supervise_tasks``."""
    warnings.warn("kempner_resilience.supervise.ray.aio.supervise is now supervise_tasks "
                  "(also kempner_resilience.ray.supervise_tasks)", DeprecationWarning,
                  stacklevel=2)
    return await supervise_tasks(coros)


class AsyncActor:
    """Mixin for a Ray asyncio actor: ``main(aw)`` runs a method's work as a stoppable main
    task; ``stop()`` or ``ray.cancel(ref, force=False)`` cancels it and waits for its cleanup
    (example: docs/ray.md)."""

    _mains: "set[asyncio.Task[Any]]"
    _loop: asyncio.AbstractEventLoop

    async def main(self, aw: Awaitable[Any]) -> Any:
        """Await ``aw`` as a task that ``stop()`` or a SIGTERM to this process cancels."""
        if not hasattr(self, "_mains"):
            self._mains = set()
            if label().startswith("rank "):    # not a rank: its lines say what it is
                set_role(f"{type(self).__name__} actor")
        self._loop = asyncio.get_running_loop()
        _ACTORS.add(self)
        _hook_ray_sigterm()
        task = asyncio.ensure_future(aw)
        self._mains.add(task)
        try:
            return await task
        finally:
            # Cancelled by ray.cancel: no work outlives the call that owned it.
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
            self._mains.discard(task)

    async def stop(self) -> int:
        """Cancel every running main task and wait for their ``finally``; how many there were."""
        tasks = [t for t in getattr(self, "_mains", ()) if not t.done()]
        for t in tasks:
            t.cancel(msg="stopped by the driver")
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        return len(tasks)


def _hook_ray_sigterm() -> None:
    """Make Ray's SIGTERM exit of this worker cancel the main tasks first."""
    try:
        import ray._private.worker as ray_worker
    except ImportError:    # not in a Ray worker: nothing to hook
        return
    original = getattr(ray_worker, "raise_sys_exit_with_custom_error_message", None)
    if original is None:
        log.warning("this Ray has no raise_sys_exit_with_custom_error_message: a SIGTERM to "
                    "this asyncio actor will not cancel its tasks")
        return
    if getattr(original, "_kr_stops_first", False):
        return

    def stop_then_exit(*args: Any, **kwargs: Any) -> Any:
        if threading.current_thread() is threading.main_thread():
            _stop_all_actors()
        return original(*args, **kwargs)

    stop_then_exit._kr_stops_first = True  # type: ignore[attr-defined]
    ray_worker.raise_sys_exit_with_custom_error_message = stop_then_exit


def _stop_all_actors() -> None:
    """From the main thread: cancel every actor's main tasks on its loop and wait, bounded."""
    from kempner_resilience.config import load_config

    bound = max(1.0, load_config().signals.grace_for("SIGTERM") - _MARGIN_S)
    futures = [asyncio.run_coroutine_threadsafe(a.stop(), a._loop) for a in list(_ACTORS)
               if getattr(a, "_loop", None) is not None and not a._loop.is_closed()]
    if not futures:
        return
    log.warning("SIGTERM: cancelling the asyncio actor's main tasks (up to %.0f s for their "
                "cleanup)", bound)
    done, pending = concurrent.futures.wait(futures, timeout=bound)
    stopped = sum(f.result() for f in done if f.exception() is None)
    if pending:
        log.error("SIGTERM: %d actor(s) still cleaning up after %.0f s; exiting anyway",
                  len(pending), bound)
    else:
        log.warning("SIGTERM: %d main task(s) cancelled and cleaned up", stopped)
