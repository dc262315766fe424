"""The one launch-side policy: from how a job's ranks ended, run it again or not, and its code.

Every supervisor of ranks asks it once a launch is over: relaunch in place, hand the job to the
scheduler, or leave, and with which code. It decides from ``Evidence`` alone (no I/O, no
process, no clock), so one table test (``tests/test_supervise_policy.py``) pins every row.
The rows of ``job_code``, why a rank's own code beats its peers' 81, and the guarantees'
order: docs/design.md ("Decisions and why").
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass, field, replace
from typing import Collection, Mapping, Sequence

from kempner_resilience.config import RequeueConfig
from kempner_resilience.exitcodes import RESCUED, RUN_AGAIN, ExitCode, Verdict

__all__ = ["Action", "Kind", "Guard", "RankEnd", "Commits", "Evidence", "Decision", "job_code",
           "decide", "reusable", "requeue_evidence", "ends_of", "KILLED", "RESCUED", "RUN_AGAIN",
           "ENDS_THE_JOB", "NOT_IN_PLACE", "RESCUED_CODES"]

RESCUED_CODES: frozenset[int] = frozenset(int(c) for c in RESCUED)
# The codes a rank chooses that end the job as it is, whatever its peers say: a relaunch would
# repeat a bug or a bad config, fight another run for checkpoint.dir (LEASE_LOST), or undo a
# person's stop (SIGINT). Any code outside the documented table counts here too.
ENDS_THE_JOB: frozenset[int] = frozenset(int(c) for c in (
    ExitCode.ERROR, ExitCode.USAGE, ExitCode.CONFIG, ExitCode.NO_REQUEUE,
    ExitCode.REQUEUE_FAILED, ExitCode.CHECKPOINT_FAILED, ExitCode.SIGINT, ExitCode.LEASE_LOST,
    ExitCode.STOPPED, ExitCode.DEADLINE))
# What srun's step loop never relaunches in place: the job ends as it is, or is already on its
# way back to the queue (REQUEUE: rank 0 requeued it).
NOT_IN_PLACE: frozenset[int] = (ENDS_THE_JOB - {int(ExitCode.STOPPED), int(ExitCode.DEADLINE),
                                                int(ExitCode.USAGE)}) | {int(ExitCode.REQUEUE)}
# The stop signals: a rank that ends by one (or exits 128 + it) was stopped, not broken.
_STOP_SIGNALS = (int(signal.SIGTERM), int(signal.SIGINT))


class Action(enum.Enum):
    """What the supervisor does next."""

    RELAUNCH = "relaunch"   # start the ranks again here, from the newest committed checkpoint
    REQUEUE = "requeue"     # hand the job to the scheduler (for a local launcher: itself)
    LEAVE = "leave"         # the job ends with Decision.code


class Kind(enum.Enum):
    """What the ranks' endings say the job's ending was (the rows of ``job_code``)."""

    COMPLETED = "completed"
    FINAL = "final"             # a rank's own code ends the job (a bug, a config, a stop)
    LEFT_EARLY = "left-early"   # ranks exited 0 while the others lost them
    REQUESTED = "requested"     # the ranks asked to run again (75)
    FAILURE = "failure"         # a peer lost, a hang, a rank killed: worth running again
    STOPPED = "stopped"         # stopped by SIGTERM


class Guard(enum.Enum):
    """Which guarantee stopped a job that was to run again (``Decision.guard``)."""

    BUDGET = "budget"            # the restart budget is spent
    NO_PROGRESS = "no-progress"  # no newer committed step over max_no_progress relaunches
    NO_SPARE = "no-spare"        # no spare node left for a relaunch in place (a requeue)
    DISABLED = "disabled"        # requeue.enabled is false: nothing runs the job again
    NOTHING_COMMITTED = "nothing-committed"  # a requeue with nothing committed: not tried


@dataclass(frozen=True)
class RankEnd:
    """How one rank ended: ``code`` as a shell reports it (128 + N for signal N)."""

    code: int
    signaled: bool = False       # killed by a signal (not an exit with that code)
    by_supervisor: bool = False  # the supervisor ended it after the grace (it had not ended)

    @classmethod
    def from_returncode(cls, rc: int, by_supervisor: bool = False) -> "RankEnd":
        """From ``Popen.returncode`` (negative: killed by that signal)."""
        return cls(128 - rc if rc < 0 else rc, signaled=rc < 0, by_supervisor=by_supervisor)

    @property
    def own_death(self) -> bool:
        """Killed by a signal that was not a stop and not the supervisor's: the rank's own
        death (the OOM killer, a GPU fault, a node gone, a stray ``kill -9``)."""
        return self.signaled and not self.by_supervisor and self.code - 128 not in _STOP_SIGNALS


#: A rank killed by SIGKILL on its own (the OOM killer, a node gone, a process that vanished).
KILLED = RankEnd(128 + int(signal.SIGKILL), signaled=True)


def ends_of(codes: Sequence[int | None] | Mapping[int, int | None], killed: Collection[int] = (),
            aliases: Mapping[int, int] | None = None) -> tuple[RankEnd, ...]:
    """Each rank's ending, lowest rank first, from its ``Popen.returncode`` (None: still
    running when the supervisor gave up). ``killed``: the ranks the supervisor ended after the
    grace; ``aliases``: a backend's own codes read as the policy's (submitit's 144 as 75)."""
    killed = set(killed)
    by_rank = sorted(codes.items()) if isinstance(codes, Mapping) else enumerate(codes)
    return tuple(replace(KILLED, by_supervisor=True) if c is None else RankEnd.from_returncode(
        (aliases or {}).get(int(c), int(c)), by_supervisor=r in killed) for r, c in by_rank)


@dataclass(frozen=True)
class Commits:
    """The committed checkpoint's step when the launch started and now (None: none yet)."""

    before: int | None
    now: int | None

    @property
    def advanced(self) -> bool:
        return self.now is not None and (self.before is None or self.now > self.before)


@dataclass(frozen=True)
class Evidence:
    """Everything the decision needs, gathered by a backend after one launch of the ranks."""

    ends: tuple[RankEnd, ...]                 # rank r's ending at index r
    restarts: int = 0                         # relaunches before this launch
    max_restarts: int | None = None           # relaunches allowed in all (None: no limit)
    commits: Commits | None = None            # None: this backend cannot see the checkpoints
    stalled: int = 0                          # relaunches in a row before this one that ended
                                              # without a newer committed step
    max_no_progress: int = 0                  # leave after that many (0: no guard)
    implicated: frozenset[str] = frozenset()  # nodes the failure points at (kept out)
    spares: int | None = None                 # spare nodes left (None: relaunch where it ran)
    stopping: bool = False                    # the supervisor was told to stop (Ctrl+C, TERM)
    scheduler_left: bool = False              # a scheduler behind this supervisor (srun's step
                                              # loop) gets the job once max_restarts is spent
    by_requeue: bool = False                  # the scheduler's requeue (``requeue_evidence``)
    enabled: bool = True                      # requeue.enabled (False: never run again)
    relaunch_codes: frozenset[int] | None = None  # the caller's codes that run again within
                                              # the budget, in place of the policy's rule


@dataclass(frozen=True)
class Decision:
    """The answer: what to do, the job's code, why, and what to carry to the next decision."""

    action: Action
    code: int
    kind: Kind
    why: str
    stalled: int = 0                          # ``Evidence.stalled`` for the next launch
    left_early: tuple[int, ...] = field(default=())   # ranks that left run.steps early
    guard: Guard | None = None                # the guarantee that stopped a run-again

    @property
    def runs_again(self) -> bool:
        """Relaunched or requeued: the job is to run again."""
        return self.action is not Action.LEAVE

    @property
    def verdict(self) -> Verdict | None:
        """As the requeue step's verdict (the exit-code table's word); None when no requeue
        was weighed (the endings ended the job, nothing committed)."""
        return Verdict.REQUEUED if self.runs_again else _VERDICTS.get(self.guard)


_VERDICTS = {Guard.BUDGET: Verdict.BUDGET_SPENT, Guard.NO_PROGRESS: Verdict.NO_PROGRESS,
             Guard.DISABLED: Verdict.DISABLED}


def job_code(ends: tuple[RankEnd, ...] | list[RankEnd]) -> tuple[int, Kind, tuple[int, ...]]:
    """The job's code from its ranks' endings, the kind of ending, and the ranks that left
    ``run.steps`` early; the rule is docs/design.md's table."""
    if all(e.code == 0 and not e.by_supervisor for e in ends):
        return 0, Kind.COMPLETED, ()
    exits = [(r, e) for r, e in enumerate(ends) if not e.signaled and not e.by_supervisor]
    final = [e.code for _, e in exits if e.code not in (0, int(ExitCode.SIGTERM))
             and (e.code in ENDS_THE_JOB or e.code not in RUN_AGAIN)]
    if final:
        return final[0], Kind.FINAL, ()
    done = tuple(r for r, e in exits if e.code == 0)
    deaths = [e.code for e in ends if e.own_death]
    # Row 3: nothing but zeros and ranks that only lost a peer (or were stopped or ended by
    # the supervisor after the grace): the ranks that exited 0 left while the others ran.
    lost_only = all((int(ExitCode.HANG) if e.by_supervisor else e.code) in RESCUED_CODES
                    or e.code in (0, int(ExitCode.SIGTERM)) for e in ends)
    if done and not deaths and lost_only:
        return int(ExitCode.ERROR), Kind.LEFT_EARLY, done
    if any(e.code == int(ExitCode.REQUEUE) for _, e in exits):
        return int(ExitCode.REQUEUE), Kind.REQUESTED, ()
    # A hung rank says why its peers lost it: HANG before PEER_LOST.
    rescued = sorted((e.code != int(ExitCode.HANG), r, e.code) for r, e in exits
                     if e.code in RESCUED_CODES)
    if rescued:
        return rescued[0][2], Kind.FAILURE, ()
    if deaths:
        return deaths[0], Kind.FAILURE, ()
    if any(e.by_supervisor for e in ends):
        return int(ExitCode.HANG), Kind.FAILURE, ()
    # Only stops remain (143 exits, deaths by SIGTERM/SIGINT) next to zeros.
    stops = [e.code for e in ends if e.code != 0]
    return stops[0], (Kind.FINAL if stops[0] == int(ExitCode.SIGINT) else Kind.STOPPED), ()


def reusable(end: RankEnd) -> bool:
    """Whether the process of a rank that ended so may serve the next incarnation warm (a
    parked Ray actor, reborn): only one whose own run ended it, with its code (completed,
    stopped, a peer lost and rescued). One its supervisor ended for silence (a hang, a
    collective that never returned), one killed by a signal or gone, one whose watchdog found
    it hung (42): a new process replaces it, since its communicator and device state cannot be
    trusted. (A zygote's warm ranks never reuse a rank's process: each is a fresh fork.)"""
    return not end.signaled and not end.by_supervisor and end.code != int(ExitCode.HANG)


def decide(ev: Evidence) -> Decision:
    """Relaunch, requeue or leave, and the job's code (with the caller's ``relaunch_codes``,
    those run again within the budget and every other code leaves)."""
    d = _decide(ev)
    if ev.relaunch_codes is None:
        return d
    again = not ev.stopping and d.code in ev.relaunch_codes \
        and (ev.max_restarts is None or ev.restarts < ev.max_restarts)
    return replace(d, action=Action.RELAUNCH if again else Action.LEAVE,
                   why="the caller's relaunch codes" if again else d.why)


def requeue_evidence(ends: tuple[RankEnd, ...], config: RequeueConfig, restarts: int,
                     history: Sequence[int | None] | None, committed: int | None) -> Evidence:
    """The evidence for the scheduler's requeue. The budget is ``config.restart_limit``, here
    and nowhere else. ``restarts``: SLURM's restart count; ``history``: the committed step at
    each earlier requeue decision, oldest first (None: no checkpoints to see, no guard)."""
    commits, stalled = None, 0
    if history is not None:
        for prev, cur in zip(history, history[1:]):
            stalled = _stalled(stalled, Commits(prev, cur), earlier=True)
        commits = Commits(history[-1] if history else None, committed)
    return Evidence(tuple(ends), restarts=int(restarts), max_restarts=config.restart_limit,
                    commits=commits, stalled=stalled,
                    max_no_progress=int(config.max_no_progress), by_requeue=True,
                    enabled=bool(config.enabled))


def _stalled(stalled: int, commits: Commits, earlier: bool) -> int:
    """The no-progress count after a launch: a newer committed step resets it; a run-again
    that committed nothing newer adds one (the first launch has nothing to fall behind)."""
    return 0 if commits.advanced else stalled + (1 if earlier else 0)


def _decide(ev: Evidence) -> Decision:
    code, kind, early = job_code(ev.ends)
    if kind is Kind.COMPLETED:
        return Decision(Action.LEAVE, 0, kind, "every rank finished")
    if ev.stopping:
        return Decision(Action.LEAVE, code, kind, "the supervisor was told to stop: no relaunch")
    if kind is Kind.LEFT_EARLY:
        lost = [r for r in range(len(ev.ends)) if r not in early]
        return Decision(Action.LEAVE, code, kind, f"rank(s) {list(early)} left run.steps early while "
                        f"rank(s) {lost} still trained: not relaunched", left_early=early)
    if kind in (Kind.FINAL, Kind.STOPPED):
        return Decision(Action.LEAVE, code, kind,
                        f"a rank ended with {code} of its own: a relaunch would not help")
    # A job that is to run again (REQUESTED, FAILURE): the guarantees, in order.
    stalled = ev.stalled
    if ev.commits is not None:
        stalled = _stalled(ev.stalled, ev.commits, earlier=ev.restarts > 0)
    if ev.by_requeue:
        return _requeue(ev, code, kind, stalled)
    spent = ev.max_restarts is not None and ev.restarts >= ev.max_restarts
    if spent and not ev.scheduler_left:
        # Ranks that asked to run again (75) are not: the budget's code. A failure keeps its
        # code (what failed), as rank 0 leaves it.
        left = int(ExitCode.NO_REQUEUE) if kind is Kind.REQUESTED else code
        return Decision(Action.LEAVE, left, kind,
                        f"the restart budget ({ev.max_restarts}) is spent", stalled,
                        guard=Guard.BUDGET)
    if ev.commits is not None and ev.max_no_progress > 0 and stalled >= ev.max_no_progress:
        return Decision(Action.LEAVE, int(ExitCode.NO_REQUEUE), kind,
                        f"no progress: the committed step stayed at {ev.commits.now} over "
                        f"{stalled} relaunch(es) in a row (max_no_progress "
                        f"{ev.max_no_progress})", stalled, guard=Guard.NO_PROGRESS)
    start = "from scratch (nothing was ever committed)" if ev.commits is not None \
        and ev.commits.now is None else "from the newest committed checkpoint" \
        + ("" if ev.commits is None else f" (step {ev.commits.now})")
    if kind is Kind.REQUESTED:
        return Decision(Action.REQUEUE, code, kind, f"the ranks asked to run again; {start}",
                        stalled)
    if spent:
        return Decision(Action.REQUEUE, code, kind,
                        f"the {ev.max_restarts} relaunch(es) in place are spent: the scheduler "
                        f"runs it again, {start}", stalled, guard=Guard.BUDGET)
    if ev.implicated and ev.spares is not None and ev.spares < len(ev.implicated):
        return Decision(Action.REQUEUE, code, kind,
                        f"no spare node left for {sorted(ev.implicated)}: the scheduler runs "
                        f"it again elsewhere, {start}", stalled, guard=Guard.NO_SPARE)
    return Decision(Action.RELAUNCH, code, kind, f"a failure worth a relaunch; {start}", stalled)


def _requeue(ev: Evidence, code: int, kind: Kind, stalled: int) -> Decision:
    """The scheduler's requeue of a job that is to run again, weighed in this order: nothing
    committed (not tried, the failure keeps its code), ``requeue.enabled`` false, the budget,
    no progress over the restart record; else REQUEUE."""
    # As in ``_decide``: a stop that asked to run again gets the budget's code.
    left = int(ExitCode.NO_REQUEUE) if kind is Kind.REQUESTED else code
    now = ev.commits.now if ev.commits is not None else None
    if ev.commits is not None and now is None:
        return Decision(Action.LEAVE, code, kind, "no committed checkpoint to come back to", stalled,
                        guard=Guard.NOTHING_COMMITTED)
    if not ev.enabled:
        return Decision(Action.LEAVE, left, kind, "requeue.enabled is false", stalled,
                        guard=Guard.DISABLED)
    limit = ev.max_restarts
    if limit is not None and ev.restarts >= limit:
        return Decision(Action.LEAVE, left, kind,
                        f"restart budget exhausted: restarted {ev.restarts} times, "
                        f"requeue.max_restarts={limit}", stalled, guard=Guard.BUDGET)
    if ev.commits is not None and ev.max_no_progress > 0 and stalled >= ev.max_no_progress:
        return Decision(Action.LEAVE, int(ExitCode.NO_REQUEUE), kind,
                        f"no progress: the committed step stayed at {now} over {stalled} "
                        f"restarts in a row (requeue.max_no_progress={ev.max_no_progress}); "
                        "the job probably dies before it can checkpoint", stalled,
                        guard=Guard.NO_PROGRESS)
    return Decision(Action.REQUEUE, code, kind,
                    f"restart {ev.restarts + 1}" + (f" of {limit}" if limit is not None else "")
                    + f", committed step {now}", stalled)
