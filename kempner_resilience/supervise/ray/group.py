"""A worker group: passive Ray actors (a policy, a critic, a reference model) that a driver's
loop calls, as SkyRL's, verl's and OpenRLHF's groups are; an entry of the driver's run state
(``checkpoint/delegated.py``). Calls wait in short ``ray.wait`` slices, so the driver's
handlers run between them, up to ``watchdog.hang_timeout_s``. An actor gone or silent raises
``GroupLost``, a lost peer whose policy recreates the group (``run/ray_run.py``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from kempner_resilience.config import ResilienceConfig
from kempner_resilience.core.faults import first_line, is_peer_failure
from kempner_resilience.core.log import get_logger
from kempner_resilience.supervise.ray.actor import (TrainingActor, actor_died, call_error,
                                                    kill_actors)
from kempner_resilience.supervise.ray.parking import (Parking, current_parking, reborn, settled,
                                                      signature)

__all__ = ["WorkerGroup", "Worker", "GroupLost"]

log = get_logger(__name__)

_POLL_S = 0.1
# How long a rank whose collective failed waits for the peer that caused it to be seen gone.
_CAUSE_WAIT_S = 5.0


class GroupLost(RuntimeError):
    """An actor of a worker group is gone or silent: the group cannot go on."""

    # A lost peer to the run that waits on it (core/faults.is_peer_failure), not a bug.
    peer_failure = True

    def __init__(self, group: str, rank: int, why: str) -> None:
        super().__init__(f"{group} rank {rank} {why}")
        self.group = group
        self.rank = rank
        self.why = why


class Worker:
    """Mixin for a worker group's actor class: the library forms its group (initialized
    before any call) and saves it. Example: docs/ray.md."""

    kr_config: ResilienceConfig | None = None
    kr_rank: int = 0
    kr_world_size: int = 1

    def checkpoint_state(self) -> Mapping[str, Any]:
        """What this actor's part of a checkpoint holds, as a run's ``state=``."""
        raise NotImplementedError(f"{type(self).__name__}.checkpoint_state(): return the "
                                  "actor's state, e.g. {'model': self.model, 'optim': self.optim}")

    kr_address = TrainingActor.kr_address
    kr_setup = TrainingActor.kr_setup
    kr_pid = TrainingActor.kr_pid
    kr_rebirth = TrainingActor.kr_rebirth

    def _kr_state(self) -> Any:
        from kempner_resilience.checkpoint.state import TrainState

        state = self.__dict__.get("_kr_train_state")
        if state is None:
            state = TrainState(self.checkpoint_state())
            self.__dict__["_kr_train_state"] = state
        return state

    def kr_save(self, directory: str, step: int) -> dict[str, Any]:
        """Write this actor's state of ``step`` (collective); the file table for the manifest."""
        from kempner_resilience.checkpoint.partsave import save_part

        return save_part(self._kr_state(), Path(directory), step, self.kr_rank)

    def kr_load(self, directory: str, manifest: dict[str, Any]) -> int | None:
        """Load this actor's state from ``directory`` (collective over the group)."""
        from kempner_resilience.checkpoint.partsave import load_part

        return load_part(self._kr_state(), Path(directory), manifest, self.kr_rank,
                         self.kr_world_size)


