"""The way from "the loop must end" to "the process is gone", one step per line.

``stop`` is the path a shutdown signal takes once every rank agreed on the step (agreement.py):

    deadline → emergency save (checkpoint/) → requeue decision (slurm/requeue.py)
             → teardown (teardown.py) → record the ending (outcome.py) → leave (exit.py)

``fail`` is the path of an exception that ended the loop (a lost peer, or a bug), ``give_up``
the one of periodic saves that keep failing, ``lease_lost`` the one of a run another run took
``checkpoint.dir`` over from (nothing saved, nothing written there, never requeued),
``complete`` the normal end. Each step is a small function below with its own time budget: the
shutdown deadline armed by the first signal (or here, for ranks that only agreed to someone
else's), per-cleanup limits inside it, and ``watchdog.exit_timeout_s`` for the interpreter's
exit after it. Each path ends in
``outcome.record``: the exit code from the one table (``exitcodes.exit_code``), and the ledger,
the trackers and the run report told how the run ended.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import NoReturn

from kempner_resilience import exitcodes
from kempner_resilience.stop.agreement import StopDecision
from kempner_resilience.config import Action, ExitMode
from kempner_resilience.core.ledger import Ledger
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.runpaths import RunPaths
from kempner_resilience.run.runstate import RunState
from kempner_resilience.shutdown import exit as leaving
from kempner_resilience.shutdown.outcome import (Ending, Facts, Saved, Verdict, exit_code,
                                                 record)
from kempner_resilience.shutdown.rescue import close_rescue, rescue
from kempner_resilience.supervise.channel import CHANNEL_ENV
from kempner_resilience.stop.teardown import (TeardownStack, cuda_synchronize,
                                         destroy_process_group, flush_logs)

__all__ = ["stop", "fail", "give_up", "lease_lost", "complete", "requeue_after_failure",
           "rescue", "record", "local_restart_count"]

log = get_logger(__name__)


# ------------------------------------------------------------------------------ the paths

def stop(parts: RunState, decision: StopDecision) -> NoReturn:
    """Every rank stops at ``decision.step``: save, requeue, tear down, leave."""
    close_rescue(parts)
    action = _action(parts, decision.signum)
    o = Facts(Ending.SIGNAL, decision.step, decision.signum)
    log.warning("stopping at step %d (%s, action %s)", o.step, _name(o.signum), action.value)
    req = parts.handler.request
    if req is not None:     # signal → every rank agreed on the step (this rank's signal)
        parts.timings["agree_s"] = time.monotonic() - req.received_at
    parts.ledger.event("stop", step=decision.step, signal=_stop_reason(parts, decision),
                       signal_t=req.received_wall if req is not None else None)
    _start_deadline(parts, decision)
    t0 = time.monotonic()
    o.saved = _emergency_save(parts, decision.step)
    parts.ledger.event("emergency_save", step=decision.step, saved=o.saved.name.lower(),
                       seconds=round(time.monotonic() - t0, 4))
    if action is Action.REQUEUE and o.saved is not Saved.FAILED:
        t0 = time.monotonic()   # the whole step: decision, scontrol, every rank told
        o.requeue = _requeue(parts)
        parts.timings["requeue_s"] = time.monotonic() - t0
        parts.ledger.event("requeue", verdict=o.requeue.value, code=int(exit_code(o)),
                           seconds=round(parts.timings["requeue_s"], 4))
    o.peer_forced_code = _peer_forced_code(parts)
    # A rank forced out mid-shutdown is gone: tearing the group down would wait for it.
    _teardown(parts, peers_alive=o.peer_forced_code is None and not parts.save_lost_peer)
    _leave(parts, o)


def fail(parts: RunState, exc: BaseException) -> None:
    """An exception ended the loop. Returns (the caller re-raises it) only for the user's own
    error in ``raise`` mode; otherwise leaves with the outcome's code."""
    from kempner_resilience.core.faults import first_line, is_peer_failure

    parts.hang.stop()
    lost = is_peer_failure(exc)
    code = int(exit_code(Facts(Ending.PEER_LOST if lost else Ending.ERROR)))
    if parts.exit_mode is ExitMode.EXIT:       # armed first: the store below may be gone too
        parts.handler.deadline.expect_exit(
            code, parts.config.rescue.budget_s if lost and parts.rescue is not None
            else parts.config.signals.grace_s, f"exit after {type(exc).__name__}")
    forced = _peer_forced_code(parts)
    lost = lost or forced is not None
    o = Facts(Ending.PEER_LOST if lost else Ending.ERROR, parts.step, peer_forced_code=forced)
    if lost:
        if forced is None:
            log.error("a peer rank is gone (%s); leaving at step %d", first_line(exc), o.step)
            rescue(parts, "peer lost")
        else:   # the user forced a rank out: every rank leaves at once, no rescue wait
            log.info("no rescue: a rank was forced out with %d (%s)", forced, first_line(exc))
        if parts.exit_mode is ExitMode.EXIT and parts.rescue is not None:
            # The rescue's budget is spent or unused: the rest gets the usual grace.
            parts.handler.deadline.disarm()
            parts.handler.deadline.expect_exit(code, parts.config.signals.grace_s,
                                               f"exit after {type(exc).__name__}")
        requeue_after_failure(parts, "peer lost")
    close_rescue(parts, clean=False)       # its sockets and thread must not outlive the run
    _teardown(parts, peers_alive=not lost)
    # A bug keeps its traceback; a lost peer is one line and the code (but an in-process caller
    # in `raise` mode gets the exception itself either way).
    _leave(parts, o, error=exc, keep_traceback=not lost)


