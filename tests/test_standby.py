"""Is a standby agent waiting? Read from torch's own rendezvous state in a real TCPStore.

The relaunch in place with spares (torchrun template) asks this after every rescued failure:
the survivors' agents (relaunch, or end the job) and rank 0's worker (leave it to the agents, or
requeue). The state is torch's ``_RendezvousState``, written the way torch's c10d backend
writes it, into a real store on this machine.
"""

from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState

from kempner_resilience.supervise.torchrun.standby import Relaunch, live_standbys

TRAINING, LEAVING, STANDBY = (_NodeDesc(host, 1, 0) for host in ("node0", "node1", "node2"))


@pytest.fixture
def store():
    s = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                 timeout=timedelta(seconds=10))
    yield s


def _write(store: TCPStore, state: _RendezvousState) -> None:
    import pickle

    backend = C10dRendezvousBackend(store, "job")
    got = backend.get_state()
    backend.set_state(pickle.dumps(state), None if got is None else got[1])


def _state(*, participants, redundancy=(), waiting=(), beats=None) -> _RendezvousState:
    now = datetime.now(timezone.utc)
    s = _RendezvousState()
    s.complete = True
    s.participants = {n: i for i, n in enumerate(participants)}
    s.redundancy_list, s.wait_list = set(redundancy), set(waiting)
    s.last_heartbeats = {n: now for n in (*participants, *redundancy, *waiting)} \
        if beats is None else beats
    return s


def _relaunch(store: TCPStore) -> Relaunch:
    return Relaunch(endpoint=f"127.0.0.1:{store.port}", run_id="job", restarts_left=1,
                    stale_s=6.0)


def test_a_standby_in_torchs_redundancy_list_is_found(store):
    _write(store, _state(participants=[TRAINING, LEAVING], redundancy=[STANDBY]))
    assert live_standbys(_relaunch(store)) == ["node2"]


def test_a_standby_moving_from_the_redundancy_list_to_the_wait_list_is_still_found(store):
    # The failed node's agent left the round; torch's standby removes itself from the
    # redundancy list (its heartbeat goes with it) and adds itself to the wait list in a second
    # write. A survivor that reads in between must not conclude "no standby": it would end the
    # job instead of relaunching.
    _write(store, _state(participants=[TRAINING]))
    later = threading.Timer(0.5, _write, (store, _state(participants=[TRAINING],
                                                        waiting=[STANDBY])))
    later.start()
    try:
        assert live_standbys(_relaunch(store)) == ["node2"]
    finally:
        later.cancel()


def test_a_standby_whose_heartbeat_is_stale_is_not_counted(store):
    old = datetime.now(timezone.utc) - timedelta(seconds=60)
    now = datetime.now(timezone.utc)
    _write(store, _state(participants=[TRAINING], waiting=[STANDBY],
                         beats={TRAINING: now, STANDBY: old}))
    t0 = time.monotonic()
    assert live_standbys(_relaunch(store), settle_s=0.5) == []
    assert time.monotonic() - t0 < 5      # believed after the settle time, not the store's


def test_an_unreachable_rendezvous_store_is_none_not_an_empty_list():
    gone = Relaunch(endpoint="127.0.0.1:1", run_id="job", restarts_left=1, stale_s=6.0)
    assert live_standbys(gone, timeout_s=1.0) is None
