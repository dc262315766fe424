"""The parking's one piece without Ray (supervise/ray/parking.py): the signature a spare is
compared by. What a new group takes from the parking, and that an untrusted actor is never
reused, are tested on a real Ray in tests/test_ray_warm.py and tests/test_ray_loop.py."""

from __future__ import annotations

from kempner_resilience.supervise.ray.parking import signature


def test_the_signature_of_arguments_that_cannot_be_pickled_matches_nothing():
    assert signature((1, "x"), {"k": 2}) == signature((1, "x"), {"k": 2})
    assert signature((lambda: 0,), {}) == b""