def give_up(parts: RunState, step: int, err: BaseException) -> NoReturn:
    """``checkpoint.max_failed_saves`` periodic saves in a row failed (on every rank alike): stop
    with CHECKPOINT_FAILED, without an emergency save that would fail the same way."""
    parts.hang.stop()
    close_rescue(parts)
    log.error("stopping at step %d: %s", step, err)
    _teardown(parts, peers_alive=True)
    _leave(parts, Facts(Ending.SAVES_FAILING, step))


def lease_lost(parts: RunState, step: int) -> NoReturn:
    """Another run took ``checkpoint.dir`` over (rank 0's lease, ``checkpoint/lease.py``):
    every rank stops at ``step`` with LEASE_LOST. No emergency save, no requeue (the holder goes
    on; running this one again would only fight it), and nothing more written into the
    directory: the run ledger is left alone (its ``exit`` event too), the lease not released."""
    parts.hang.stop()
    close_rescue(parts)
    # Rank 0's lease said so in its one error line; the other ranks learn it here.
    log.log(logging.INFO if parts.rank == 0 else logging.ERROR,
            "stopping at step %d: another run holds %s now (rank 0 lost its lease); nothing "
            "was saved and the job is not requeued", step, RunPaths.from_config(parts.config))
    parts.ledger = Ledger(None)         # the holder's ledger: not ours to write any more
    _teardown(parts, peers_alive=True)
    _leave(parts, Facts(Ending.LEASE_LOST, step))


def complete(parts: RunState, step: int) -> None:
    """All steps ran: cleanups, drain saves, report; the caller's code goes on."""
    close_rescue(parts)
    parts.teardown.run()
    if parts.ckpt is not None:
        parts.ckpt.close()
    record(parts, Facts(Ending.COMPLETED, step))


def requeue_after_failure(parts: RunState, why: str) -> Verdict | None:
    """Rank 0, under SLURM, with a committed checkpoint to come back to, within the restart
    budget: requeue now, since nobody else will (a local launcher sees the exit code). The
    failure's code stays its own (PEER_LOST, HANG): the verdict is logged, None when no
    requeue was tried."""
    if parts.slurm is None or parts.rank != 0 or parts.committed_step() is None:
        return None
    if parts.ckpt is not None and parts.ckpt.lease_lost:
        log.warning("%s: not requeued: another run holds %s now (this run lost its lease)",
                    why, parts.ckpt.paths)
        return None
    if os.environ.get(CHANNEL_ENV):
        # `kempner-resilience srun` (spare nodes) started this step: it relaunches the
        # training on a spare, or requeues the job itself, once every survivor has left.
        log.warning("%s: leaving the relaunch or requeue to the job's step loop", why)
        return None
    if _relaunch_in_place(why):
        return None
    try:
        verdict = _requeue_decision(parts)
    except Exception as e:      # never let the requeue attempt stop the exit
        log.error("%s: requeue failed: %s", why, e)
        return None
    log.warning("%s: %s", why, "job requeued" if verdict is Verdict.REQUEUED
                else f"not requeued ({verdict})")
    return verdict


