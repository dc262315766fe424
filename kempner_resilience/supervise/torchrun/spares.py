"""The torchrun agent's glue for spare nodes: relaunch in place after a rescued failure.

With ``--nnodes=N`` and N + K agents, torch keeps K standing by. ``InPlace`` decides what torch
does not (``elastic.py`` asks it): which endings restart, which node leaves to a spare, when
torch may cut the survivors' rescue short; and what the run remembers. The rules: docs/slurm.md.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from dataclasses import asdict, replace
from typing import Any, Callable, Iterable, Mapping, Sequence

from kempner_resilience.checkpoint.layout import newest_committed
from kempner_resilience.core import torch_private
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.runpaths import RunPaths
from kempner_resilience.slurm.badnodes import bad_node_records, record_bad_nodes
from kempner_resilience.slurm.env import node_name
from kempner_resilience.slurm.restart_event import last_rescue, ledger_so_far, num, record_restart
from kempner_resilience.supervise.torchrun.agent import AGENT_NAME, Agent
from kempner_resilience.supervise.torchrun.evidence import implicated_here, observe
from kempner_resilience.supervise.torchrun.standby import Relaunch, live_standbys
from kempner_resilience.supervise.channel import CHANNEL_ENV, Channel, Progress, launch_name
from kempner_resilience.supervise.policy import RESCUED_CODES, Action, Guard, decide

__all__ = ["InPlace", "in_place_settings", "restart_decision", "record_left",
           "record_agent_restart"]

log = get_logger("kempner_resilience.supervise.torchrun.wrapper")

# The name stays for tests/test_supervise_policy.py's check of every backend.
_RESCUED = RESCUED_CODES
# torch's defaults (dynamic_rendezvous.RendezvousTimeout / create_handler).
_KEEP_ALIVE_S, _KEEP_ALIVE_ATTEMPTS = 5.0, 3
# Where each agent publishes its workers' global ranks in the round's store (``publish_ranks``).
_RANKS_KEY = "kempner_resilience/ranks/"
_SIGNAL_ENDING = "a signal ending (time limit, preemption, Ctrl+C): save, requeue, exit"


def restart_decision(codes: Mapping[int, int], *, signalled: bool, restarts_left: int,
                     max_restarts: int) -> tuple[bool, str]:
    """Without spares: whether torch restarts the failed group where it ran, and why."""
    d = decide(observe(codes, signalled=signalled, restarts_left=restarts_left,
                       max_restarts=max_restarts))
    return d.action is Action.RELAUNCH, _SIGNAL_ENDING if signalled else d.why


def in_place_settings(args: argparse.Namespace) -> Relaunch | None:
    """The relaunch torchrun's parsed arguments allow (None: ``--max-restarts`` 0, standalone
    or not the c10d rendezvous)."""
    if args.max_restarts <= 0 or args.standalone or args.rdzv_backend != "c10d" \
            or not args.rdzv_endpoint:
        return None
    conf = {k.strip(): v.strip() for k, _, v in
            (item.partition("=") for item in (args.rdzv_conf or "").split(","))}
    try:
        interval = float(conf.get("keep_alive_interval", _KEEP_ALIVE_S))
        attempts = int(conf.get("keep_alive_max_attempt", _KEEP_ALIVE_ATTEMPTS))
    except ValueError:
        interval, attempts = _KEEP_ALIVE_S, _KEEP_ALIVE_ATTEMPTS
    endpoint = args.rdzv_endpoint if ":" in args.rdzv_endpoint else f"{args.rdzv_endpoint}:29400"
    # A heartbeat older than the keep-alive window plus one interval: that agent is gone.
    return Relaunch(endpoint=endpoint, run_id=args.rdzv_id, restarts_left=args.max_restarts,
                    stale_s=interval * (attempts + 1))


class InPlace:
    """One agent's part in relaunches: its decisions and whether it has only stood by."""

    def __init__(self, agent: Agent, settings: Relaunch,
                 channel: Channel | None = None) -> None:
        self.agent = agent
        self.settings = settings
        # The workers' channel: this agent's own, inside the supervisor's or private.
        self.channel = Channel.for_agent(channel, node_name())
        self._env_before = os.environ.get(CHANNEL_ENV)
        self.standby = False          # torch put this agent in a round's redundancy list
        self.restarts = 0             # in place, as the policy said (``decide``)
        self.left = False             # this node was implicated and left the job to a spare
        self.own_paths = RunPaths.from_config(agent.config)  # the run's without a channel
        self.spares_seen: list[str] = []  # the standbys waiting when this agent restarted
        self.why: str | None = None       # this agent's view of the last failure
        self.launch = launch_name()       # the launch its workers mark their hangs under
        # A private channel hears rank 0 only on its node, and the agents must decide alike:
        # no no-progress guard there.
        self._progress = Progress(self.channel if self.channel.supervised else None)
        self.final_code: int | None = None  # the policy's code when its guard ended the job
        self._waiting_since: float | None = None  # a node waits while the workers run
        rescue, hang = agent.config.rescue, agent.config.watchdog.hang_timeout_s
        # How long a healthy group may take to see the loss and commit the rescue.
        self.rescue_grace_s = (rescue.budget_s + max(hang, 0.0)) if rescue.enabled else 0.0

    def stand_by(self) -> None:
        """torch put this agent (maybe one that trained) in a round's redundancy list."""
        if not self.waiting_as_spare():
            log.info("%s: standby (the rendezvous has its nodes): waiting to take a failed "
                     "node's place", AGENT_NAME)
        self.standby = True
        self.agent.stand_by()

    def waiting_as_spare(self) -> bool:
        """Whether torch kept this agent out of a round and it started no worker since."""
        return self.standby and not self.agent.workers

    def run_paths(self) -> RunPaths:
        """Where the run's memory lives: as rank 0 reported it, else the agent's own config's."""
        said = self.channel.run_paths()
        if said is not None:
            return said
        if self.channel.supervised:     # a private channel hears rank 0 only on its node
            log.warning("%s: no run reported in the supervisor's channel %s yet: using the "
                        "agent's checkpoint.dir %s", AGENT_NAME, self.channel.root,
                        self.own_paths)
        return self.own_paths

    def decide(self, codes: Mapping[int, int], restarts_left: int = 1,
               max_restarts: int = 1) -> tuple[bool, str]:
        """Whether the failed worker group restarts in place, and why (the policy's decision)."""
        signalled = bool(self.agent.signals)
        progress = self.progress()
        first = decide(observe(codes, signalled=signalled, restarts_left=restarts_left,
                               max_restarts=max_restarts, **progress))
        if first.guard is Guard.NO_PROGRESS:
            # The agents leave with NO_REQUEUE, which the step loop does not requeue either.
            self.final_code = first.code
        failed = sorted(set(codes.values()))
        if first.action is not Action.RELAUNCH:
            return False, (_SIGNAL_ENDING if signalled
                           else f"workers exited with {failed}: {first.why}")
        mine = implicated_here(codes, self.channel.hang_seen(self.launch))
        spares = live_standbys(self.settings)
        d = self._progress.carry(decide(observe(
            codes, signalled=False, restarts_left=restarts_left, max_restarts=max_restarts,
            standbys=len(spares or ()), node=node_name() if mine else None, **progress)))
        if d.action is not Action.RELAUNCH:
            return False, ("no standby node waits" if spares is not None
                           else "the rendezvous store is unreachable") + ": the job requeues"
        spares = spares or []
        if mine:
            # It leaves the rendezvous (without closing it) and exits 0: the step goes on. The
            # record comes first: the survivors' next round waits for this node to leave.
            self.left = True
            record_left(self.run_paths(), failed, why=mine)
            return False, (f"{mine}: this node is implicated and leaves; a standby "
                           f"({', '.join(spares)}) takes its place")
        self.restarts += 1
        self.spares_seen = list(spares)
        self.why = f"workers failed with {failed} (a rescued failure, every node alive)"
        return True, f"standby node(s) waiting: {', '.join(spares)}"

    def progress(self) -> dict[str, Any]:
        """The no-progress guard's evidence for ``observe`` (``channel.Progress``)."""
        return self._progress.guard()

    def group_started(self) -> None:
        """A worker group starts: the no-progress guard's baseline, the run's newest commit."""
        self._progress.starting()

    def nodes_waiting(self, waiting: int) -> int:
        """What torch's monitor loop is told of ``waiting`` nodes while the workers run: none
        for ``rescue_grace_s``. A node waits only after a participant's heartbeat expired; the
        workers then fail on their own and rescue, which torch's restart would cut off."""
        now = time.monotonic()
        if waiting <= 0:
            self._waiting_since = None
            return waiting
        if self._waiting_since is None:
            self._waiting_since = now
            log.warning("%s: a node waits for a place (a participant's heartbeat expired): "
                        "the workers get up to %.0f s to see the loss and rescue before the "
                        "group is restarted", AGENT_NAME, self.rescue_grace_s)
        return 0 if now - self._waiting_since < self.rescue_grace_s else waiting

    def publish_ranks(self, store: Any, group_rank: int, ranks: Sequence[int]) -> None:
        """This agent's global ranks, in the round's store under its group rank. Never raises:
        the peers keep the heartbeat rule."""
        try:
            store.set(f"{_RANKS_KEY}{int(group_rank)}", ",".join(str(int(r)) for r in ranks))
        except Exception as e:   # the store's host died: no relaunch follows anyway
            log.warning("%s: could not publish this node's ranks in the rendezvous store (%s)",
                        AGENT_NAME, e)

    def node_ranks(self, store: Any, group_world_size: int) -> dict[int, frozenset[int]]:
        """The global ranks of each agent of the round, by group rank (empty: unknown). Read,
        not computed: the agents' local world sizes may differ."""
        keys = [f"{_RANKS_KEY}{g}" for g in range(int(group_world_size))]
        try:
            if not keys or not store.check(keys):
                return {}
            return {g: frozenset(int(r) for r in bytes(v).decode().split(",") if r)
                    for g, v in enumerate(store.multi_get(keys))}
        except Exception as e:   # the store's host died, a malformed value: the heartbeat rule
            log.warning("%s: could not read the nodes' ranks from the rendezvous store (%s)",
                        AGENT_NAME, e)
            return {}

    def ranks_died(self) -> Callable[[], set[int]]:
        """Reads, when called, the ranks of this launch that the survivors saw die."""
        return functools.partial(self.channel.ranks_died, self.launch)

    def before_initialize(self, restarts_left: int) -> None:
        """Before torch's rendezvous: the offer to the channel, the channel to the environment
        torch copies to the workers."""
        self.channel.offer_rendezvous(asdict(replace(self.settings, restarts_left=restarts_left)))
        os.environ.update(self.channel.env())

    def before_start(self, rdzv_handler: Any, group_rank: int) -> None:
        """After the rendezvous, before the workers: a later round is an in-job restart, the
        same round on every node."""
        state = torch_private.rendezvous_state(rdzv_handler)
        round_ = getattr(state, "round", None)
        if not isinstance(round_, int) or round_ < 0:   # this torch hides it: our own count
            round_ = self.restarts
        self.channel.begin_relaunch(round_)
        self.launch = launch_name({**os.environ, **self.channel.env()})
        self.group_started()
        if round_ > 0 and group_rank == 0:
            # One agent per round writes it, before its workers (global rank 0's) start. The
            # spare(s) this round took in, as best known (torch's node addresses).
            if self.waiting_as_spare():       # this agent stood by until now
                own = getattr(torch_private.this_node(rdzv_handler), "addr", None)
                spare = None if own is None else str(own)
            else:
                members = {str(getattr(n, "addr", n))
                           for n in getattr(state, "participants", {}) or {}}
                spare = ",".join(sorted(members & set(self.spares_seen))) or None
            record_agent_restart(self.run_paths(), round_, spare=spare, why=self.why)

    def close(self) -> None:
        """The run is over: remove the workers' channel, restore the environment."""
        if self._env_before is None:
            os.environ.pop(CHANNEL_ENV, None)
        else:
            os.environ[CHANNEL_ENV] = self._env_before
        self.channel.remove_agent()


