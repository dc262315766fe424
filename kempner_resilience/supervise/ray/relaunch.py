"""The Ray backend of the one supervisor: a training group whose actor died comes back.

A dead actor's call fails with no code, so its ending is the one the rank recorded
(``supervise/endings.py``). ``supervise`` acts on ``decide``: a new group from the newest
commit, a requeue of the SLURM job without the dead nodes (``bad-nodes.json``), or leave.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import Any, Callable, Collection, Sequence

from kempner_resilience.config import ResilienceConfig
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.runpaths import RunPaths
from kempner_resilience.exitcodes import after_requeue
from kempner_resilience.supervise.ray.actor import ActorEnding, actor_died, actor_ends, ending_of
from kempner_resilience.supervise.ray.parking import Parking, reborn
from kempner_resilience.slurm.badnodes import record_bad_nodes
from kempner_resilience.slurm.env import short_host
from kempner_resilience.supervise.channel import newest_commit
from kempner_resilience.supervise.endings import endings_since
from kempner_resilience.supervise.policy import (Action, Commits, Decision, Evidence, Kind,
                                                 RankEnd, decide, reusable)

__all__ = ["supervise", "actor_ends", "lost_nodes", "group_decision", "group_evidence",
           "recreates"]

log = get_logger(__name__)

# How long a lost actor's silent node may take to be declared dead by Ray (its health check:
# by default 5 failures 3 s apart, each with a 10 s timeout, after a 5 s initial delay).
_NODE_DEATH_WAIT_S = 90.0
_POLL_S = 1.0


def supervise(driver: Any, make_actor: Callable[[], Any], world_size: int,
              train: Callable[[Any, int], Any], config: ResilienceConfig, *,
              cancel: Sequence[Any] = (), on_group: Callable[[int, list[Any]], None] | None = None,
              backend: str = "gloo", warm: bool = False) -> list[Any]:
    """Run the training group in ``driver`` until the policy says leave; the last
    incarnation's results, or ``SystemExit`` with the job's code. ``make_actor()`` creates a
    ``TrainingActor`` (with no arguments when ``warm``); ``train(actor, rank)`` starts its call
    (an ``ActorEnding``, alone or under ``"ending"``); ``on_group(incarnation, actors)`` sees
    each group. ``warm``: a new group takes back the actors whose call ended on a live node,
    reborn (``parking.py``)."""
    import ray

    paths = RunPaths.from_config(config)
    restarts, stalled = 0, 0
    bad_nodes: set[str] = set()
    with contextlib.closing(Parking()) as parking:
        while True:
            actors = reborn(parking.take("group", world_size), b"",
                            lambda a: a.kr_rebirth.remote())
            actors += [make_actor() for _ in range(world_size - len(actors))]
            driver.track(*actors)
            addr, port = driver.get([actors[0].kr_address.remote()])[0]
            driver.get([a.kr_setup.remote(r, world_size, addr, port, config, driver.board,
                                          backend) for r, a in enumerate(actors)])
            nodes = driver.get([a.node_id.remote() for a in actors])
            if on_group is not None:
                on_group(restarts, actors)
            before, known = newest_commit(paths), set(paths.all_endings())
            outcomes, killed = driver.wait_group([train(a, r) for r, a in enumerate(actors)],
                                                 actors, cancel=cancel,
                                                 bound=config.rescue.budget_s + 30.0)
            ends = actor_ends(outcomes, killed, driver_stopping=driver.request is not None,
                              recorded=endings_since(paths, known, range(world_size)))
            lost = lost_nodes(outcomes, killed, nodes)
            decision, dead = group_decision(ends, config, nodes=nodes, lost=lost,
                                            alive=_alive_nodes(ray, lost), bad=bad_nodes,
                                            restarts=restarts, stalled=stalled,
                                            commits=Commits(before, newest_commit(paths)))
            bad_nodes |= dead
            said = [f"{e.code} ({type(o).__name__})" if isinstance(o, BaseException)
                    else str(e.code) for o, e in zip(outcomes, ends)]  # the error's name
            log.warning("group %d ended %s: %s, exit %d (%s)", restarts, said,
                        decision.action.value, decision.code, decision.why)
            if dead:    # the run's bad-node record (``slurm/badnodes.py``) keeps them out
                hosts = _hostnames(ray, dead)
                try:
                    record_bad_nodes(paths, hosts, reason="a Ray node died under a training "
                                     "actor", job_id=os.environ.get("SLURM_JOB_ID"))
                except OSError as e:    # the memory is lost, never the checkpoint
                    log.warning("could not record bad nodes %s: %s", sorted(hosts), e)
            if not recreates(decision):
                code = decision.code
                if decision.action is Action.REQUEUE:   # another allocation, no dead nodes
                    # A requeue refused or failed says so, as the driver's own stop does.
                    code = after_requeue(code, driver.requeue(
                        decision.why, exclude=_hostnames(ray, bad_nodes)))
                driver.finish(cancel)
                if code != 0:
                    raise SystemExit(code)
                return outcomes
            driver.untrack(*actors)
            # Taken back: those the policy lets (``reusable``) whose run ended them (not
            # their own error), that do not leave on Ray's SIGTERM, on a node not found dead.
            kept = [a for a, out, end, node in zip(actors, outcomes, ends, nodes)
                    if warm and reusable(end) and node not in bad_nodes
                    and isinstance(ending_of(out), ActorEnding) and not ending_of(out).leaves]
            parking.keep("group", actors, kept, b"")
            restarts, stalled = restarts + 1, decision.stalled


def group_evidence(ends: tuple[RankEnd, ...], config: ResilienceConfig, *, restarts: int,
                   stalled: int, commits: Commits, dead: frozenset[str] = frozenset(),
                   spares: int | None = None) -> Evidence:
    """The policy's evidence after one incarnation, with the config's budget and guard.
    ``dead``: the Ray nodes that died under an actor; ``spares``: the live nodes beside the
    group's (None when no node died: Ray places the new group)."""
    return Evidence(ends, restarts=restarts, max_restarts=config.requeue.restart_limit,
                    commits=commits, stalled=stalled,
                    max_no_progress=config.requeue.max_no_progress, implicated=dead,
                    spares=spares)


