"""The Ray backend of the one supervisor: a training group whose actor died comes back.

A dead actor's call fails with ``RayActorError`` and no code, so its ending is the one the rank
recorded (``supervise/endings.py``); the survivors rescue and end with 81. ``supervise`` acts
on ``decide``: a new group from the newest commit, a requeue of the SLURM job without the dead
nodes (kept in the run's ``bad-nodes.json``), or leave with the code.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any, Callable, Collection, Sequence

from kempner_resilience.config import ResilienceConfig
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.runpaths import RunPaths
from kempner_resilience.supervise.ray.actor import actor_died as _actor_died
from kempner_resilience.supervise.ray.actor import actor_ends, kill_actors
from kempner_resilience.supervise.ray.parking import Parking, reborn
from kempner_resilience.slurm.badnodes import record_bad_nodes
from kempner_resilience.slurm.env import short_host
from kempner_resilience.supervise.channel import newest_commit
from kempner_resilience.supervise.endings import endings_since
from kempner_resilience.supervise.policy import (Action, Commits, Decision, Evidence, Kind,
                                                 RankEnd, decide, reusable)

__all__ = ["supervise", "actor_ends", "lost_nodes", "group_decision", "group_evidence", "recreates"]

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
    incarnation's results. ``make_actor()`` creates one ``TrainingActor`` (built with no
    arguments when ``warm``); ``train(actor, rank)`` starts its call (returning an
    ``ActorEnding``, alone or under ``"ending"``); ``on_group(incarnation, actors)`` sees each
    new group. ``warm``: a recreated group takes back the old one's actors whose call ended
    on a live node, reborn (``parking.py``). Raises ``SystemExit`` with the job's code when
    the job does not complete."""
    parking = Parking()
    try:
        return _supervise(driver, make_actor, world_size, train, config, cancel, on_group,
                          backend, parking if warm else None)
    finally:
        parking.close()


def _supervise(driver: Any, make_actor: Callable[[], Any], world_size: int,
               train: Callable[[Any, int], Any], config: ResilienceConfig,
               cancel: Sequence[Any], on_group: Callable[[int, list[Any]], None] | None,
               backend: str, parking: Parking | None) -> list[Any]:
    import ray

    paths = RunPaths.from_config(config)
    restarts, stalled = 0, 0
    bad_nodes: set[str] = set()
    while True:
        warm = []
        if parking is not None:
            warm = reborn(parking.take("group", world_size), b"", lambda a: a.kr_rebirth.remote())
        actors = warm + [make_actor() for _ in range(world_size - len(warm))]
        driver.track(*actors)
        addr, port = driver.get([actors[0].kr_address.remote()])[0]
        driver.get([a.kr_setup.remote(r, world_size, addr, port, config, driver.board, backend)
                    for r, a in enumerate(actors)])
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
        said = [f"{e.code} ({type(o).__name__})" if isinstance(o, BaseException) else str(e.code)
                for o, e in zip(outcomes, ends)]     # the error's name when a call raised
        log.warning("group %d ended %s: %s, exit %d (%s)", restarts, said,
                    decision.action.value, decision.code, decision.why)
        if dead:    # the run's bad-node record (``slurm/badnodes.py``): a requeue keeps them out
            hosts = _hostnames(ray, dead)
            try:
                record_bad_nodes(paths, hosts, reason="a Ray node died under a training actor",
                                 job_id=os.environ.get("SLURM_JOB_ID"))
            except OSError as e:    # the memory is lost, never the checkpoint
                log.warning("could not record bad nodes %s: %s", sorted(hosts), e)
        if not recreates(decision):
            if decision.action is Action.REQUEUE:   # another allocation, without the dead nodes
                driver.requeue(decision.why, exclude=_hostnames(ray, bad_nodes))
            driver.finish(cancel)
            if decision.code != 0:
                raise SystemExit(decision.code)
            return outcomes
        driver.untrack(*actors)
        kept = _trusted(actors, outcomes, ends, nodes, bad_nodes) if parking else []
        kill_actors([a for a in actors if all(a is not k for k in kept)])
        if parking is not None:
            parking.park("group", kept, b"")
        restarts, stalled = restarts + 1, decision.stalled