class WorkerGroup:
    """``world_size`` actors of ``actor_cls`` (a ``Worker``) in one process group, formed and
    re-formed by the run that holds it in its state. ``options`` go to Ray's ``.options``.
    Under ``supervise_loop``: ``warm`` (default) brings a lost group back with its live
    actors, reborn in their processes; ``spares`` actors are made ahead of need to take a
    dead one's rank (each holds its resources while it waits). See ``parking.py``."""

    def __init__(self, actor_cls: Any, world_size: int, *args: Any, backend: str = "gloo",
                 options: Mapping[str, Any] | None = None, spares: int = 0, warm: bool = True,
                 **kwargs: Any) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if spares < 0:
            raise ValueError(f"spares must be >= 0, got {spares}")
        self.spares = spares
        self.warm = warm
        self._inflight: list[Any] = []   # the refs of the call under way, one per actor
        self._parking: Parking | None = None
        self.actor_cls = actor_cls
        self.world_size = world_size
        self.args, self.kwargs = args, kwargs
        self.backend = backend
        self.options = dict(options or {})
        self.name = "group"
        self.actors: list[Any] = []
        self.bound_s = 600.0

    def start(self, name: str, config: ResilienceConfig) -> None:
        """Create the actors and form their group (the run does, on entry); a started group
        is stopped first. Under ``supervise_loop`` parked actors come back first, reborn."""
        import ray

        self.stop()
        self.name = name
        self.bound_s = float(config.watchdog.hang_timeout_s)
        cls = self.actor_cls if hasattr(self.actor_cls, "remote") else ray.remote(self.actor_cls)
        make = cls.options(**{"num_cpus": 1, **self.options})
        # Kept for ``release``, which the run's teardown may call from a thread of its own,
        # where the supervised loop's context is not.
        self._parking = parking = current_parking() if self.warm else None
        key, mine = self._key(), signature(self.args, self.kwargs)
        taken = parking.take(key, self.world_size) if parking is not None else []
        warm = reborn(taken, mine, lambda a: a.kr_rebirth.remote(self.args, self.kwargs))
        if warm:
            log.info("%s group: %d of %d actors warm (parked, not new processes)", name,
                     len(warm), self.world_size)
        self.actors = warm + [make.remote(*self.args, **self.kwargs)
                              for _ in range(self.world_size - len(warm))]
        addr, port = self._wait([self.actors[0].kr_address.remote()])[0]
        self._wait([a.kr_setup.remote(r, self.world_size, addr, port, config,
                                      backend=self.backend, name=name)
                    for r, a in enumerate(self.actors)])
        log.info("%s group formed: %d actors (%s)", name, self.world_size, self.backend)
        if parking is not None:     # the spares, made now, ready by the next loss
            missing = self.spares - parking.count(key, fresh=True)
            parking.park(key, [make.remote(*self.args, **self.kwargs)
                               for _ in range(max(0, missing))], mine, fresh=True)

    def stop(self) -> None:
        """Kill every actor of the group (their processes go; a new ``start`` makes new ones)."""
        kill_actors(self.actors)
        self.actors = []
        self._inflight = []

    def release(self) -> None:
        """The run is over: under ``supervise_loop`` the trusted actors (their call ended,
        their process lives) are parked for the next incarnation, the others killed;
        elsewhere every actor is killed."""
        if self._parking is None or not self.actors:
            self.stop()
            return
        self._parking.keep(self._key(), self.actors, settled(self.actors, self._inflight),
                           signature(self.args, self.kwargs))
        self.actors, self._inflight = [], []

    def _key(self) -> tuple[int, str]:
        # Only an actor of the same class with the same options (resources, placement) can
        # take a rank: options by their repr, so an unhashable one compares too.
        return id(self.actor_cls), repr(sorted(self.options.items()))

    def call(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every actor; their results in rank order (bounded)."""
        return self._wait([getattr(a, method).remote(*args, **kwargs) for a in self.actors])

    def call_each(self, method: str, per_rank: Sequence[Any]) -> list[Any]:
        """Call ``method`` on actor ``r`` with ``per_rank[r]`` (its shard of a batch)."""
        if len(per_rank) != self.world_size:
            raise ValueError(f"{self.name}: {len(per_rank)} shards for {self.world_size} actors")
        return self._wait([getattr(a, method).remote(x) for a, x in zip(self.actors, per_rank)])

    def save_into(self, directory: Path, step: int) -> dict[str, Any]:
        """Each actor writes its state into ``directory``; their file tables, merged."""
        tables = self._wait([a.kr_save.remote(str(directory), step) for a in self.actors])
        return {name: entry for table in tables for name, entry in table.items()}

    def load_from(self, directory: Path, manifest: Mapping[str, Any]) -> None:
        """Each actor loads its state from ``directory`` (a committed step's part)."""
        self._wait([a.kr_load.remote(str(directory), dict(manifest)) for a in self.actors])

    def _wait(self, refs: list[Any]) -> list[Any]:
        """Every ref's result, in rank order, waiting in short slices up to the bound."""
        import ray

        if not refs:
            raise GroupLost(self.name, 0, "has no actors (the group was not started)")
        until = time.monotonic() + self.bound_s
        pending = list(refs)
        # A call of the whole group: what a lost group's release waits on before it trusts
        # an actor again (kr_address's single call is rank 0's, and ends at once).
        self._inflight = list(refs) if len(refs) == len(self.actors) else []
        while pending:
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=_POLL_S)
            for ref in done:
                self._raise_if_failed(ref, refs)
            if pending and time.monotonic() > until:
                raise GroupLost(self.name, refs.index(pending[0]), f"did not answer within "
                                f"{self.bound_s:.0f} s (watchdog.hang_timeout_s)")
        self._inflight = []
        return [ray.get(r) for r in refs]

    def _raise_if_failed(self, ref: Any, refs: list[Any]) -> None:
        import ray

        e = call_error(ref)
        if e is None:
            return
        rank, why = refs.index(ref), _why_gone(e)
        if why:
            raise GroupLost(self.name, rank, why) from None
        if not (isinstance(e, ray.exceptions.RayTaskError) and is_peer_failure(e)):
            raise e   # the actor's own code raised: its error
        # A survivor's collective failed because a peer went: the group is lost, and the peer
        # that went is named when Ray reports it within a few seconds.
        ray.wait(refs, num_returns=len(refs), timeout=_CAUSE_WAIT_S)
        for r, other in enumerate(refs):
            if why := _why_gone(call_error(other)):
                raise GroupLost(self.name, r, why) from None
        raise GroupLost(self.name, rank, f"lost a peer ({first_line(e)})") from None


def _why_gone(error: BaseException | None) -> str | None:
    """"is gone (...)" for a call whose actor's process is gone (killed, evicted by Ray's
    SIGTERM handler, its node lost); None for the call's own error."""
    import ray

    if isinstance(error, ray.exceptions.RayTaskError):
        return f"is gone ({first_line(error)})" if actor_died(error) else None
    if isinstance(error, (ray.exceptions.RayActorError, ray.exceptions.TaskCancelledError)):
        return f"is gone ({type(error).__name__})"
    return None
