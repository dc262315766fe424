"""The run report: what happened, as JSON, for launchers (``$KEMPNER_RESILIENCE_REPORT``)."""

from __future__ import annotations

import json
import os
from typing import Any

from kempner_resilience.core.fileio import write_atomic
from kempner_resilience.core.ledger import REPORT_ENV
from kempner_resilience.core.log import get_logger
from kempner_resilience.exitcodes import Ending, Facts
from kempner_resilience.runstate import RunState

__all__ = ["REPORT_ENV", "write_report", "build_report", "report_path"]

log = get_logger(__name__)


def write_report(state: RunState, code: int, facts: Facts) -> None:
    """Rank 0 writes the report atomically; nothing happens without the variable."""
    path = report_path(state)
    if path is None:
        return
    report = build_report(state, code, facts)
    try:
        # Whole for the launcher that reads it once we are gone; not fsynced (about 15 ms of
        # the shutdown's budget): a crash of the machine ends that launcher too.
        write_atomic(path, json.dumps(report), durable=False)
    except OSError as e:
        log.warning("could not write the run report %s: %s", path, e)


def report_path(state: RunState) -> str | None:
    """Where this rank writes the report: rank 0, with the variable set; else None."""
    path = os.environ.get(REPORT_ENV)
    return path if path and state.rank == 0 else None


def build_report(state: RunState, code: int, facts: Facts) -> dict[str, Any]:
    """The report's content for an attempt that ends now with ``code``, as ``facts`` say."""
    parts, progress = state.parts, state.progress
    info = progress.last_saved
    stopped = facts.ending in (Ending.SIGNAL, Ending.SAVES_FAILING)
    return {"exit_code": code, "ending": facts.ending.value,
            "start_step": parts.start_step, "step": progress.step,
            "stop_step": facts.step if stopped else None,
            "resumed_from": None if parts.resumed_from is None else int(
                parts.resumed_from.step),
            "saved_step": None if info is None else int(info.step),
            "saved_path": None if info is None else str(info.path),
            "timings": progress.timings, "world_size": parts.agreement.world_size}
