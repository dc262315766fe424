"""A rank's side of its supervisor's channel (``channel.py``): every read a training process
makes of it. Each question reads the environment when asked: a torchrun agent sets its
channel before each restart of its workers.
"""

from __future__ import annotations

import os
from typing import Iterable, Mapping

from kempner_resilience.core.log import get_logger
from kempner_resilience.supervise.channel import (CHANNEL_ENV, Channel, launch_name, relaunched,
                                                  report_now)
from kempner_resilience.supervise.legacy_env import (RESTART_COUNT_ENV, rendezvous_by_hand,
                                                     restarts_by_hand)
from kempner_resilience.supervise.torchrun.standby import Relaunch

__all__ = ["Channel", "supervisor", "has_supervisor", "supervisor_decides", "local_restart_count",
           "offered_relaunch", "restarts_said", "note_hang_seen", "note_ranks_died", "launch_name",
           "relaunched", "report_now", "RESTART_COUNT_ENV", "CHANNEL_ENV"]

log = get_logger(__name__)


def supervisor(environ: Mapping[str, str] | None = None) -> Channel | None:
    """The channel this rank's launcher gave it; None: no supervisor above the ranks."""
    return Channel.from_env(environ)


def has_supervisor(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a launcher gave this rank a channel (a supervisor, or a torchrun agent)."""
    return bool((os.environ if environ is None else environ).get(CHANNEL_ENV))


def supervisor_decides(environ: Mapping[str, str] | None = None) -> bool:
    """Whether a supervisor above the ranks decides whether the job runs again."""
    channel = Channel.from_env(environ)
    return channel is not None and channel.supervised


def restarts_said(environ: Mapping[str, str] | None = None) -> int | None:
    """How often the supervisor started the ranks before this launch (None: not said)."""
    channel = Channel.from_env(environ)
    return channel.restarts() if channel is not None else None


def local_restart_count(environ: Mapping[str, str] | None = None) -> int | None:
    """Restarts so far when a local supervisor relaunches us, as its channel says; None if
    unknown. ``KEMPNER_RESTART_COUNT`` set by hand is still read, with one deprecation warning."""
    said = restarts_said(environ)
    return said if said is not None else restarts_by_hand(environ)


def offered_relaunch(environ: Mapping[str, str] | None = None) -> Relaunch | None:
    """The relaunch this worker's torchrun agent offers; None: not under one, or no restart left."""
    channel = Channel.from_env(environ)
    data = channel.rendezvous() if channel is not None else None
    if data is None:
        data = rendezvous_by_hand(environ)
    if data is None:
        return None
    try:
        r = Relaunch(**data)
    except TypeError as e:
        log.warning("ignoring the offered relaunch %r (%s): failures requeue the job", data, e)
        return None
    return r if isinstance(r.restarts_left, int) and r.restarts_left > 0 else None


def note_hang_seen(rank: int) -> None:
    """Tell the supervisor that this rank's hang watchdog ran (a rank hung with the GIL held
    cannot, which singles its node out); nothing without a supervisor."""
    channel = Channel.from_env()
    if channel is not None:
        channel.note_hang_seen(launch_name(), rank)


def note_ranks_died(ranks: Iterable[int]) -> None:
    """Tell the supervisor which peer ranks this rank saw die without a word (a torchrun agent
    drops their node from its rendezvous at once)."""
    ranks = sorted(set(ranks))
    channel = Channel.from_env() if ranks else None
    if channel is not None:
        channel.note_ranks_died(launch_name(), ranks)
