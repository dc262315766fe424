"""Is there a standby agent to take a failed node's place (a relaunch in place under torchrun)?

Agents past ``--nnodes`` wait in the c10d rendezvous's redundancy list; rank 0 reads torch's
rendezvous state in its store here (the offer: ``supervise/rank.offered_relaunch``).
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from kempner_resilience.core.log import get_logger

__all__ = ["Relaunch", "live_standbys"]

log = get_logger(__name__)

#: How long an empty answer is re-read before it is believed (``live_standbys``).
SETTLE_S = 2.0


@dataclass(frozen=True)
class Relaunch:
    """What a worker knows about the in-job relaunch its agent would do."""

    endpoint: str          # the c10d rendezvous store, host:port
    run_id: str            # torchrun's --rdzv-id
    restarts_left: int     # the agent's in-job restarts left (torchrun --max-restarts budget)
    stale_s: float         # a heartbeat older than this: the agent is gone (keep-alive window)


def live_standbys(relaunch: Relaunch, timeout_s: float = 5.0,
                  settle_s: float = SETTLE_S) -> list[str] | None:
    """The standby agents in the rendezvous now (host names), or None when its store cannot be
    read within ``timeout_s`` (the rendezvous host is gone).

    An empty answer is read again for up to ``settle_s``: torch moves a standby from the
    redundancy list to the wait list in two writes, and the survivors may ask between them
    (a loaded CI runner did, and ended the job with 81 instead of relaunching)."""
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
            got = backend.get_state()    # torch's own record, pickled by its rendezvous handler
            state = None if got is None else pickle.loads(got[0])
            now = datetime.now(timezone.utc)
            # The agents in torch's redundancy and wait lists with a fresh heartbeat.
            beats = getattr(state, "last_heartbeats", {}) or {}
            waiting = {n for key in ("redundancy_list", "wait_list")
                       for n in getattr(state, key, ()) or ()}
            found = sorted(str(getattr(n, "addr", n)) for n in waiting if beats.get(n) is not None
                           and now - beats[n] <= timedelta(seconds=relaunch.stale_s))
            if found or time.monotonic() >= end:
                return found
            time.sleep(0.1)
    except Exception as e:   # the store's host died, a torch without these names, a timeout
        log.warning("could not read the torchrun rendezvous at %s (%s)", relaunch.endpoint, e)
        return None
