"""A torchrun agent's view of a failed worker group, as the one policy's evidence.

The same rows the failure matrix feeds every backend (``tests/test_supervise_policy.py``), in
the agent's native terms: its node's workers' return codes by global rank (-N: killed by
signal N), whether the agent itself was signalled, torch's restarts left, and, with spares,
the standby agents waiting. The decision and the exit code are the policy's, never the glue's.
"""

from __future__ import annotations

import signal

import pytest

from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.supervise.torchrun.evidence import (PEER, agent_exit_code,
                                                             implicated_here, observe)
from kempner_resilience.supervise.policy import Action, decide

KILL = -int(signal.SIGKILL)


def _decide(codes, signalled=False, left=1, most=1, standbys=None, node=None):
    return decide(observe(codes, signalled=signalled, restarts_left=left, max_restarts=most,
                          standbys=standbys, node=node))


@pytest.mark.parametrize("codes,action,code", [
    ({0: 81, 1: KILL}, Action.RELAUNCH, ExitCode.PEER_LOST),  # a killed rank, the rescue ran
    ({0: 42, 1: 42}, Action.RELAUNCH, ExitCode.HANG),          # a hang, seen by its peers
    ({0: 81, 1: 1}, Action.LEAVE, ExitCode.ERROR),              # rank 1's own exception
    ({0: 0, 1: 81}, Action.LEAVE, ExitCode.ERROR),              # rank 0 left run.steps early
    ({0: 75, 1: 143}, Action.REQUEUE, ExitCode.REQUEUE),        # rank 0 requeued the job
    ({1: KILL}, Action.RELAUNCH, 128 + signal.SIGKILL),         # this node's worker killed
])
def test_the_agents_view_gets_the_policys_decision_and_code(codes, action, code):
    d = _decide(codes)
    assert (d.action, d.code) == (action, code), d
    assert agent_exit_code(codes) == code


def test_a_signal_at_the_agent_never_restarts_the_workers():
    d = _decide({0: 81, 1: 42}, signalled=True)
    assert d.action is Action.LEAVE and d.code == ExitCode.HANG, d


def test_with_spares_a_relaunch_in_place_needs_a_standby_for_the_node_that_failed():
    # A survivor's failure points at a peer's node, unnamed here; the implicated node itself
    # is named. Either way the next round needs one standby to take a place.
    assert observe({0: 81}, signalled=False, restarts_left=1, max_restarts=1,
                   standbys=0).implicated == frozenset({PEER})
    assert _decide({0: 81}, standbys=1).action is Action.RELAUNCH
    d = _decide({0: 81}, standbys=0)
    assert d.action is Action.REQUEUE and d.code == ExitCode.PEER_LOST, d
    assert _decide({1: KILL}, standbys=1, node="node1").action is Action.RELAUNCH
    assert _decide({1: KILL}, standbys=0, node="node1").action is Action.REQUEUE


def test_the_restart_budget_spent_leaves_with_the_workers_code():
    d = _decide({0: 81}, left=0, most=2)
    assert d.action is Action.LEAVE and d.code == ExitCode.PEER_LOST, d


def test_a_worker_killed_by_a_signal_of_its_own_implicates_its_node():
    assert "was killed" in implicated_here({2: KILL, 3: 81})
    assert implicated_here({2: -int(signal.SIGTERM)}) is None   # a stop, not a death
    assert implicated_here({2: 81, 3: 81}) is None


def test_a_worker_hung_with_the_gil_held_is_the_one_that_never_marked_its_hang():
    # Ranks 0 and 1 (another node) saw the hang in Python and marked it; ranks 2 and 3 on
    # this node ended with HANG too, unmarked: one of them was hung with the GIL held.
    assert "hung with the GIL held" in implicated_here({2: 42, 3: 42}, hang_seen={0, 1})
    assert implicated_here({0: 42, 1: 42}, hang_seen={0, 1}) is None
    # Without any mark (no supervisor channel), nothing singles a node out.
    assert implicated_here({2: 42, 3: 42}, hang_seen=()) is None


def test_ranks_the_agent_killed_at_its_deadline_count_as_hung():
    assert agent_exit_code({0: 0, 1: KILL}, killed={1}) == ExitCode.ERROR   # 0 left early
    assert agent_exit_code({0: 81, 1: KILL}, killed={1}) == ExitCode.PEER_LOST