def _relaunch_in_place(why: str) -> bool:
    """Under a torchrun agent with in-job restarts left and a standby agent waiting (spare
    nodes, ``slurm/standby.py``), the agents restart the training on the survivors plus the
    spare from the checkpoint just committed: no requeue (it would end the allocation). Without
    a standby, the requeue as before."""
    from kempner_resilience.slurm.standby import live_standbys, relaunch_from_env

    relaunch = relaunch_from_env()
    if relaunch is None:
        return False
    spares = live_standbys(relaunch)
    if not spares:
        log.warning("%s: no standby node left for an in-job relaunch (%s): requeueing", why,
                    "rendezvous unreadable" if spares is None else "none waiting")
        return False
    log.warning("%s: not requeued: the torchrun agents relaunch the training in this job, a "
                "standby node (%s) taking the failed one's place (%d in-job restart(s) left)",
                why, ", ".join(spares), relaunch.restarts_left)
    return True


# ------------------------------------------------------------------------------ the steps

def _start_deadline(parts: RunState, decision: StopDecision) -> None:
    """The rank that got the signal armed its deadline then; the others start theirs now."""
    parts.hang.stop()            # from here the shutdown deadline governs
    if parts.handler.request is None:
        name = _name(decision.signum)
        end = time.monotonic() + parts.config.signals.grace_for(name)
        why = f"{name} on another rank"
        if parts.clock.fired:
            # Our own time-limit stop: the allocation's end bounds it, but a run that started
            # late (already past it) still gets what the save needs: SLURM's KillWait follows.
            now = time.monotonic()
            end = min(end, max(parts.clock.end, now + parts.clock.needed()))
            why = "the allocation's end"
        parts.handler.deadline.arm(end, why)


def _emergency_save(parts: RunState, step: int) -> Saved:
    """Budget: the shutdown deadline (the manager refuses a save measured not to fit)."""
    if parts.ckpt is None:
        return Saved.NOTHING
    from kempner_resilience.checkpoint import CheckpointError, SavePeerLost
    from kempner_resilience.checkpoint.lease import LeaseLost

    t0 = time.monotonic()
    try:
        info = parts.ckpt.emergency_save(step, deadline=parts.handler.deadline.deadline)
    except LeaseLost:           # raised on every rank: no failed save, another run's directory
        lease_lost(parts, step)
    except (CheckpointError, SavePeerLost, OSError) as e:
        # Expected (full disk, quota, I/O, a peer gone mid-save): the message names the cause.
        from kempner_resilience.core.faults import is_peer_failure

        parts.save_lost_peer = is_peer_failure(e)
        log.error("emergency checkpoint at step %d failed: %s", step, e)
        return Saved.FAILED
    except Exception as e:
        from kempner_resilience.core.faults import first_line, is_peer_failure

        if is_peer_failure(e):   # a rank left mid-save (forced out, killed): no bug, one line
            parts.save_lost_peer = True
            log.error("emergency checkpoint at step %d failed: a peer rank is gone (%s); the "
                      "previous committed checkpoint is intact", step, first_line(e))
        else:
            log.exception("emergency checkpoint at step %d failed; the previous committed "
                          "checkpoint is intact", step)
        return Saved.FAILED
    if info is None:
        return Saved.FAILED
    parts.timings["emergency_save_s"] = time.monotonic() - t0
    parts.saved(info)
    log.info("emergency checkpoint for step %d committed in %.2f s: %s", step,
             parts.timings["emergency_save_s"], getattr(info, "path", info))
    return Saved.COMMITTED


def _requeue(parts: RunState) -> Verdict:
    """Rank 0 decides (budget, scontrol with its own timeout); every rank learns its verdict
    through the store within what is left of the deadline."""
    mine = _requeue_decision(parts).value if parts.rank == 0 else None
    left = parts.handler.deadline.remaining()
    try:
        verdict = Verdict(parts.agreement.share_text("requeue_verdict", mine,
                                                     left if left is not None else 60.0))
    except Exception as e:  # rank 0 is gone or the store timed out: the checkpoint is safe
        log.error("did not learn rank 0's requeue verdict (%s)", e)
        return Verdict.UNHEARD
    if verdict is Verdict.REQUEUED:
        parts.trackers.preempting()    # a W&B run on another rank (rank 0 told its own)
    return verdict


