"""Relaunch in place under torchrun: is there a standby agent to take a failed node's place?

With spare nodes every node runs a torchrun agent; the first N train, the others wait in the
c10d rendezvous's *redundancy list*. After a committed rescue, the survivors' agents restart
their workers in a new round that a standby joins: no requeue. Whether a standby waits is a
fact of torch's rendezvous state, in its store. Rank 0 reads it here before it chooses
between leaving the relaunch to the agents and requeueing the job.

The agent offers the rendezvous and its restarts left in its channel
(``Channel.offer_rendezvous``); rank 0 reads them with ``supervise/rank.offered_relaunch``.
"""

from __future__ import annotations

import pickle
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

from kempner_resilience.core.log import get_logger

__all__ = ["Relaunch", "live_standbys", "standbys_in"]

log = get_logger(__name__)


@dataclass(frozen=True)
class Relaunch:
    """What a worker knows about the in-job relaunch its agent would do."""

    endpoint: str          # the c10d rendezvous store, host:port
    run_id: str            # torchrun's --rdzv-id
    restarts_left: int     # the agent's in-job restarts left (torchrun --max-restarts budget)
    stale_s: float         # a heartbeat older than this: the agent is gone (keep-alive window)

    def fields(self) -> dict[str, Any]:
        """What the agent's channel keeps of it (``Channel.offer_rendezvous``)."""
        return asdict(self)


def standbys_in(state: Any, stale_s: float, now: datetime | None = None) -> list[str]:
    """Host names of the agents waiting outside the current round (torch's redundancy and wait
    lists) whose heartbeat is fresh: the nodes a relaunch can take."""
    now = now or datetime.now(timezone.utc)
    beats = getattr(state, "last_heartbeats", {}) or {}
    waiting = set(getattr(state, "redundancy_list", ()) or ()) | \
        set(getattr(state, "wait_list", ()) or ())
    fresh = []
    for node in waiting:
        beat = beats.get(node)
        if beat is not None and now - beat <= timedelta(seconds=stale_s):
            fresh.append(str(getattr(node, "addr", node)))
    return sorted(fresh)


#: How long an empty answer is re-read before it is believed (``live_standbys``).
SETTLE_S = 2.0
_POLL_S = 0.1


def live_standbys(relaunch: Relaunch, timeout_s: float = 5.0,
                  settle_s: float = SETTLE_S) -> list[str] | None:
    """The standby agents in the rendezvous now (host names), or None when its store cannot be
    read within ``timeout_s`` (the rendezvous host is gone: a relaunch is impossible).

    An empty answer is read again for up to ``settle_s``: torch moves a standby from the
    redundancy list to the wait list (once the failed node's agent left the round) in two
    writes, and between them the standby is in neither list and has no heartbeat. The
    survivors' agents ask at that very moment (the failed node's agent leaves as they
    decide): a survivor read the gap on a loaded CI runner and ended the job with 81 instead
    of relaunching on the standby."""
    try:
        from torch.distributed import TCPStore
        from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import \
            C10dRendezvousBackend

        host, _, port = relaunch.endpoint.rpartition(":")
        store = TCPStore(host, int(port), is_master=False,
                         timeout=timedelta(seconds=timeout_s), wait_for_workers=False)
        backend = C10dRendezvousBackend(store, relaunch.run_id)
        end = time.monotonic() + settle_s
        while True:
            got = backend.get_state()
            # torch's own record of the rendezvous (pickled by its dynamic rendezvous handler,
            # in the job's own store): what its agents read themselves.
            found = [] if got is None else standbys_in(pickle.loads(got[0]), relaunch.stale_s)
            if found or time.monotonic() >= end:
                return found
            time.sleep(_POLL_S)
    except Exception as e:   # the store's host died, a torch without these names, a timeout
        log.warning("could not read the torchrun rendezvous at %s (%s)", relaunch.endpoint, e)
        return None
