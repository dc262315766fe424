"""Where a shutdown's time went, step by step, for the ledger's ``exit`` event.

The steps are those of ``sequence.stop``: ``agree_s`` (this rank's signal until every rank
agreed on the stop step and the sequence began), ``save_s`` (the emergency checkpoint, committed
and durable), ``requeue_s`` (rank 0's decision, ``scontrol requeue``, every rank told),
``teardown_s`` (cleanups, drained saves, process group), and ``shutdown_s``: signal → this event,
written after all of them. What is left is leaving the process (``leave``: ``exit`` ends it with
``os._exit`` once the user's atexit handlers ran; ``raise`` hands a ``SystemExit`` to the
caller); ``bench/shutdown_bench.py`` times it from outside, up to the process being gone.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

from kempner_resilience.config import ExitMode
from kempner_resilience.stop.signals import ShutdownRequest

__all__ = ["STEP_FIELDS", "shutdown_times"]

# Ledger field → the key in the run's timings (also in the run report's "timings").
STEP_FIELDS = {"agree_s": "agree_s", "save_s": "emergency_save_s", "requeue_s": "requeue_s",
               "teardown_s": "teardown_s"}


def shutdown_times(timings: Mapping[str, float], request: ShutdownRequest | None,
                   mode: ExitMode | None) -> dict[str, Any]:
    """The ``exit`` event's timing fields; a step that did not run is left out, and ``leave``
    when ``mode`` is None (a completed run: the caller's code goes on)."""
    out: dict[str, Any] = {k: round(timings[key], 4) for k, key in STEP_FIELDS.items()
                           if timings.get(key) is not None}
    if request is not None:
        out["signal_t"] = round(request.received_wall, 3)
        out["shutdown_s"] = round(max(time.monotonic() - request.received_at, 0.0), 4)
    if mode is not None:
        out["leave"] = mode.value
    return out
