"""Teardown: LIFO cleanups, each bounded in time and isolated from the others' failures.

A cleanup that hangs (a logger flushing to a dead server, an executor waiting on a stuck task)
must not keep the job from exiting, so each one runs in a daemon thread joined with a timeout and
is abandoned, with a log line, when it does not finish. The process leaves with ``os._exit``
afterwards anyway, so an abandoned thread cannot hold it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from kempner_resilience.core.log import get_logger

__all__ = ["CleanupResult", "TeardownStack", "destroy_process_group", "cuda_synchronize"]

log = get_logger(__name__)


@dataclass(frozen=True)
class CleanupResult:
    name: str
    ok: bool
    seconds: float
    error: str | None = None  # "timed out after N s" or the exception


@dataclass
class _Cleanup:
    fn: Callable[[], Any]
    name: str
    timeout_s: float | None


class TeardownStack:
    """Register cleanups with ``add``; ``run()`` calls them newest first, each at most its time."""

    def __init__(self, default_timeout_s: float = 10.0) -> None:
        self.default_timeout_s = default_timeout_s
        self._items: list[_Cleanup] = []
        self._lock = threading.Lock()
        self.results: list[CleanupResult] = []

    def add(self, fn: Callable[[], Any], *, name: str | None = None,
            timeout_s: float | None = None) -> Callable[[], Any]:
        """Register ``fn``; returns it so this can be used as a decorator."""
        with self._lock:
            self._items.append(_Cleanup(fn, name or getattr(fn, "__qualname__", repr(fn)),
                                        timeout_s))
        return fn

    def add_executor(self, executor: concurrent.futures.Executor, *, name: str | None = None,
                     timeout_s: float | None = None) -> concurrent.futures.Executor:
        """Shut ``executor`` down at teardown, cancelling queued work (running tasks are left)."""
        self.add(lambda: executor.shutdown(wait=True, cancel_futures=True),
                 name=name or f"executor {type(executor).__name__}", timeout_s=timeout_s)
        return executor

    def __len__(self) -> int:
        return len(self._items)

    def run(self, *, deadline: float | None = None) -> list[CleanupResult]:
        """Run every cleanup once, LIFO. ``deadline`` (monotonic) caps each one's time too."""
        with self._lock:
            items, self._items = self._items[::-1], []
        results = []
        for item in items:
            limit = item.timeout_s if item.timeout_s is not None else self.default_timeout_s
            if deadline is not None:
                limit = max(0.0, min(limit, deadline - time.monotonic()))
            results.append(_run_bounded(item, limit))
        self.results += results
        return results


def _run_bounded(item: _Cleanup, limit: float) -> CleanupResult:
    box: dict[str, BaseException] = {}

    def target() -> None:
        try:
            item.fn()
        except BaseException as e:  # isolate: one cleanup's failure must not stop the rest
            box["error"] = e

    t0 = time.monotonic()
    th = threading.Thread(target=target, name=f"kempner-cleanup-{item.name}", daemon=True)
    th.start()
    th.join(limit)
    took = time.monotonic() - t0
    if th.is_alive():
        log.error("cleanup %r did not finish within %.1f s: abandoned", item.name, limit)
        return CleanupResult(item.name, False, took, f"timed out after {limit:.1f} s")
    if "error" in box:
        log.error("cleanup %r failed after %.2f s: %r", item.name, took, box["error"])
        return CleanupResult(item.name, False, took, repr(box["error"]))
    log.info("cleanup %r done in %.3f s", item.name, took)
    return CleanupResult(item.name, True, took)


def cuda_synchronize() -> None:
    if "torch" not in sys.modules:
        return
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def destroy_process_group() -> None:
    if "torch.distributed" not in sys.modules:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def flush_logs() -> None:
    for h in logging.getLogger().handlers + logging.getLogger("kempner_resilience").handlers:
        try:
            h.flush()
        except Exception:
            pass
