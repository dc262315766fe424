"""The torchrun agent's glue for spare nodes: relaunch in place after a rescued failure.

torch elastic already does the hard part. With ``--nnodes=N`` (min = max = N) and N + K agents
(one per node of an allocation with K spares), the first N complete the c10d rendezvous and
train; torch puts the others in the round's *redundancy list*, where they wait without a
timeout. When a node dies, the survivors' workers rescue the last step boundary and exit
(PEER_LOST, or HANG when their hang watchdog came first); with ``--max-restarts`` > 0 their
agents stop the group and join a new round, which opens once the dead agent's heartbeat has
expired (``keep_alive_interval`` x ``keep_alive_max_attempt``: seconds, set in the template,
never SLURM's ``SlurmdTimeout``). A standby agent takes the free place, and the new workers
resume from the newest commit: same job, same allocation, no requeue.

What torch lacks, and this module adds (``relaunching``):

* *Which endings restart.* torch restarts on any worker failure. Here only a failure the rescue
  handles restarts (every failed worker left with PEER_LOST or HANG, or was killed), only
  without a signal at the agent (a time limit or a preemption saves, requeues and exits; a
  spare does not help there), and only while a standby agent waits (else rank 0 requeues, as
  before, and the agents leave with the workers' code).
* *A node implicated in the failure does not rejoin.* An agent whose own worker was killed
  (the OOM killer, a GPU fault) leaves instead of restarting, so the spare takes its place.
* *The workers know.* Each worker group gets ``$KEMPNER_RESILIENCE_RELAUNCH`` (the rendezvous
  and the restarts left): rank 0 then leaves the relaunch to the agents instead of requeueing
  (``slurm/standby.py``, ``shutdown/sequence.py``).
* *The run remembers* (``torchrun_memory.py``): the node that leaves records itself in
  ``bad-nodes.json`` (so a requeue keeps it off too), the new group's rank-0 agent writes the
  ledger's ``restart`` event, and every relaunched worker gets the in-job restart count (the
  rendezvous round), so that ``report`` shows the relaunch as an attempt of its own.
* *The survivors rescue before torch restarts them.* Once the dead node's heartbeat expires,
  the standby moves to the round's wait list and torch restarts a *healthy* worker group at
  once (its scale-up path): under load, before the survivors' workers have seen the loss, or
  while they are still writing the rescue, which then never commits. With a fixed node count
  (``--nnodes=N``, as the template sets) a node waits only after a participant died or froze,
  so a waiting node is hidden from that check for the workers' own bound (hang timeout +
  rescue budget): they fail with PEER_LOST or HANG within it and the relaunch above takes
  over; past it torch's restart stands. An elastic range (``--nnodes=A:B``) keeps torch's
  scale-up as it is.
* *A standby that was never needed* ends with 0 when the run is over (the rendezvous host's
  agent closes the store on its way out), not with torch's connection error.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from kempner_resilience.integrations.torchrun_agent import AGENT_NAME, Agent
from kempner_resilience.core.ledger import RELAUNCH_ENV as IN_JOB_RESTART_ENV
from kempner_resilience.core.ledger import RELAUNCH_START_ENV
from kempner_resilience.core.log import get_logger
from kempner_resilience.integrations.torchrun_memory import (record_agent_restart,
                                                             record_left, relaunch_env,
                                                             rendezvous_round)
from kempner_resilience.slurm.standby import RELAUNCH_ENV, Relaunch, live_standbys
from kempner_resilience.supervise.policy import RESCUED_CODES

__all__ = ["InPlace", "relaunching", "in_place_settings"]

log = get_logger("kempner_resilience.integrations.torchrun")

# Worker exits that mean "a peer failed, the rescue ran": the ones a relaunch is for (the one
# definition is the policy's, ``supervise/policy.py``).
_RESCUED = RESCUED_CODES
# torch's defaults (dynamic_rendezvous.RendezvousTimeout / create_handler).
_KEEP_ALIVE_S, _KEEP_ALIVE_ATTEMPTS = 5.0, 3


def in_place_settings(argv: Sequence[str]) -> Relaunch | None:
    """The relaunch torchrun's own arguments allow (None: ``--max-restarts`` 0, standalone or
    not the c10d rendezvous): its endpoint, run id and keep-alive window."""
    from torch.distributed.run import parse_args

    try:
        args = parse_args(list(argv))
    except SystemExit:
        return None      # torchrun will say what is wrong with its arguments itself
    if args.max_restarts <= 0 or args.standalone or args.rdzv_backend != "c10d" \
            or not args.rdzv_endpoint:
        return None
    conf: dict[str, str] = {}
    for item in (args.rdzv_conf or "").split(","):
        key, _, value = item.partition("=")
        conf[key.strip()] = value.strip()
    try:
        interval = float(conf.get("keep_alive_interval", _KEEP_ALIVE_S))
        attempts = int(conf.get("keep_alive_max_attempt", _KEEP_ALIVE_ATTEMPTS))
    except ValueError:
        interval, attempts = _KEEP_ALIVE_S, _KEEP_ALIVE_ATTEMPTS
    endpoint = args.rdzv_endpoint if ":" in args.rdzv_endpoint \
        else f"{args.rdzv_endpoint}:29400"
    # A heartbeat older than the keep-alive window plus one interval: that agent is gone.
    return Relaunch(endpoint=endpoint, run_id=args.rdzv_id, restarts_left=args.max_restarts,
                    stale_s=interval * (attempts + 1))


class InPlace:
    """One agent's part in relaunches: its decisions and whether it has only stood by."""

    def __init__(self, agent: Agent, settings: Relaunch) -> None:
        self.agent = agent
        self.settings = settings
        self.standby = False          # torch put this agent in a round's redundancy list
        self.restarts = 0
        self.left = False             # this node was implicated and left the job to a spare
        self.ckpt_dir = agent.config.checkpoint.dir   # where the run's memory lives
        self.spares_seen: list[str] = []  # the standbys waiting when this agent restarted
        self.why: str | None = None       # this agent's view of the last failure
        self.starts = 0                   # worker groups this agent started
        self._lock = threading.Lock()
        self._waiting_since: float | None = None  # a node waits while the workers run
        rescue, hang = agent.config.rescue, agent.config.watchdog.hang_timeout_s
        # How long a healthy group may take to see the loss (a hang: its hang timeout) and
        # commit the rescue. Without a rescue there is nothing to wait for.
        self.rescue_grace_s = (rescue.budget_s + max(hang, 0.0)) if rescue.enabled else 0.0

    def unused_standby(self) -> bool:
        """This agent only ever waited as a spare: it started no worker."""
        return self.standby and not self.agent.workers

    def decide(self, failures: dict[int, int]) -> tuple[bool, str]:
        """Whether the failed worker group restarts in place, and why (or why not).
        ``failures``: this node's failed workers, {global rank: exit code (-N: signal N)}."""
        if self.agent.signals:
            return False, "a signal ending (time limit, preemption, Ctrl+C): save, requeue, exit"
        codes = sorted(set(failures.values()))
        if any(c not in _RESCUED and c >= 0 for c in codes):
            return False, f"workers exited with {codes}: not a failure the rescue handles"
        spares = live_standbys(self.settings)
        if not spares:
            return False, ("no standby node waits" if spares is not None
                           else "the rendezvous store is unreachable") + ": the job requeues"
        if any(c < 0 for c in codes):
            # Its worker died on its own (the OOM killer, a GPU fault): the node is implicated.
            # It leaves the rendezvous (without closing it) and exits 0, so that the step goes
            # on and the standby takes its place.
            self.left = True
            # Before it leaves: the survivors' next round, and so the relaunch's restart
            # event, cannot complete until it has left.
            record_left(self.ckpt_dir, codes)
            return False, (f"a worker on this node was killed ({codes}): this node is "
                           f"implicated and leaves; a standby ({', '.join(spares)}) takes its "
                           "place")
        self.spares_seen = list(spares)
        self.why = f"workers failed with {codes} (a rescued failure, every node alive)"
        return True, f"standby node(s) waiting: {', '.join(spares)}"

    def nodes_waiting(self, waiting: int) -> int:
        """What torch's monitor loop is told of ``waiting`` nodes while the workers run.

        A node waits for a place only after a participant's heartbeat expired: a node died or
        froze. The workers then fail on their own (a broken collective at once, a hang within
        their hang timeout) and rescue the last step; torch's restart of the healthy group
        would stop them first and lose the rescue. Hidden for ``rescue_grace_s``."""
        now = time.monotonic()
        if waiting <= 0:
            self._waiting_since = None
            return waiting
        if self._waiting_since is None:
            self._waiting_since = now
            log.warning("%s: a node waits for a place (a participant's heartbeat expired): "
                        "the workers get up to %.0f s to see the loss and rescue before the "
                        "group is restarted", AGENT_NAME, self.rescue_grace_s)
        if now - self._waiting_since < self.rescue_grace_s:
            return 0
        return waiting

    def spare(self, rdzv_handler: Any) -> str | None:
        """The spare node(s) this round took in (torch's node addresses), as best known."""
        state = getattr(getattr(rdzv_handler, "_state_holder", None), "state", None)
        members = {str(getattr(n, "addr", n)) for n in getattr(state, "participants", {}) or {}}
        if self.standby and self.starts == 0:      # this agent stood by until now
            own = getattr(getattr(rdzv_handler, "_this_node", None), "addr", None)
            return None if own is None else str(own)
        return ",".join(sorted(members & set(self.spares_seen))) or None

    def worker_env(self, restarts_left: int) -> str:
        s = self.settings
        return Relaunch(endpoint=s.endpoint, run_id=s.run_id, restarts_left=restarts_left,
                        stale_s=s.stale_s).to_env()


