"""The variables the supervisor channel replaced, still read when set by hand (deprecated).

A user's glue may still set them (docs/goodput.md documented two): they are read when no
channel says otherwise, with one warning per variable and process. The library sets none.
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from kempner_resilience.core.log import get_logger

__all__ = ["RESTART_COUNT_ENV", "IN_JOB_RESTART_ENV", "RELAUNCH_START_ENV", "RENDEZVOUS_ENV",
           "restarts_by_hand", "relaunch_by_hand", "rendezvous_by_hand"]

log = get_logger(__name__)

#: The restart count (deprecated: ``Channel.begin_launch``); the launchers still set it for the
#: user's script, as SLURM sets ``SLURM_RESTART_COUNT``.
RESTART_COUNT_ENV = "KEMPNER_RESTART_COUNT"
#: The relaunch in place's index (deprecated: ``Channel.begin_relaunch``).
IN_JOB_RESTART_ENV = "KEMPNER_RESILIENCE_IN_JOB_RESTART"
#: When the relaunch in place was launched, epoch seconds (deprecated: the same).
RELAUNCH_START_ENV = "KEMPNER_RESILIENCE_RELAUNCH_START"
#: A torchrun agent's rendezvous, JSON (deprecated: ``Channel.offer_rendezvous``).
RENDEZVOUS_ENV = "KEMPNER_RESILIENCE_RELAUNCH"

_warned: set[str] = set()


def _warn_once(name: str, value: str, replacement: str, read_as: str = "") -> None:
    if name not in _warned:
        _warned.add(name)
        log.warning("$%s=%s read%s: deprecated, a supervisor tells its ranks %s through its "
                    "channel ($KEMPNER_RESILIENCE_SUPERVISOR) now", name, value[:200], read_as,
                    replacement)


def restarts_by_hand(environ: Mapping[str, str] | None = None) -> int | None:
    """The restart count from the deprecated variable; None when unset or not a count."""
    value = (os.environ if environ is None else environ).get(RESTART_COUNT_ENV)
    if not (value and value.isdigit()):
        return None
    _warn_once(RESTART_COUNT_ENV, value, "their restart count", " as this run's restart count")
    return int(value)


def relaunch_by_hand(environ: Mapping[str, str] | None = None
                     ) -> tuple[int, float | None] | None:
    """``(index, launched at)`` from the deprecated variables; None without a valid index."""
    env = os.environ if environ is None else environ
    raw = env.get(IN_JOB_RESTART_ENV, "")
    if not (raw.isdigit() and len(raw) < 10):
        return None
    _warn_once(IN_JOB_RESTART_ENV, raw, "the relaunch in place")
    start: float | None = None
    raw_t = env.get(RELAUNCH_START_ENV, "")
    if raw_t:
        _warn_once(RELAUNCH_START_ENV, raw_t, "when the relaunch was launched")
        try:
            start = float(raw_t)
        except ValueError:
            start = None
    return int(raw), start


def rendezvous_by_hand(environ: Mapping[str, str] | None = None) -> dict[str, Any] | None:
    """The torchrun rendezvous from the deprecated variable (None: unset or not JSON)."""
    raw = (os.environ if environ is None else environ).get(RENDEZVOUS_ENV)
    if not raw:
        return None
    _warn_once(RENDEZVOUS_ENV, raw, "the torchrun agents' rendezvous")
    try:
        data = json.loads(raw)
    except ValueError as e:
        log.warning("ignoring $%s=%r (%s): failures requeue the job", RENDEZVOUS_ENV, raw, e)
        return None
    return data if isinstance(data, dict) else None
