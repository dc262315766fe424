"""The stop board: how a Ray driver's stop reaches every actor, on any node.

A driver's signal never reaches its actors, and Ray cannot interrupt a running task without
force. The board is a tiny asyncio actor: ``set(signum)`` once, and every ``wait()`` returns
it. A watcher thread in each training actor sends that signal to its own process, so its
ResilientRun stops as usual, even while its main thread waits in a collective.
"""

from __future__ import annotations

import functools
import os
import signal
import threading
from typing import Any

from kempner_resilience.core.log import get_logger
from kempner_resilience.stop.signals import active_handlers

__all__ = ["create_board", "BoardWatcher"]

log = get_logger(__name__)


class _StopBoard:
    """The board's body (made a Ray actor class by ``create_board``)."""

    def __init__(self) -> None:
        import asyncio

        self._event = asyncio.Event()
        self._signum = 0

    async def set(self, signum: int) -> int:
        """Post the stop; the first number wins (later posts are the same stop)."""
        if not self._event.is_set():
            self._signum = int(signum)
            self._event.set()
        return self._signum

    async def wait(self) -> int:
        """Block until the stop is posted, then return its signal number."""
        await self._event.wait()
        return self._signum


@functools.cache
def _board_class() -> Any:
    import ray

    # max_concurrency: every actor's wait() is a pending coroutine; a set() must not queue
    # behind them.
    return ray.remote(num_cpus=0, max_concurrency=1000)(_StopBoard)


def create_board() -> Any:
    """A new stop board actor (no CPU reserved: it must start even on a full cluster)."""
    return _board_class().remote()


class BoardWatcher:
    """In a training actor: a thread that waits on the board and signals its own process.

    The signal waits for a ShutdownHandler in this process (a ResilientRun entered): before
    it, a SIGINT is a KeyboardInterrupt anywhere. It is not sent when the run has a request of
    its own (Ray's or the node's SIGTERM): a second signal could force the process out
    without its checkpoint.
    """

    def __init__(self, board: Any, poll_s: float = 0.1) -> None:
        self.board = board
        self.poll_s = poll_s
        self.signum: int | None = None      # what the board said, once it did
        self.delivered = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="kempner-ray-board", daemon=True)

    def start(self) -> "BoardWatcher":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._done.set()
        self._thread.join(timeout=2.0)

    def _watch(self) -> None:
        import ray

        try:
            ref = self.board.wait.remote()
            while not self._done.is_set():
                if ray.wait([ref], timeout=self.poll_s)[0]:
                    self.signum = int(ray.get(ref))
                    break
            while self.signum and not self._done.is_set():
                handlers = active_handlers()
                if handlers:
                    if not any(h.requested() for h in handlers):
                        log.warning("the driver asks to stop (%s): stopping at the next step "
                                    "boundary", signal.Signals(self.signum).name)
                        os.kill(os.getpid(), self.signum)
                    self.delivered = True
                    return
                self._done.wait(self.poll_s)
        except Exception as e:   # the board gone (driver died): the actor's own signals remain
            if not self._done.is_set():
                log.warning("stop board unreachable: %s", e)
