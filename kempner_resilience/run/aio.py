"""asyncio runner: a shutdown signal cancels the main task so that every ``finally`` runs.

``asyncio.run`` leaves SIGTERM to its default action (the process dies, no ``finally`` runs) and
turns SIGINT into a KeyboardInterrupt at an arbitrary point. ``loop.add_signal_handler`` would
take over the process-wide wakeup fd that our signal thread needs. So the ShutdownHandler's
thread cancels the main task through ``call_soon_threadsafe``: the cancellation travels down
through every ``asyncio.TaskGroup``, each task's cleanup runs, bounded by the shutdown deadline,
and a second SIGINT/SIGTERM still forces the exit.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any, Awaitable, Callable, Coroutine

from kempner_resilience.config import ResilienceConfig, SignalsConfig, load_config
from kempner_resilience.exitcodes import Ending, Facts, exit_code
from kempner_resilience.core.log import get_logger
from kempner_resilience.stop.signals import ShutdownHandler, ShutdownRequest

__all__ = ["run"]

log = get_logger(__name__)


def run(main: Coroutine[Any, Any, Any] | Callable[[], Awaitable[Any]],
        config: ResilienceConfig | SignalsConfig | None = None, *,
        debug: bool | None = None) -> Any:
    """Run ``main`` to completion and return its result.

    On the first shutdown signal the main task is cancelled (its TaskGroups cancel their
    children, whose ``finally`` blocks run); the process then raises ``SystemExit`` with 130 for
    SIGINT, 143 for SIGTERM, ``STOPPED`` otherwise. Must be called on the main thread.
    """
    if config is None:
        config = load_config()
    signals = config.signals if isinstance(config, ResilienceConfig) else config
    signals.validate()  # built or changed in Python: NaN or out-of-range graces -> ConfigError
    coro = main() if not inspect.iscoroutine(main) else main
    handler = ShutdownHandler(signals)
    loop = asyncio.new_event_loop()
    if debug is not None:
        loop.set_debug(debug)
    with handler:
        try:
            asyncio.set_event_loop(loop)
            task = loop.create_task(coro)
            handler.add_listener(lambda req: loop.call_soon_threadsafe(_cancel, task, req))
            try:
                return loop.run_until_complete(task)
            except asyncio.CancelledError:
                req = handler.request
                if req is None:
                    raise
                code = int(exit_code(Facts(Ending.SIGNAL, signum=req.signum)))
                log.warning("%s: main task cancelled and cleaned up; exiting with %d", req.name,
                            code)
                raise SystemExit(code) from None
        finally:
            # What asyncio.run does on the way out: no orphan task is left un-cancelled.
            try:
                _cancel_all_tasks(loop)
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())
            finally:
                asyncio.set_event_loop(None)
                loop.close()


def _cancel_all_tasks(loop: asyncio.AbstractEventLoop) -> None:
    pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
    for t in pending:
        t.cancel()
    if pending:
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))


def _cancel(task: asyncio.Task, req: ShutdownRequest) -> None:
    if not task.done():
        log.warning("%s received: cancelling the main task", req.name)
        task.cancel(msg=f"{req.name} received")