# ------------------------------------------------------------------ the memory

def record_left(paths: RunPaths, codes: Iterable[int], why: str | None = None) -> None:
    """This node leaves the job to a spare (its worker was killed, or hung with the GIL held):
    record it as bad. ``why``: the agent's words for it ("... on this node ...")."""
    node = node_name()
    if not _known_dir(paths, f"node {node} as bad"):
        return
    what = f"a worker on {node} was killed (exit {sorted(set(codes))})" \
        if why is None or "was killed" in why else why.replace("this node", node)
    try:
        record_bad_nodes(paths, [node], reason=f"{what}; it left the job to a spare",
                         job_id=os.environ.get("SLURM_JOB_ID"))
    except OSError as e:     # the relaunch still goes on without it; only the memory is lost
        log.error("cannot record node %s as bad in %s: %s", node, paths, e)


def _known_dir(paths: RunPaths, what: str) -> bool:
    """Whether the run's directory (the workers made it) exists; else the log says why."""
    if paths.root.is_dir():
        return True
    log.warning("not writing %s: no checkpoint directory %s; give the agent the workers' "
                "checkpoint.dir (--config/--set before torchrun's arguments, or "
                "KEMPNER_RESILIENCE_CONFIG)", what, paths)
    return False


def record_agent_restart(paths: RunPaths, round_: int, *, spare: str | None = None,
                         why: str | None = None) -> dict[str, Any] | None:
    """Write the ``restart`` event of in-job restart ``round_`` (the rank-0 agent, before it
    starts its workers). ``why``: this agent's own view of the failure, used when no node
    left (a rescued failure with every node alive). Never raises; returns the event."""
    if not _known_dir(paths, f"the restart event of in-job restart {round_}"):
        return None
    try:
        events, ids = ledger_so_far(paths)
        # The failure happened during the previous attempt: since its start.
        starts = [e for e in events if e.get("ev") == "start"]
        since = (num(starts[-1].get("t0")) if starts else None) or 0.0
        fresh = {n: r for n, r in bad_node_records(paths).items()
                 if (num(r.get("last_t")) or 0.0) >= since}
        rescue_end, rescue_s = last_rescue(events, since)
        rescue_t0 = None if rescue_end is None else rescue_end - (rescue_s or 0.0)
        # When the failure happened, as best known: the leaving node recorded it as soon as
        # its monitor saw its worker dead, or the survivors' rescue began, whichever came first.
        known = [num(r.get("last_t")) or 0.0 for r in fresh.values()]
        failure_t = min(known + ([rescue_t0] if rescue_t0 is not None else []), default=None)
        detect_s = None if failure_t is None or rescue_t0 is None \
            else max(0.0, rescue_t0 - failure_t)
        # Back to back: failure -> detection -> rescue -> relaunch (this agent's launch).
        end = rescue_end if rescue_end is not None else failure_t
        reason = "; ".join(sorted({str(r.get("reason", "")) for r in fresh.values()} - {""})) \
            or why or "a rescued failure"
        return record_restart(paths, relaunch=round_, reason=reason, bad_nodes=fresh,
                              spare=spare, step=newest_committed(paths), failure_t=failure_t,
                              detect_s=detect_s, rescue_s=rescue_s,
                              relaunch_s=None if end is None else max(0.0, time.time() - end),
                              **ids)
    except Exception as e:   # the restart goes on; only its accounting is lost
        log.error("could not write the restart event of in-job restart %d to %s: %s",
                  round_, paths, e)
        return None
