"""Our torch elastic classes: the agent torchrun runs, and its rendezvous handler with spares.

Subclasses, never attributes of torch's classes replaced; an object a torch function builds
becomes an instance of a subclass of its own class. Every private name is in
``core/torch_private.py``; a torch that lacks one keeps torch's behaviour, logged.
"""

from __future__ import annotations

import functools
import signal
import time
from dataclasses import dataclass, field
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, Collection, Mapping

from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.rendezvous import RendezvousParameters
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (DynamicRendezvousHandler,
                                                                     create_handler)

from kempner_resilience.core import torch_private
from kempner_resilience.core.log import get_logger
from kempner_resilience.supervise.torchrun.agent import AGENT_NAME, Agent, WarmWorkers, starting
from kempner_resilience.supervise.torchrun.spares import InPlace, restart_decision

__all__ = ["ElasticAgent", "SpareHandler", "spare_handler"]

log = get_logger("kempner_resilience.supervise.torchrun.wrapper")


class ElasticAgent(LocalElasticAgent):
    """torchrun's agent with our shutdown (``tracked``), the policy's restart decision (when
    this torch has the names) and spares (``inplace``). Built once ``elastic("shutdown")``
    resolved."""

    def __init__(self, spec: Any, logs_specs: Any, *, tracked: Agent, inplace: InPlace | None,
                 **kwargs: Any) -> None:
        super().__init__(spec=spec, logs_specs=logs_specs, **kwargs)
        self.tracked = tracked
        self.inplace = inplace
        self.shutdown_names = torch_private.elastic("shutdown")
        self.decides = torch_private.elastic("restarts") is not None \
            and not torch_private.instance_missing("restarts", self)
        torch_private.instance_missing("shutdown", self)   # logged: torch closes at once
        # Built on the main thread, before the rendezvous: the workers' zygote (or None).
        self.warm = WarmWorkers.for_spec(spec, tracked)

    def run(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().run(*args, **kwargs)
        finally:
            if self.warm is not None:    # its zygote ends (bounded); a standby stays
                self.warm.zygote.close()

    def _initialize_workers(self, worker_group: WorkerGroup) -> None:
        if self.inplace is not None:
            self.inplace.before_initialize(torch_private.remaining_restarts(self))
        super()._initialize_workers(worker_group)

    def _start_workers(self, worker_group: WorkerGroup) -> dict[int, Any]:
        if self.inplace is not None:
            self.inplace.before_start(worker_group.spec.rdzv_handler, worker_group.group_rank)
        with starting(self.tracked, self.shutdown_names,
                      None if self.warm is None else self.warm.handler):
            pids = super()._start_workers(worker_group)
        pcontext = getattr(self, "_pcontext", None)
        if pcontext is not None:
            # torch's process context closes every worker at the first failure (SIGTERM,
            # SIGKILL 30 s later): this one waits for our deadline first.
            pcontext.__class__ = _waiting(type(pcontext), self.tracked)
        ranks = {w.local_rank: w.global_rank for w in worker_group.workers}
        if self.inplace is not None:       # for the survivors of this node's death
            self.inplace.publish_ranks(worker_group.store, worker_group.group_rank,
                                       sorted(ranks.values()))
        self.tracked.name_ranks({int(pid): int(ranks[lr]) for lr, pid in pids.items()
                                 if lr in ranks})
        return pids

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result = super()._monitor_workers(worker_group)
        left = torch_private.remaining_restarts(self)
        if not self.decides or left <= 0 \
                or result.state not in (WorkerState.FAILED, WorkerState.UNHEALTHY):
            return result
        # This node's workers that ended: torch's failures, and those that exited 0 (torch
        # reports only failures; a rank that left early is part of the evidence).
        codes = self.tracked.codes()
        codes.update({int(r): int(getattr(f, "exitcode", 1))
                      for r, f in (result.failures or {}).items()})
        most = worker_group.spec.max_restarts
        if self.inplace is not None:
            ok, why = self.inplace.decide(codes, left, most)
        else:
            ok, why = restart_decision(codes, signalled=bool(self.tracked.signals),
                                       restarts_left=left, max_restarts=most)
        handler = worker_group.spec.rdzv_handler
        if ok and self.inplace is not None and isinstance(handler, SpareHandler):
            handler.notice_lost_peer(self.inplace.ranks_died(), self.inplace.node_ranks(
                worker_group.store, worker_group.group_world_size))
        log.warning("%s: workers failed with %s: %s", AGENT_NAME, codes,
                    f"relaunching in place ({why})" if ok else f"no relaunch in place: {why}")
        if not ok:
            torch_private.set_remaining_restarts(self, 0)   # torch stops them, returns FAILED
        return result


class SpareHandler(DynamicRendezvousHandler):
    """torch's dynamic rendezvous handler for an agent with spares (``spare_handler`` makes
    one, only when ``torch_private.elastic("spares")`` resolved)."""

    inplace: InPlace | None = None
    _names: dict[str, Any] | None = None

    def _take(self, inplace: InPlace) -> None:
        self.inplace = inplace
        self._names = torch_private.elastic("spares")
        if self._names is not None and not torch_private.instance_missing("spares", self):
            # torch built its executor in __init__: ours replaces it, same arguments.
            self._op_executor = _standby_executor(
                self._names["_DistributedRendezvousOpExecutor"])(
                self._this_node, self._state_holder, self._settings, self)
            holder = self._state_holder
            if torch_private.elastic("notice") is not None \
                    and not torch_private.instance_missing("notice", holder):
                holder.__class__ = _noticing_holder(type(holder))

    def notice_lost_peer(self, died: Callable[[], Collection[int]],
                         node_ranks: Mapping[int, Collection[int]]) -> None:
        """This node's workers lost a peer and the group relaunches in place: until the
        keep-alive window has passed once more, dead participants of the finished round are
        dropped early. Why: the next round opens only once every participant of the finished
        one left, and torch drops a dead node only after its keep-alive window (10-15 s). A
        participant all of whose ranks the survivors saw die goes at once; else one whose
        heartbeat is two intervals old (a live one beats every interval)."""
        holder = getattr(self, "_state_holder", None)
        if not hasattr(holder, "kr_notice"):      # _take made it so: _settings is there too
            return
        interval = self._settings.keep_alive_interval
        window = interval * self._settings.keep_alive_max_attempt
        stale = 2 * interval if 2 * interval < window else None   # else torch's is as short
        known = {int(g): frozenset(int(r) for r in ranks)
                 for g, ranks in node_ranks.items() if ranks}
        round_ = getattr(torch_private.rendezvous_state(self), "round", None)
        if stale is None and (not known or round_ is None):
            return
        holder.kr_notice = _Notice(self._this_node, stale, window,
                                   time.monotonic() + window.total_seconds() + 60.0,
                                   round_, known, died)

    def num_nodes_waiting(self) -> int:
        # torch calls it only from the monitor loop, with the worker group healthy.
        n = super().num_nodes_waiting()
        settings = getattr(self, "_settings", None)
        if self.inplace is None or getattr(settings, "min_nodes", None) \
                != getattr(settings, "max_nodes", 0):
            return n     # an elastic range (--nnodes=A:B): a waiting node may be a scale-up
        return self.inplace.nodes_waiting(n)

    def shutdown(self) -> bool:
        if self.inplace is None or not self.inplace.left or self._names is None:
            return super().shutdown()
        # torch closes the rendezvous when its agent ends: for the whole job, the survivors'
        # next round included. A node that leaves only takes itself out of the round.
        try:
            self._stop_heartbeats()
            self._op_executor.run(self._names["_RendezvousExitOp"](), time.monotonic() + 10.0)
        except Exception as e:    # its heartbeat goes stale instead: the round opens later
            log.warning("%s: could not leave the rendezvous (%s)", AGENT_NAME, e)
        return True


def _waiting(base: type, tracked: Agent) -> type:
    """``base`` (torch's process context class) whose ``close`` first lets every worker end on
    its own until the shutdown deadline, once a signal came or a worker exited
    (``Agent.wait_for_workers``); torch then closes what is left."""

    class WaitingContext(base):  # type: ignore[misc, valid-type]
        def close(self, death_sig: signal.Signals | None = None, timeout: int = 30) -> None:
            tracked.wait_for_workers()
            super().close(death_sig, timeout)

    WaitingContext.__name__ = WaitingContext.__qualname__ = f"Waiting{base.__name__}"
    return WaitingContext


@functools.lru_cache(maxsize=None)
def _standby_executor(base: type) -> type:
    """torch's distributed op executor (private, so subclassed only once resolved), telling
    its handler when torch adds the node to the redundancy list."""

    class StandbyExecutor(base):  # type: ignore[misc, valid-type]
        def __init__(self, node: Any, state_holder: Any, settings: Any,
                     handler: SpareHandler) -> None:
            super().__init__(node, state_holder, settings)
            self._handler = handler

        def _add_to_redundancy_list(self) -> None:
            if self._handler.inplace is not None:    # this node waits as a spare
                self._handler.inplace.stand_by()
            super()._add_to_redundancy_list()

    return StandbyExecutor


_LONG_AGO = datetime(1970, 1, 1, tzinfo=timezone.utc)


@dataclass
class _Notice:
    """What a survivor's state holder knows after its workers lost a peer (``stale`` None:
    torch's window is as short)."""

    node: Any
    stale: timedelta | None
    window: timedelta
    until: float
    round: int | None = None
    node_ranks: Mapping[int, frozenset[int]] = field(default_factory=dict)
    died: Callable[[], Collection[int]] | None = None
    said: set[Any] = field(default_factory=set)

    def expire(self, state: Any) -> None:
        """Mark a finished round's participant as dead (its heartbeat set long past) when the
        survivors named all its ranks, or its heartbeat is older than ``stale``: torch's
        sanitize, which runs next, removes it. Never this node."""
        if not getattr(state, "complete", False):
            return
        now = datetime.now(timezone.utc)
        beats = getattr(state, "last_heartbeats", {})
        named: set[int] | None = None
        # The ranks name the finished round's participants only: a later round's group
        # ranks are other nodes.
        finished = self.died is not None and getattr(state, "round", None) == self.round
        for node, group in list(getattr(state, "participants", {}).items()):
            beat = beats.get(node)
            if node == self.node or beat is None:
                continue
            ranks = self.node_ranks.get(group) if finished else None
            if ranks and named is None:
                try:
                    named = {int(r) for r in self.died()}        # type: ignore[misc]
                except Exception as e:   # an unreadable channel: the heartbeat rule alone
                    log.warning("%s: cannot read the ranks the workers saw die (%s)",
                                AGENT_NAME, e)
                    named = set()
            if ranks and ranks <= named:      # type: ignore[operator]
                self._drop(beats, node, f"the survivors' workers saw its rank(s) "
                           f"{_span(ranks)} die")
            elif self.stale is not None and now - beat > self.stale:
                self._drop(beats, node, f"its heartbeat is {(now - beat).total_seconds():.1f} "
                           "s old and this node's workers lost a peer")

    def _drop(self, beats: dict[Any, datetime], node: Any, why: str) -> None:
        beats[node] = _LONG_AGO
        if node not in self.said:
            self.said.add(node)
            log.warning("%s: rendezvous node %s is gone (%s): it leaves the rendezvous now, "
                        "not after torch's %.0f s", AGENT_NAME, node, why,
                        self.window.total_seconds())


def _span(ranks: Collection[int]) -> str:
    """``[2, 3]`` as ``2-3``, ``[5]`` as ``5``, other sets as a list."""
    r = sorted(ranks)
    if len(r) > 1 and r == list(range(r[0], r[-1] + 1)):
        return f"{r[0]}-{r[-1]}"
    return ", ".join(map(str, r))


@functools.lru_cache(maxsize=None)
def _noticing_holder(base: type) -> type:
    """torch's rendezvous state holder (private, so subclassed only once resolved) whose
    sanitize first applies the survivors' notice (``_Notice``) while it holds."""

    class NoticingStateHolder(base):  # type: ignore[misc, valid-type]
        kr_notice: _Notice | None = None

        def _sanitize(self) -> None:
            notice = self.kr_notice     # read once: the heartbeat thread sanitizes too
            if notice is not None and time.monotonic() > notice.until:
                self.kr_notice = notice = None
            if notice is not None:
                notice.expire(self._state)
            super()._sanitize()

    NoticingStateHolder.__name__ = NoticingStateHolder.__qualname__ = f"Noticing{base.__name__}"
    return NoticingStateHolder


def spare_handler(params: RendezvousParameters, inplace: InPlace) -> SpareHandler:
    """The c10d rendezvous handler torch's registry builds (``create_backend``, then
    ``create_handler``), made a ``SpareHandler``."""
    from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import create_backend

    backend, store = create_backend(params)
    handler = create_handler(store, backend, params)
    handler.__class__ = SpareHandler
    handler._take(inplace)
    return handler
