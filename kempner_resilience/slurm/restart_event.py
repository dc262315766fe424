"""The ledger's ``restart`` event: what the in-job relaunch glue writes when it starts the
training again inside the allocation (the fields: ``kempner_resilience.core.ledger``). The
relaunched training learns which relaunch it is from its supervisor channel
(``supervise/channel.Channel.begin_relaunch``), not from here."""

from __future__ import annotations

import os
from typing import Any, Iterable

from kempner_resilience.core.ledger import Ledger, read_ledger
from kempner_resilience.core.runpaths import RunPaths

__all__ = ["record_restart", "ledger_so_far", "last_rescue", "num"]


def num(value: Any) -> float | None:
    """A ledger field as seconds or a time; None when it is not a number."""
    return float(value) if isinstance(value, (int, float)) else None


def record_restart(where: RunPaths | str | os.PathLike[str], *, relaunch: int, reason: str,
                   bad_nodes: Iterable[str] = (), spare: str | None = None,
                   step: int | None = None, failure_t: float | None = None,
                   detect_s: float | None = None, rescue_s: float | None = None,
                   relaunch_s: float | None = None, attempt: int = 0,
                   run_id: str | None = None) -> dict[str, Any] | None:
    """Append the ``restart`` event of an in-job restart to the run's ledger (the glue's
    side; see the module docstring for the fields). ``where``: the run's ``RunPaths``, or its
    directory (this function is documented for users' own glue). ``attempt``: SLURM's restart
    count. Never raises; returns the event written (None: the ledger is off)."""
    led = Ledger(RunPaths.of(where).ledger, run_id=run_id, attempt=attempt,
                 relaunch=relaunch, only=("restart",))
    try:
        led.event("restart", reason=reason, bad_nodes=",".join(sorted(set(bad_nodes))),
                  spare=spare, step=step,
                  failure_t=None if failure_t is None else round(failure_t, 3),
                  **{k: None if v is None else round(max(v, 0.0), 4) for k, v in
                     (("detect_s", detect_s), ("rescue_s", rescue_s),
                      ("relaunch_s", relaunch_s))})
        return led.last_event
    finally:
        led.close()


def ledger_so_far(paths: RunPaths) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The run's ledger events, and the ``attempt`` and ``run_id`` (the newest it holds) that
    the glue's ``record_restart`` carries."""
    events = read_ledger(paths.ledger) if paths.ledger.exists() else []
    return events, {"attempt": max((int(e.get("attempt", 0)) for e in events), default=0),
                    "run_id": next((e.get("run_id") for e in reversed(events)
                                    if e.get("run_id")), None)}


def last_rescue(events: list[dict[str, Any]], since: float) -> tuple[float | None, float | None]:
    """When the newest ``rescue`` event at or after ``since`` was written (its end) and its
    ``seconds``; None for what is unknown."""
    rescue = next((e for e in reversed(events) if e.get("ev") == "rescue"
                   and (num(e.get("t")) or 0.0) >= since), None)
    return (None, None) if rescue is None else (num(rescue.get("t")), num(rescue.get("seconds")))
