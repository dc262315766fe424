"""An asyncio Ray actor's work: one main task whose stop cancels everything under it.

``kempner_resilience.run.aio.run`` covers a plain asyncio script, whose main thread owns the
loop. In a Ray asyncio actor Ray owns the loop, in a thread of its own, and the method calls are
the tasks; what goes wrong there (SkyRL's leaked sandboxes) is the same two things:

* a stop that is not a cancellation: the work must end by ``CancelledError`` travelling down
  through every task, so each resource's ``finally`` runs. The driver's
  ``ray.cancel(ref, force=False)`` cancels the method's task; ``AsyncActor.stop()`` does the
  same from another call;
* ``asyncio.gather`` leaves the siblings of a failed task running (and their resources held)
  after the caller is gone. ``supervise`` runs the work as one ``asyncio.TaskGroup``: the first
  failure cancels the siblings, waits for their ``finally``, then raises.

Ray's SIGTERM handler runs on the worker's main thread, not the loop's, and the loop's thread
cannot install one; a SIGTERM sent to an asyncio actor itself is not covered yet (docs/ray.md).
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Coroutine, Iterable

from kempner_resilience.core.log import get_logger

__all__ = ["supervise", "AsyncActor"]

log = get_logger(__name__)


async def supervise(coros: Iterable[Coroutine[Any, Any, Any]]) -> list[Any]:
    """Run ``coros`` as one task group and return their results in order.

    One that raises cancels the others; a cancellation of the caller cancels them all; either
    way every ``finally`` has run when this returns or raises (an ``ExceptionGroup`` for
    failures, as ``asyncio.TaskGroup``).
    """
    tasks: list[asyncio.Task[Any]] = []
    try:
        async with asyncio.TaskGroup() as group:
            for coro in coros:
                tasks.append(group.create_task(coro))
    except asyncio.CancelledError:
        log.warning("cancelled: %d tasks cancelled and cleaned up", len(tasks))
        raise
    except BaseExceptionGroup as eg:
        log.error("%d of %d tasks failed; the others were cancelled and cleaned up",
                  len(eg.exceptions), len(tasks))
        raise
    return [t.result() for t in tasks]


class AsyncActor:
    """Mixin for a Ray asyncio actor: ``main(aw)`` runs a method's work as a stoppable main
    task, ``stop()`` (another call) cancels every running main task and waits for their
    cleanup. ``ray.cancel(ref, force=False)`` on the method's ref has the same effect.

    >>> @ray.remote
    ... class Rollout(AsyncActor):
    ...     async def run(self, n):
    ...         return await self.main(supervise(episode(i) for i in range(n)))
    """

    _mains: "set[asyncio.Task[Any]]"

    async def main(self, aw: Awaitable[Any]) -> Any:
        """Await ``aw`` as a task of its own that ``stop()`` cancels."""
        if not hasattr(self, "_mains"):
            self._mains = set()
        task = asyncio.ensure_future(aw)
        self._mains.add(task)
        try:
            return await task
        finally:
            # This method cancelled (ray.cancel) while ``task`` lives: cancel it and wait, so no
            # work outlives the call that owned it.
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