def _trusted(actors: Sequence[Any], outcomes: Sequence[Any], ends: Sequence[RankEnd],
             nodes: Sequence[str], bad: Collection[str]) -> list[Any]:
    """The actors a new group may take back: the policy lets them (``reusable``: not killed
    for silence, not gone), their run ended them (not their own error), they do not leave on
    Ray's SIGTERM, and their node was not found dead."""
    from kempner_resilience.supervise.ray.actor import ActorEnding, ending_of

    def stays(r: int, out: Any) -> bool:
        ending = ending_of(out)
        return reusable(ends[r]) and nodes[r] not in bad and isinstance(ending, ActorEnding) \
            and not ending.leaves

    return [a for r, (a, out) in enumerate(zip(actors, outcomes)) if stays(r, out)]


def group_evidence(ends: tuple[RankEnd, ...], config: ResilienceConfig, *, restarts: int,
                   stalled: int, commits: Commits, dead: frozenset[str] = frozenset(),
                   spares: int | None = None) -> Evidence:
    """The policy's evidence after one incarnation of the group, with the config's budget and
    no-progress guard. ``dead``: the Ray nodes that died under an actor (implicated);
    ``spares``: the live nodes beside the group's (None when no node died: the group comes
    back where Ray places it)."""
    return Evidence(ends, restarts=restarts, max_restarts=config.requeue.restart_limit,
                    commits=commits, stalled=stalled,
                    max_no_progress=config.requeue.max_no_progress, implicated=dead,
                    spares=spares)


def lost_nodes(outcomes: Sequence[Any], killed: Sequence[int], nodes: Sequence[str]) -> frozenset[str]:
    """The Ray nodes of the actors whose process is gone (Ray's ``RayActorError``; not those
    the driver killed): the nodes a failure may have taken, whatever the rank recorded before
    it went (its node may have died after)."""
    return frozenset(nodes[r] for r, out in enumerate(outcomes) if r not in killed and _actor_died(out))


def group_decision(ends: tuple[RankEnd, ...], config: ResilienceConfig, *,
                   nodes: Sequence[str], lost: Collection[str], alive: Collection[str],
                   bad: Collection[str] = frozenset(), restarts: int, stalled: int,
                   commits: Commits) -> tuple[Decision, frozenset[str]]:
    """The policy's answer after one incarnation, and the Ray nodes newly found dead under it.

    ``nodes[r]``: rank ``r``'s Ray node; ``lost``: ``lost_nodes``; ``alive``: ``_alive_nodes``;
    ``bad``: the nodes that died under an earlier incarnation. A lost actor's node is dead when
    Ray no longer holds it alive; the spares are then the live nodes beside the group's."""
    dead = frozenset(lost - set(alive) - set(bad))
    spares = len(set(alive) - set(nodes) - set(bad) - dead) if dead else None
    return decide(group_evidence(ends, config, restarts=restarts, stalled=stalled,
                                 commits=commits, dead=dead, spares=spares)), dead


def recreates(d: Decision) -> bool:
    """A new group in this driver: a relaunch, or a requeue the actors asked for (Ray is the
    scheduler that places them again); a requeue for want of a spare node needs another
    allocation, which only the driver's own scheduler (SLURM) can give."""
    return d.action is Action.RELAUNCH or (d.action is Action.REQUEUE and d.kind is Kind.REQUESTED)


def _alive_nodes(ray: Any, lost: Collection[str]) -> set[str]:
    """The Ray nodes alive once the nodes of the actors that died have settled.

    A node that just died is first only "unavailable" to Ray (its health check has not failed
    enough yet) and Ray would place a new actor there. A lost actor's node whose raylet no
    longer answers is waited on until Ray marks it dead, at most ``_NODE_DEATH_WAIT_S``; a
    node that answers is alive (the actor's process died alone: the OOM killer, a SIGKILL)."""
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
