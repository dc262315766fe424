"""Python's cyclic garbage collector held off over a short stretch of the training thread.

A checkpoint save allocates tens of thousands of small objects (DCP's plans and metadata, one
set per tensor). In a process holding torch's and its compiler's object graphs, those
allocations trigger full collections that each walk millions of objects: 0.25 s of a 2 s
emergency save of 1400 tensors was the collector (bench/shutdown_bench.py). Reference counting
still frees everything acyclic; the cycles wait until the stretch is over.
"""

from __future__ import annotations

import gc
import threading
from contextlib import contextmanager
from typing import Iterator

__all__ = ["gc_paused"]

_lock = threading.Lock()
_holders = 0            # stretches in progress (any thread)
_was_enabled = False    # the collector's state before the first of them


@contextmanager
def gc_paused() -> Iterator[None]:
    """The collector off for the ``with`` block, then as it was (nested and concurrent blocks
    count: it comes back on when the last one ends, if it was on before the first)."""
    global _holders, _was_enabled
    with _lock:
        if _holders == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0 and _was_enabled:
                gc.enable()
