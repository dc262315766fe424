"""The Ray backend's reading of a training group's endings, and what the one policy makes of it.

``ray_supervise`` turns each training call's outcome (an ``ActorEnding``, or the error Ray
raised for it) into the ranks' endings, and the config's budget and guard into the policy's
``Evidence``; ``decide`` is the policy's own (its table is tests/test_supervise_policy.py).
tests/test_ray.py runs the same paths on a real Ray; this pins each answer, without Ray.
"""

from __future__ import annotations

from kempner_resilience.config import load_config
from kempner_resilience.core.runpaths import RunPaths
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.supervise.ray.actor import ActorEnding
from kempner_resilience.supervise.ray.relaunch import (actor_ends, group_decision,
                                                           group_evidence, lost_nodes, recreates)
from kempner_resilience.supervise.endings import RankEnding, endings_since, note_ending
from kempner_resilience.supervise.policy import Action, Commits, Guard, decide


class RayActorError(Exception):
    """Ray's error for a call whose actor process is gone (matched by name, as Ray's is)."""


class ActorDiedError(RayActorError):
    pass


class RayTaskError(Exception):
    """Ray's error for a call whose method raised."""


CFG = load_config(overrides=["requeue.max_restarts=3", "requeue.max_no_progress=2"])


def _decide(outcomes, *, restarts=0, stalled=0, commits=Commits(10, 14), stopping=False,
            dead=frozenset(), spares=None):
    ends = actor_ends(outcomes, (), driver_stopping=stopping)
    return decide(group_evidence(ends, CFG, restarts=restarts, stalled=stalled,
                                 commits=commits, dead=dead, spares=spares))


def test_a_group_stopped_by_a_sigterm_the_driver_did_not_send_asks_to_run_again_and_comes_back():
    d = _decide([ActorEnding(143), {"ending": ActorEnding(143)}])
    assert (d.action, d.code) == (Action.REQUEUE, int(ExitCode.REQUEUE))
    assert recreates(d)


def test_a_sigterm_from_the_driver_is_the_drivers_stop_and_nothing_comes_back():
    d = _decide([ActorEnding(143, signum=15, from_driver=True)] * 2, stopping=True)
    assert (d.action, d.code) == (Action.LEAVE, 143)
    assert not recreates(d)


def test_a_dead_actor_beside_its_rescuing_survivor_is_relaunched_with_peer_lost():
    d = _decide([ActorEnding(int(ExitCode.PEER_LOST)), ActorDiedError("killed")])
    assert (d.action, d.code) == (Action.RELAUNCH, int(ExitCode.PEER_LOST))
    assert recreates(d)


def test_a_training_error_ends_the_job_with_its_code_whatever_the_survivor_says():
    d = _decide([ActorEnding(int(ExitCode.PEER_LOST)), RayTaskError("ValueError")])
    assert (d.action, d.code) == (Action.LEAVE, int(ExitCode.ERROR))
    assert not recreates(d)


def test_the_restart_budget_of_the_config_ends_the_relaunches():
    d = _decide([ActorEnding(int(ExitCode.PEER_LOST)), ActorDiedError("killed")], restarts=3)
    assert (d.action, d.guard, d.code) == (Action.LEAVE, Guard.BUDGET, int(ExitCode.PEER_LOST))


def test_a_group_that_never_commits_anything_newer_stops_with_no_requeue():
    d = _decide([ActorEnding(int(ExitCode.PEER_LOST)), ActorDiedError("killed")], restarts=2,
                stalled=1, commits=Commits(14, 14))
    assert (d.action, d.guard, d.code) == (Action.LEAVE, Guard.NO_PROGRESS,
                                           int(ExitCode.NO_REQUEUE))


def test_a_dead_node_with_no_live_node_beside_the_group_goes_back_to_the_scheduler():
    d = _decide([ActorEnding(int(ExitCode.PEER_LOST)), ActorDiedError("node gone")],
                dead=frozenset({"node-b"}), spares=0)
    assert (d.action, d.guard) == (Action.REQUEUE, Guard.NO_SPARE)
    assert not recreates(d)      # another allocation: the driver leaves with the code


def test_a_dead_actor_that_recorded_its_hang_ends_42_but_an_earlier_groups_words_are_not_read(
        tmp_path):
    paths = RunPaths(tmp_path / "run")
    note_ending(paths, "earlier", RankEnding(1, "error", 1, 5))      # the last incarnation's
    known = set(paths.all_endings())
    note_ending(paths, "this", RankEnding(0, "hang", int(ExitCode.HANG), 9))
    ends = actor_ends([ActorDiedError("gone"), ActorDiedError("gone")], (),
                      driver_stopping=False, recorded=endings_since(paths, known, range(2)))
    assert [e.code for e in ends] == [int(ExitCode.HANG), 137]


def test_a_node_that_died_under_an_actor_is_kept_out_even_if_the_actor_recorded_81_before():
    outcomes = [ActorEnding(int(ExitCode.PEER_LOST)), ActorDiedError("node gone")]
    recorded = {1: RankEnding(1, "peer-lost", int(ExitCode.PEER_LOST), 9)}
    ends = actor_ends(outcomes, (), driver_stopping=False, recorded=recorded)
    d, dead = group_decision(ends, CFG, nodes=["node-a", "node-b"],
                             lost=lost_nodes(outcomes, (), ["node-a", "node-b"]),
                             alive={"node-a"}, restarts=0, stalled=0, commits=Commits(10, 14))
    assert dead == {"node-b"}
    assert (d.action, d.guard) == (Action.REQUEUE, Guard.NO_SPARE)


# ----- the actor-loop shape's actor side, in process (the group itself: tests/test_ray.py)

def test_a_training_actor_whose_group_the_driver_did_not_form_is_told_how_to_form_it():
    import pytest

    import kempner_resilience.ray as krr

    class Trainer(krr.TrainingActor):
        pass

    with pytest.raises(RuntimeError, match=r"driver\.run_group"):
        with Trainer().resilient_run(state={}):
            pass


def test_the_driver_gets_a_methods_result_with_how_the_actors_run_ended():
    import kempner_resilience.ray as krr

    class Trainer(krr.TrainingActor):
        def train(self, steps, *, scale=1):
            return steps * scale

    out = Trainer().kr_call("train", (3,), {"scale": 2})
    assert out["result"] == 6
    assert out["ending"].code == 0
    assert actor_ends([out], (), driver_stopping=False)[0].code == 0


def test_the_earlier_shapes_init_group_still_forms_the_group_and_warns(monkeypatch):
    import socket

    import pytest
    import torch.distributed as dist

    from kempner_resilience.core.log import set_role
    from kempner_resilience.supervise.ray.actor import TrainingActor

    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    role = set_role("test")
    try:
        with pytest.warns(DeprecationWarning, match="run_group"):
            TrainingActor().init_group(0, 1, "127.0.0.1", port)
        assert dist.is_initialized() and dist.get_world_size() == 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        set_role(role)