def _codes(run_result: Any) -> dict[int, int]:
    return {int(rank): int(getattr(f, "exitcode", 1))
            for rank, f in (getattr(run_result, "failures", None) or {}).items()}


@contextmanager
def relaunching(agent: Agent, settings: Relaunch | None) -> Iterator[InPlace | None]:
    """torch elastic's monitor, worker start and redundancy list hooked for the run (yields
    None, changing nothing, when ``settings`` is None or torch lacks the names)."""
    if settings is None:
        yield None
        return
    import os

    from torch.distributed.elastic.agent.server import api
    from torch.distributed.elastic.agent.server import local_elastic_agent as lea
    from torch.distributed.elastic.rendezvous import dynamic_rendezvous as dr

    cls = api.SimpleElasticAgent
    local = lea.LocalElasticAgent       # the agent torchrun runs; it has its own monitor
    executor = getattr(dr, "_DistributedRendezvousOpExecutor", None)
    handler = dr.DynamicRendezvousHandler
    names = [(local, "_monitor_workers"), (cls, "_initialize_workers"),
             (executor, "_add_to_redundancy_list"), (handler, "shutdown"),
             (local, "_start_workers"), (handler, "num_nodes_waiting")]
    missing = [n for owner, n in names if owner is None or n not in vars(owner)]
    if missing:
        log.warning("%s: this torch lacks %s: no relaunch in place (failures requeue the job)",
                    AGENT_NAME, ", ".join(missing))
        yield None
        return
    inplace = InPlace(agent, settings)
    stock = {(owner, n): getattr(owner, n) for owner, n in names}

    def monitor(self: Any, worker_group: Any) -> Any:
        result = stock[(local, "_monitor_workers")](self, worker_group)
        if result.state in (api.WorkerState.FAILED, api.WorkerState.UNHEALTHY) \
                and self._remaining_restarts > 0:
            failures = _codes(result)
            ok, why = inplace.decide(failures)
            if ok:
                inplace.restarts += 1
                log.warning("%s: workers failed with %s: relaunching in place (%s)",
                            AGENT_NAME, failures, why)
            else:
                log.warning("%s: workers failed with %s: no relaunch in place: %s",
                            AGENT_NAME, failures, why)
                self._remaining_restarts = 0    # torch stops the group and returns FAILED
        return result

    def initialize(self: Any, worker_group: Any) -> Any:
        # Read by every worker this group starts (torch copies the agent's environment).
        os.environ[RELAUNCH_ENV] = inplace.worker_env(self._remaining_restarts)
        return stock[(cls, "_initialize_workers")](self, worker_group)

    def start(self: Any, worker_group: Any) -> Any:
        # After the rendezvous, before the workers: the round is known, the workers not yet
        # started. Workers of a later round are an in-job restart, an attempt of their own.
        handler_ = worker_group.spec.rdzv_handler
        round_ = rendezvous_round(handler_)
        if round_ is None:       # this torch hides it: the count of this agent's restarts
            round_ = inplace.restarts
        for name in (IN_JOB_RESTART_ENV, RELAUNCH_START_ENV):
            os.environ.pop(name, None)
        os.environ.update(relaunch_env(round_))
        if round_ > 0 and worker_group.group_rank == 0:
            # One agent per round writes it, before its workers (global rank 0's) start.
            record_agent_restart(inplace.ckpt_dir, round_, spare=inplace.spare(handler_),
                                 why=inplace.why)
        inplace.starts += 1
        return stock[(local, "_start_workers")](self, worker_group)

    def redundant(self: Any) -> Any:
        if not inplace.standby:
            log.info("%s: standby (the rendezvous has its nodes): waiting to take a failed "
                     "node's place", AGENT_NAME)
        inplace.standby = True
        return stock[(executor, "_add_to_redundancy_list")](self)

    def waiting(self: Any) -> int:
        # torch calls it only from the monitor loop, with the worker group healthy.
        n = stock[(handler, "num_nodes_waiting")](self)
        settings_ = getattr(self, "_settings", None)
        if getattr(settings_, "min_nodes", None) != getattr(settings_, "max_nodes", 0):
            return n     # an elastic range (--nnodes=A:B): a waiting node may be a scale-up
        return inplace.nodes_waiting(n)

    def shutdown(self: Any) -> Any:
        if not inplace.left:
            return stock[(handler, "shutdown")](self)
        # torch closes the rendezvous when its agent ends: for the whole job, the survivors'
        # next round included. A node that leaves only takes itself out of the round.
        try:
            self._stop_heartbeats()
            self._op_executor.run(dr._RendezvousExitOp(), time.monotonic() + 10.0)
        except Exception as e:    # its heartbeat goes stale instead: the round opens later
            log.warning("%s: could not leave the rendezvous (%s)", AGENT_NAME, e)
        return True

    setattr(handler, "shutdown", shutdown)
    setattr(handler, "num_nodes_waiting", waiting)
    setattr(local, "_monitor_workers", monitor)
    setattr(cls, "_initialize_workers", initialize)
    setattr(executor, "_add_to_redundancy_list", redundant)
    setattr(local, "_start_workers", start)
    try:
        yield inplace
    finally:
        for (owner, n), value in stock.items():
            setattr(owner, n, value)
        for name in (RELAUNCH_ENV, IN_JOB_RESTART_ENV, RELAUNCH_START_ENV):
            os.environ.pop(name, None)
