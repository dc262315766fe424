"""The parking's bookkeeping (supervise/ray/parking.py), without Ray: which parked actors a new
group takes, and that nothing is parked once the supervised loop is over."""

from __future__ import annotations

from kempner_resilience.supervise.ray import parking as parking_mod
from kempner_resilience.supervise.ray.parking import Parking, parking_for, signature


def test_a_new_group_takes_the_survivors_before_the_spares_and_only_of_its_own_kind(monkeypatch):
    killed = []
    monkeypatch.setattr(parking_mod, "kill_actors", lambda actors: killed.extend(actors))
    p = Parking()
    p.park("policy", ["spare"], b"s", fresh=True)
    p.park("policy", ["survivor0", "survivor1"], b"s")
    p.park("ref", ["ref0"], b"r")
    taken = p.take("policy", 2)
    assert [t.actor for t in taken] == ["survivor0", "survivor1"]
    assert p.count("policy", fresh=True) == 1 and p.count("ref", fresh=False) == 1
    assert [t.actor for t in p.take("other", 2)] == []
    p.close()
    assert sorted(killed) == ["ref0", "spare"]


def test_actors_parked_after_the_supervised_loop_ended_are_killed_not_kept(monkeypatch):
    killed = []
    monkeypatch.setattr(parking_mod, "kill_actors", lambda actors: killed.extend(actors))
    with parking_for() as p:
        p.park("policy", ["a"], b"")
    assert killed == ["a"]
    p.park("policy", ["late"], b"")
    assert killed == ["a", "late"] and p.take("policy", 1) == []
    assert parking_mod.current_parking() is None


def test_the_signature_of_arguments_that_cannot_be_pickled_matches_nothing():
    assert signature((1, "x"), {"k": 2}) == signature((1, "x"), {"k": 2})
    assert signature((lambda: 0,), {}) == b""
