"""The steps of a shutdown, each on its own time budget, each returning what it did.

``sequence.py`` runs them in order and notes their results in the run's progress; a step reads
the run's state and writes nothing into it. What a step tells the world (the ledger, the
trackers, ``scontrol``) it still tells itself.

    stop_action     what a stop's reason does (save, requeue?) and the code it leaves with
    start_deadline  the ranks that agreed to another rank's stop arm their shutdown deadline
    emergency_save  every rank's shard, then rank 0's commit           -> SaveResult
    peers_code      no supervisor: a peer's own ending ends the job      -> the job's code
    requeue         rank 0 decides and calls scontrol, every rank told  -> Requeued
    teardown        the user's cleanups, then ours                     -> TornDown
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kempner_resilience.config import Action, ResilienceConfig
from kempner_resilience.core.log import get_logger
from kempner_resilience.supervise.rank import has_supervisor, local_restart_count
from kempner_resilience.exitcodes import Ending, ExitCode, Saved, Verdict
from kempner_resilience.runstate import RunState
from kempner_resilience.stop.reason import StopKind, StopReason
from kempner_resilience.stop.teardown import (CleanupResult, TeardownStack, cuda_synchronize,
                                              destroy_process_group, flush_logs)

if TYPE_CHECKING:
    from kempner_resilience.checkpoint.info import CheckpointInfo

__all__ = ["SaveResult", "Requeued", "TornDown", "stop_action", "start_deadline",
           "emergency_save", "requeue", "requeue_decision", "teardown", "peer_forced_code",
           "peers_code",
           "local_restart_count"]

log = get_logger(__name__)


@dataclass(frozen=True)
class SaveResult:
    """What the emergency save did."""

    saved: Saved
    info: CheckpointInfo | None = None   # the committed checkpoint
    seconds: float | None = None         # committed in (the shutdown's ``emergency_save_s``)
    lost_peer: bool = False              # it failed because a rank is gone
    lease_lost: bool = False             # another run holds the directory: nothing was saved


@dataclass(frozen=True)
class Requeued:
    """What the requeue step decided: the verdict, and how long ``scontrol requeue`` took
    (None when it did not run)."""

    verdict: Verdict
    scontrol_s: float | None = None


@dataclass(frozen=True)
class TornDown:
    """What the teardown did: every cleanup's result, in order, how long it all took, and what
    may still block the interpreter's exit (a stuck executor task, a group with a dead
    member): in ``raise`` mode that exit stays bounded because of it."""

    results: tuple[CleanupResult, ...]
    seconds: float
    left_behind: tuple[str, ...] = ()


# ------------------------------------------------------------------------------ decisions

def stop_action(config: ResilienceConfig, reason: StopReason) -> tuple[Action, int]:
    """What a stop for ``reason`` does, and the signal whose row of the exit-code table it
    leaves by when not requeued. A signal: its own action. The allocation's end: as if the
    first signal whose action is ``requeue`` had come (docs/config.md,
    ``requeue.time_limit_stop``), SIGUSR1 when none requeues."""
    actions = config.signals.actions
    if reason.kind is StopKind.SIGNAL:
        assert reason.signum is not None
        return actions.get(_name(reason.signum), Action.STOP), reason.signum
    first = next((name for name, action in actions.items() if action is Action.REQUEUE),
                 "SIGUSR1")
    return actions.get(first, Action.STOP), int(getattr(signal, first))


def start_deadline(state: RunState, reason: StopReason) -> None:
    """The rank that got the signal armed its deadline then; the others start theirs now."""
    parts = state.parts
    parts.hang.stop()            # from here the shutdown deadline governs
    if parts.handler.request is not None:
        return
    name = _name(stop_action(parts.config, reason)[1])
    end = time.monotonic() + parts.config.signals.grace_for(name)
    why = f"{reason.word} on another rank"
    if reason.kind is StopKind.TIME_LIMIT or parts.clock.fired:
        # The allocation's end bounds the stop, but a run that started late (already past it)
        # still gets what the save needs: SLURM's KillWait follows.
        now = time.monotonic()
        if parts.clock.end is not None:
            end = min(end, max(parts.clock.end, now + parts.clock.needed()))
        why = "the allocation's end"
    parts.handler.deadline.arm(end, why)


def peer_forced_code(state: RunState) -> int | None:
    """The code another rank was forced out with (a repeated SIGTERM/SIGINT), if any."""
    forced = state.parts.agreement.forced_exit()
    if forced is None or forced[1] == state.rank:
        return None
    code, rank = forced
    how = (f"a repeated {signal.Signals(code - 128).name}" if code - 128 in
           (signal.SIGINT, signal.SIGTERM) else "a repeated signal")
    # One line that says what happened, instead of the peer's lost link and the code's usual
    # meaning ("checkpoint committed"), which does not hold for a rank forced out.
    log.error("rank %d was forced out by %s (exit %d, no checkpoint of its own): this rank "
              "exits with %d too", rank, how, code, code)
    return code


def peers_code(state: RunState, own: int = ExitCode.PEER_LOST) -> int | None:
    """A rank that lost a peer (``own``: PEER_LOST) or hung (HANG: with NCCL a peer's exit
    leaves the others stuck in the collective), with no supervisor to decide (plain ``srun
    python train.py``, submitit arrays, plain torchrun): the one policy over the ranks' recorded endings
    (``supervise/endings.py``). Rank 0 decides and writes its decision; another survivor
    takes rank 0's (srun's status is the highest task code: every survivor must leave with
    the job's code). The job's code when the job leaves (a peer raised: 1; a peer left
    ``run.steps`` early: 1), so that this rank leaves with it and nothing is requeued; None
    when the job is to run again (a peer killed, or one that only lost a peer too: the
    requeue's budget then decides), when rank 0 is gone, or under a supervisor."""
    from kempner_resilience.supervise.endings import (PEER_WAIT_S, VERDICT_WAIT_S,
                                                      note_verdict, peer_decision,
                                                      read_verdict, survivors)
    from kempner_resilience.supervise.policy import Action, RankEnd

    parts = state.parts
    if parts.ckpt is None or parts.attempt_token is None or has_supervisor():
        return None
    paths, token = parts.ckpt.paths, parts.attempt_token
    # Within the exit's deadline, with room left for the requeue after it.
    left = parts.handler.deadline.remaining()
    if state.rank != 0:
        wait = VERDICT_WAIT_S if left is None else max(0.0, min(VERDICT_WAIT_S, left / 2))
        code = read_verdict(paths, token, wait_s=wait)
        if code is not None:
            log.error("rank 0 decided from the ranks' endings that the job ends (exit %d), "
                      "not requeued: this rank exits with it too", code)
        return code
    wait = PEER_WAIT_S if left is None else max(0.0, min(PEER_WAIT_S, left / 2))
    # The rescue that just ran says which silent peers survived and which died (no wait).
    rescue = parts.rescue.files if parts.rescue is not None else None
    try:
        decision, seen = peer_decision(paths, token, RankEnd(int(own)), 0,
                                       parts.agreement.world_size, wait, rescue)
        alive = sorted(survivors(rescue) - set(seen) - {0})
    except Exception as e:   # never let the reading stop the exit: decide as before
        log.error("could not read the other ranks' endings (%s): deciding without them", e)
        return None
    note_verdict(paths, token, decision)
    said = ", ".join([f"rank {r}: {e.kind} {e.code}" for r, e in sorted(seen.items())]
                     + [f"rank {r}: in the rescue" for r in alive])
    if decision.action is not Action.LEAVE:
        log.info("the other ranks' endings (%s; the rest killed): %s", said or "none recorded",
                 decision.why)
        return None
    log.error("not requeued: %s (%s); this rank exits with %d", decision.why, said,
              decision.code)
    return decision.code


def peers_left(state: RunState) -> dict[int, int]:
    """The peers that left ``run.steps`` early in this attempt, as they said before their
    sockets closed (``sequence.complete``): rank -> the step it left at. One listing of the
    attempt's endings, no wait: a failure path must not pay a rank-by-rank lookup."""
    from kempner_resilience.supervise.endings import read_endings

    parts = state.parts
    if parts.ckpt is None or parts.attempt_token is None:
        return {}
    paths, token = parts.ckpt.paths, parts.attempt_token
    try:
        names = os.listdir(paths.endings(token))
    except OSError:
        return {}
    ranks = [int(n[5:-5]) for n in names
             if n.startswith("rank-") and n.endswith(".json") and n[5:-5].isdigit()]
    seen = read_endings(paths, token, (r for r in ranks if r != state.rank), wait_s=0.0)
    return {r: e.step for r, e in seen.items() if e.kind == Ending.LEFT_EARLY.value}


# ------------------------------------------------------------------------------ the steps

def emergency_save(state: RunState, step: int) -> SaveResult:
    """Budget: the shutdown deadline (the manager refuses a save measured not to fit)."""
    parts = state.parts
    if parts.ckpt is None:
        return SaveResult(Saved.NOTHING)
    from kempner_resilience.checkpoint import CheckpointError, SavePeerLost
    from kempner_resilience.checkpoint.lease import LeaseLost
    from kempner_resilience.core.faults import first_line, is_peer_failure

    t0 = time.monotonic()
    try:
        info = parts.ckpt.emergency_save(step, deadline=parts.handler.deadline.deadline)
    except LeaseLost:           # raised on every rank: no failed save, another run's directory
        return SaveResult(Saved.NOTHING, lease_lost=True)
    except (CheckpointError, SavePeerLost, OSError) as e:
        # Expected (full disk, quota, I/O, a peer gone mid-save): the message names the cause.
        log.error("emergency checkpoint at step %d failed: %s", step, e)
        return SaveResult(Saved.FAILED, lost_peer=is_peer_failure(e))
    except Exception as e:
        if is_peer_failure(e):   # a rank left mid-save (forced out, killed): no bug, one line
            log.error("emergency checkpoint at step %d failed: a peer rank is gone (%s); the "
                      "previous committed checkpoint is intact", step, first_line(e))
            return SaveResult(Saved.FAILED, lost_peer=True)
        log.exception("emergency checkpoint at step %d failed; the previous committed "
                      "checkpoint is intact", step)
        return SaveResult(Saved.FAILED)
    if info is None:
        return SaveResult(Saved.FAILED)
    seconds = time.monotonic() - t0
    log.info("emergency checkpoint for step %d committed in %.2f s: %s", step, seconds,
             getattr(info, "path", info))
    return SaveResult(Saved.COMMITTED, info, seconds)


_READERS_S = 10.0   # how long rank 0 stays for a slow rank to read the requeue verdict


def requeue(state: RunState, committed: int | None) -> Requeued:
    """Rank 0 decides (budget, scontrol with its own timeout); every rank learns its verdict
    through the store within what is left of the deadline."""
    parts = state.parts
    mine = None
    if state.rank == 0:
        # The ranks stopped and saved (committed, or a run without state): no requeue weighed
        # would mean nothing committed after a save that did not fail, which no save leaves.
        mine = requeue_decision(state, committed) or Requeued(Verdict.NO_PROGRESS)
    left = parts.handler.deadline.remaining()
    try:
        wait = left if left is not None else 60.0
        # The ranks' last exchange before they exit: rank 0 (the store's host, under srun)
        # stays until each rank has its verdict, for at most a few seconds of the deadline.
        verdict = Verdict(parts.agreement.share_text(
            "requeue_verdict", None if mine is None else mine.verdict.value, wait,
            readers_s=max(min(wait, _READERS_S), 0.1)))
    except Exception as e:  # rank 0 is gone or the store timed out: the checkpoint is safe
        from kempner_resilience.core.faults import first_line

        log.error("did not learn rank 0's requeue verdict (%s)", first_line(e))  # not c10d's
        return Requeued(Verdict.UNHEARD)
    if verdict is Verdict.REQUEUED:
        parts.trackers.preempting()    # a W&B run on another rank (rank 0 told its own)
    return Requeued(verdict, None if mine is None else mine.scontrol_s)


def requeue_decision(state: RunState, committed: int | None,
                     ending: int = int(ExitCode.REQUEUE)) -> Requeued | None:
    """Rank 0: when the one policy says the job runs again (``slurm.scheduler_decision``:
    a committed checkpoint to come back to, the restart budget, the no-progress guard, for the
    ranks' ``ending``: REQUEUE after a stop, a failure's own code), ``scontrol requeue`` (or,
    outside SLURM, "run me again" to a local launcher). None: no requeue was weighed (nothing
    committed to come back to)."""
    from kempner_resilience.slurm import requeue_job, scheduler_decision
    from kempner_resilience.slurm.badnodes import bad_nodes
    from kempner_resilience.slurm.requeue import RestartLedger
    from kempner_resilience.supervise.policy import RankEnd

    parts = state.parts
    ledger = None
    if parts.ckpt is not None:
        ledger = RestartLedger.for_checkpoint_dir(parts.ckpt.paths)
    who = parts.slurm if parts.slurm is not None else local_restart_count()
    decision = scheduler_decision((RankEnd(ending),), who, ledger, committed,
                                  parts.config.requeue)
    if decision.verdict is None:
        return None
    if decision.verdict is not Verdict.REQUEUED:
        return Requeued(decision.verdict)
    # Before the requeue: `scontrol requeue` SIGTERMs every task at once.
    parts.trackers.preempting()
    if parts.slurm is None:
        return Requeued(Verdict.REQUEUED)  # "run me again": the local launcher relaunches
    parts.handler.expect(signal.SIGTERM)   # SLURM's answer, not a user's second SIGTERM
    t0 = time.monotonic()
    # Every requeue of a run with recorded bad nodes keeps the job off them (slurm/badnodes.py).
    exclude = bad_nodes(parts.ckpt.paths) if parts.ckpt is not None else set()
    # The training's own step spans the nodes it needs; any other node of the job is a spare.
    result = requeue_job(parts.slurm, parts.config.requeue, exclude=exclude,
                         min_nodes=parts.slurm.nnodes)
    seconds = time.monotonic() - t0
    if exclude:
        parts.ledger.event("exclude", bad_nodes=",".join(sorted(exclude)),
                           excluded=",".join(result.excluded), why=result.exclude_error)
    return Requeued(result.verdict, seconds)


def teardown(state: RunState, *, peers_alive: bool) -> TornDown:
    """The user's cleanups (newest first), then ours; each bounded, all within the deadline."""
    parts = state.parts
    deadline = parts.handler.deadline.deadline
    t0 = time.monotonic()
    results = parts.teardown.run(deadline=deadline)
    builtin = TeardownStack(parts.config.watchdog.cleanup_timeout_s)
    builtin.add(flush_logs, name="flush logs")
    if peers_alive:     # with a peer gone, gloo/NCCL teardown would wait for it
        builtin.add(destroy_process_group, name="destroy process group")
    builtin.add(cuda_synchronize, name="cuda synchronize")
    if parts.ckpt is not None:
        builtin.add(parts.ckpt.close, name="drain checkpoint saves")
    done = tuple(results + builtin.run(deadline=deadline))
    seconds = time.monotonic() - t0
    left = [r.name for r in done if not r.ok and (r.error or "").startswith("timed out")]
    import torch.distributed as dist

    if not peers_alive and dist.is_available() and dist.is_initialized():
        left.append("the process group (a peer is gone)")
    return TornDown(done, seconds, tuple(left))


# ------------------------------------------------------------------------------ small helpers

def _name(signum: int | None) -> str:
    return signal.Signals(signum).name if signum else "?"
