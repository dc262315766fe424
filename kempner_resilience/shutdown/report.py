"""The run report: what happened, as JSON, for launchers (``$KEMPNER_RESILIENCE_REPORT``)."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from kempner_resilience.fileio import write_atomic
from kempner_resilience.log import get_logger
from kempner_resilience.shutdown.outcome import Ending

if TYPE_CHECKING:
    from kempner_resilience.shutdown.sequence import RunParts

__all__ = ["REPORT_ENV", "write_report"]

REPORT_ENV = "KEMPNER_RESILIENCE_REPORT"

log = get_logger(__name__)


def write_report(parts: "RunParts", code: int) -> None:
    """Rank 0 writes the report atomically; nothing happens without the variable."""
    path = os.environ.get(REPORT_ENV)
    if not path or parts.rank != 0:
        return
    o, info = parts.outcome, parts.last_saved
    stopped = o is not None and o.ending in (Ending.SIGNAL, Ending.SAVES_FAILING)
    report = {"exit_code": code, "start_step": parts.start_step, "step": parts.step,
              "stop_step": o.step if stopped else None,
              "resumed_from": None if parts.resumed_from is None else int(
                  parts.resumed_from.step),
              "saved_step": None if info is None else int(info.step),
              "saved_path": None if info is None else str(info.path),
              "timings": parts.timings, "world_size": parts.agreement.world_size}
    try:
        # Whole for the launcher that reads it once we are gone; not fsynced (about 15 ms of
        # the shutdown's budget): a crash of the machine ends that launcher too.
        write_atomic(path, json.dumps(report), durable=False)
    except OSError as e:
        log.warning("could not write the run report %s: %s", path, e)