def lost_nodes(outcomes: Sequence[Any], killed: Sequence[int],
               nodes: Sequence[str]) -> frozenset[str]:
    """The Ray nodes of the actors whose process is gone, not killed by the driver: whatever
    the rank recorded, its node may have died after."""
    return frozenset(nodes[r] for r, out in enumerate(outcomes)
                     if r not in killed and actor_died(out))


def group_decision(ends: tuple[RankEnd, ...], config: ResilienceConfig, *,
                   nodes: Sequence[str], lost: Collection[str], alive: Collection[str],
                   bad: Collection[str] = frozenset(), restarts: int, stalled: int,
                   commits: Commits) -> tuple[Decision, frozenset[str]]:
    """The policy's answer after one incarnation, and the Ray nodes newly found dead: a lost
    actor's node (``lost_nodes``) that Ray no longer holds ``alive``, not ``bad`` before.
    ``nodes[r]``: rank ``r``'s node."""
    dead = frozenset(lost - set(alive) - set(bad))
    spares = len(set(alive) - set(nodes) - set(bad) - dead) if dead else None
    return decide(group_evidence(ends, config, restarts=restarts, stalled=stalled,
                                 commits=commits, dead=dead, spares=spares)), dead


def recreates(d: Decision) -> bool:
    """A new group in this driver: a relaunch, or a requeue the actors asked for (Ray places
    them again); a spare node needs another allocation, which only SLURM can give."""
    return d.action is Action.RELAUNCH or (d.action is Action.REQUEUE
                                           and d.kind is Kind.REQUESTED)


def _alive_nodes(ray: Any, lost: Collection[str]) -> set[str]:
    """The Ray nodes alive once the lost actors' nodes have settled.

    A node that just died is only "unavailable" until its health check fails enough, and Ray
    would place a new actor there: a lost actor's node whose raylet does not answer is waited
    on until Ray marks it dead (bounded). One that answers is alive (an OOM kill, a SIGKILL)."""
    until = time.monotonic() + _NODE_DEATH_WAIT_S
    while True:
        info = {n["NodeID"]: n for n in ray.nodes()}
        dead = {n for n in lost if not info.get(n, {}).get("Alive")}
        silent = [n for n in set(lost) - dead if not _answers(info[n])]
        if not silent or time.monotonic() > until:
            return {n for n, node in info.items() if node.get("Alive")}
        log.warning("%d node(s) of lost actors do not answer: waiting for Ray to mark them "
                    "dead before a new group is placed", len(silent))
        time.sleep(_POLL_S)


def _answers(node: dict[str, Any]) -> bool:
    """Whether the node's raylet accepts a connection (a dead node's does not)."""
    try:
        with socket.create_connection((node["NodeManagerAddress"],
                                       int(node["NodeManagerPort"])), timeout=2.0):
            return True
    except (OSError, KeyError, ValueError):
        return False


def _hostnames(ray: Any, node_ids: set[str]) -> set[str]:
    """The host names of Ray nodes (SLURM's node names: short host names)."""
    return {short_host(str(n.get("NodeManagerHostname", ""))) for n in ray.nodes()
            if n.get("NodeID") in node_ids} - {""}