def _requeue_decision(parts: RunState) -> Verdict:
    from kempner_resilience.slurm import decide_requeue, requeue_job
    from kempner_resilience.slurm.badnodes import bad_nodes
    from kempner_resilience.slurm.requeue import RestartLedger

    ledger = None
    if parts.ckpt is not None:
        ledger = RestartLedger.for_checkpoint_dir(parts.ckpt.paths)
    who = parts.slurm if parts.slurm is not None else local_restart_count()
    verdict = decide_requeue(who, ledger, parts.committed_step(), parts.config.requeue)
    if not verdict.requeue:
        return verdict.verdict
    # Before the requeue: `scontrol requeue` SIGTERMs every task at once.
    parts.trackers.preempting()
    if parts.slurm is None:
        return Verdict.REQUEUED  # "run me again": the local launcher relaunches
    t0 = time.monotonic()
    # Every requeue of a run with recorded bad nodes keeps the job off them (slurm/badnodes.py).
    exclude = bad_nodes(parts.ckpt.paths) if parts.ckpt is not None else set()
    # The training's own step spans the nodes it needs; any other node of the job is a spare.
    result = requeue_job(parts.slurm, parts.config.requeue, exclude=exclude,
                         min_nodes=parts.slurm.nnodes)
    parts.timings["scontrol_requeue_s"] = time.monotonic() - t0
    if exclude:
        parts.ledger.event("exclude", bad_nodes=",".join(sorted(exclude)),
                           excluded=",".join(result.excluded), why=result.exclude_error)
    return result.verdict


def _peer_forced_code(parts: RunState) -> int | None:
    """The code another rank was forced out with (a repeated SIGTERM/SIGINT), if any."""
    forced = parts.agreement.forced_exit()
    if forced is None or forced[1] == parts.rank:
        return None
    code, rank = forced
    how = (f"a repeated {signal.Signals(code - 128).name}" if code - 128 in
           (signal.SIGINT, signal.SIGTERM) else "a repeated signal")
    # One line that says what happened, instead of the peer's lost link and the code's usual
    # meaning ("checkpoint committed"), which does not hold for a rank forced out.
    log.error("rank %d was forced out by %s (exit %d, no checkpoint of its own): this rank "
              "exits with %d too", rank, how, code, code)
    return code


def _teardown(parts: RunState, *, peers_alive: bool) -> None:
    """The user's cleanups (newest first), then ours; each bounded, all within the deadline."""
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
    parts.cleanup_results = results + builtin.run(deadline=deadline)
    parts.timings["teardown_s"] = time.monotonic() - t0
    # What may still block the interpreter's exit (a stuck executor task, a process group
    # with a dead member): in `raise` mode that exit stays bounded because of it.
    parts.left_behind = [r.name for r in parts.cleanup_results
                         if not r.ok and (r.error or "").startswith("timed out")]
    import torch.distributed as dist

    if not peers_alive and dist.is_available() and dist.is_initialized():
        parts.left_behind.append("the process group (a peer is gone)")


def _leave(parts: RunState, o: Facts, error: BaseException | None = None,
           keep_traceback: bool = False) -> NoReturn:
    code = record(parts, o)
    if not keep_traceback and o.peer_forced_code is None:   # else _peer_forced_code said it
        if o.ending is Ending.SIGNAL and o.saved is Saved.NOTHING:
            # The code's table text says "checkpoint committed": not true without state.
            log.warning("exiting with %s (%d): no state to checkpoint (ResilientRun without "
                        "state=)", exitcodes.ExitCode(code).name, code)
        else:
            log.warning("exiting with %s", exitcodes.describe(code))
    leaving.leave(parts.handler.deadline, code, parts.exit_mode,
                  parts.config.watchdog.exit_timeout_s, error, keep_traceback,
                  left_behind=parts.left_behind)


# ------------------------------------------------------------------------------ small helpers

def _stop_reason(parts: RunState, decision: StopDecision) -> str:
    if parts.clock.fired and parts.handler.request is None:
        return "time-limit"
    return _name(decision.signum)


def _action(parts: RunState, signum: int) -> Action:
    return parts.config.signals.actions.get(_name(signum), Action.STOP)


def _name(signum: int | None) -> str:
    return signal.Signals(signum).name if signum else "?"


def local_restart_count() -> int | None:
    """Restarts so far when a local launcher (the demo's) relaunches us; None if unknown."""
    value = os.environ.get("KEMPNER_RESTART_COUNT")
    return int(value) if value and value.isdigit() else None
