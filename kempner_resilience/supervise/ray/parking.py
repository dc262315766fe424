"""Warm actors between a driver's group incarnations (``supervise_loop``).

A new actor is a new process (seconds of imports), so a lost group's live actors are parked and
the next group of the same class and options takes them back, reborn (``kr_rebirth``);
``spares`` are parked from the start. Trust is the policy's ``reusable``: one whose call did not
end (its communicator untrusted) is killed, as is one whose rebirth fails or overruns.
docs/ray.md, "The driver-loop shape (SkyRL's trainer)".
"""

from __future__ import annotations

import contextlib
import contextvars
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Iterator, Sequence

from kempner_resilience.core.log import get_logger
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.supervise.policy import KILLED, RankEnd, reusable
from kempner_resilience.supervise.ray.actor import actor_died, call_error, kill_actors

__all__ = ["Parking", "Parked", "current_parking", "parking_for", "signature"]

log = get_logger(__name__)

#: How long a rebirth (or a spare's creation) may take before a new process replaces the
#: actor. NCCL's teardown with a dead peer is what could hold it.
REBIRTH_S = 60.0
#: How long a lost group's calls still running get to end before their actors are killed.
SETTLE_S = 5.0


@dataclass
class Parked:
    """A parked actor, the ``signature`` of its object's arguments, and whether it is
    ``fresh`` (a spare, never in a group)."""

    actor: Any
    signature: bytes
    fresh: bool


class Parking:
    """The actors kept warm across ``supervise_loop``'s runs of the driver's function."""

    def __init__(self) -> None:
        self._parked: dict[Hashable, list[Parked]] = {}
        self._closed = False

    def park(self, key: Hashable, actors: Sequence[Any], signature: bytes, *,
             fresh: bool = False) -> None:
        if self._closed:         # the supervised loop is over: nothing waits for them
            kill_actors(actors)
            return
        self._parked.setdefault(key, []).extend(Parked(a, signature, fresh) for a in actors)

    def keep(self, key: Hashable, actors: Sequence[Any], kept: Sequence[Any],
             signature: bytes) -> None:
        """Park ``kept`` under ``key`` and kill the rest of ``actors``."""
        kill_actors([a for a in actors if all(a is not k for k in kept)])
        self.park(key, kept, signature)

    def take(self, key: Hashable, n: int) -> list[Parked]:
        """At most ``n`` actors parked under ``key``, spares last (survivors first)."""
        entries = sorted(self._parked.get(key, []), key=lambda p: p.fresh)
        taken, self._parked[key] = entries[:n], entries[n:]
        return taken

    def count(self, key: Hashable, *, fresh: bool) -> int:
        return sum(p.fresh == fresh for p in self._parked.get(key, []))

    def close(self) -> None:
        """Kill every parked actor (the supervised loop is over)."""
        self._closed = True
        actors = [p.actor for entries in self._parked.values() for p in entries]
        self._parked.clear()
        kill_actors(actors)


_PARKING: contextvars.ContextVar[Parking | None] = contextvars.ContextVar("kr_ray_parking",
                                                                         default=None)


def current_parking() -> Parking | None:
    """The parking of the ``supervise_loop`` running now; None outside one (cold groups)."""
    return _PARKING.get()


@contextlib.contextmanager
def parking_for() -> Iterator[Parking]:
    """``with parking_for():`` the actors of lost groups are parked until the block ends,
    then killed with the ones still parked."""
    parking = Parking()
    token = _PARKING.set(parking)
    try:
        yield parking
    finally:
        _PARKING.reset(token)
        parking.close()


def signature(args: Sequence[Any], kwargs: dict[str, Any]) -> bytes:
    """What an actor's object was built with, to compare (b"" when it cannot be pickled)."""
    try:
        return pickle.dumps((tuple(args), kwargs))
    except Exception:
        return b""


def settled(actors: Sequence[Any], refs: Sequence[Any], bound_s: float = SETTLE_S) -> list[Any]:
    """The actors the policy lets serve again (``reusable``), once their calls ``refs`` (one
    per actor, or none) had ``bound_s`` to end: one still running counts as hung, one whose
    process is gone as killed."""
    import ray

    if not refs:
        return list(actors)
    ray.wait(list(refs), num_returns=len(refs), timeout=bound_s)
    return [actor for actor, ref in zip(actors, refs) if reusable(_end_of(ray, ref))]


def _end_of(ray: Any, ref: Any) -> RankEnd:
    if not ray.wait([ref], timeout=0)[0]:
        return RankEnd(int(ExitCode.HANG), by_supervisor=True)
    error = call_error(ref)
    if error is not None:
        return KILLED if actor_died(error) else RankEnd(int(ExitCode.PEER_LOST))
    return RankEnd(0)


def reborn(taken: Sequence[Parked], mine: bytes, rebirth: Callable[[Any], Any],
           bound_s: float = REBIRTH_S) -> list[Any]:
    """The taken actors ready for a new group: a spare built with the same arguments as is,
    any other reborn (``rebirth(actor)`` starts its call). Those that fail or overrun
    ``bound_s`` are killed."""
    import ray

    if not taken:
        return []
    calls = [p.actor.kr_pid.remote() if p.fresh and p.signature == mine and mine
             else rebirth(p.actor) for p in taken]
    ray.wait(calls, num_returns=len(calls), timeout=bound_s)
    ready, dropped = [], []
    for p, ref in zip(taken, calls):
        error = call_error(ref)     # not done, failed, or its process gone
        if error is None:
            ready.append(p.actor)
        else:
            log.warning("a parked actor could not be reused (%s): a new one replaces it",
                        type(error).__name__)
            dropped.append(p.actor)
    kill_actors(dropped)
    return ready
