"""The way from "the loop must end" to "the process is gone", one step per line.

``stop`` is the path of a stop every rank agreed on (agreement.py; its reason a signal or the
allocation's end, ``stop/reason.py``):

    deadline → emergency save (checkpoint/) → requeue decision (slurm/requeue.py)
             → teardown (teardown.py) → record the ending (outcome.py) → leave (exit.py)

``fail`` is the path of an exception that ended the loop (a lost peer, or a bug), ``hang`` the
one of the hang watchdog's thread, ``give_up`` the one of periodic saves that keep failing,
``lease_lost`` the one of a run another run took ``checkpoint.dir`` over from (nothing saved,
nothing written there, never requeued), ``complete`` the normal end. Each step is a function of
``stages.py`` with its own time budget: the shutdown deadline armed by the first signal (or
here, for ranks that only agreed to someone else's), per-cleanup limits inside it, and
``watchdog.exit_timeout_s`` for the interpreter's exit after it. A step returns what it did;
the path notes it in the run's progress (its timings, its commit, its teardown) and builds the
ending's ``Facts`` from the results. Each path ends in ``record``: the ending noted, then the
exit code from the one table (``exitcodes.exit_code``), and the ledger, the trackers, the run
report and the supervisor told how the run ended (``outcome.py``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import NoReturn

from kempner_resilience import exitcodes
from kempner_resilience.config import Action, ExitMode
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.runpaths import RunPaths
from kempner_resilience.runstate import RunState
from kempner_resilience.shutdown import exit as leaving
from kempner_resilience.shutdown import outcome, stages
from kempner_resilience.shutdown.outcome import Ending, Facts, Saved, Verdict, exit_code
from kempner_resilience.shutdown.rescue import close_rescue, rescue
from kempner_resilience.shutdown.stages import TornDown
from kempner_resilience.stop.agreement import StopDecision
from kempner_resilience.supervise.rank import (local_restart_count, offered_relaunch,
                                               supervisor_decides)

__all__ = ["stop", "fail", "hang", "give_up", "lease_lost", "complete",
           "requeue_after_failure", "rescued", "record", "local_restart_count"]

log = get_logger(__name__)


# ------------------------------------------------------------------------------ the paths

def stop(state: RunState, decision: StopDecision) -> NoReturn:
    """Every rank stops at ``decision.step``: save, requeue, tear down, leave."""
    parts, progress = state.parts, state.progress
    reason, step = decision.reason, decision.step
    if decision.lease_lost:
        lease_lost(state, step)
    close_rescue(state)
    action, signum = stages.stop_action(parts.config, reason)
    log.warning("stopping at step %d (%s, action %s)", step, reason.word, action.value)
    req = parts.handler.request
    if req is not None:     # signal → every rank agreed on the step (this rank's signal)
        progress.took("agree_s", time.monotonic() - req.received_at)
    parts.ledger.event("stop", step=step, signal=reason.word,
                       signal_t=req.received_wall if req is not None else None)
    stages.start_deadline(state, reason)
    t0 = time.monotonic()
    save = stages.emergency_save(state, step)
    if save.lease_lost:
        lease_lost(state, step)
    if save.info is not None:
        progress.took("emergency_save_s", save.seconds or 0.0)
        state.saved(save.info)
    parts.ledger.event("emergency_save", step=step, saved=save.saved.name.lower(),
                       seconds=round(time.monotonic() - t0, 4))
    facts = Facts(Ending.SIGNAL, step, signum, save.saved)
    if action is Action.REQUEUE and save.saved is not Saved.FAILED:
        t0 = time.monotonic()   # the whole step: decision, scontrol, every rank told
        requeued = stages.requeue(state, state.committed_step())
        _note_scontrol(state, requeued)
        progress.took("requeue_s", time.monotonic() - t0)
        facts = replace(facts, requeue=requeued.verdict)
        parts.ledger.event("requeue", verdict=requeued.verdict.value,
                           code=int(exit_code(facts)),
                           seconds=round(progress.timings["requeue_s"], 4))
    facts = replace(facts, peer_forced_code=stages.peer_forced_code(state))
    # A rank forced out mid-shutdown is gone: tearing the group down would wait for it.
    done = _teardown(state, peers_alive=facts.peer_forced_code is None and not save.lost_peer)
    _leave(state, facts, done)


def fail(state: RunState, exc: BaseException) -> None:
    """An exception ended the loop. Returns (the caller re-raises it) only for the user's own
    error in ``raise`` mode; otherwise leaves with the outcome's code."""
    from kempner_resilience.core.faults import first_line, is_peer_failure

    parts = state.parts
    parts.hang.stop()
    lost = is_peer_failure(exc)
    code = int(exit_code(Facts(Ending.PEER_LOST if lost else Ending.ERROR)))
    if parts.exit_mode is ExitMode.EXIT:       # armed first: the store below may be gone too
        parts.handler.deadline.expect_exit(
            code, parts.config.rescue.budget_s if lost and parts.rescue is not None
            else parts.config.signals.grace_s, f"exit after {type(exc).__name__}")
    # Said first, before the rescue and the teardown: rank 0, when it lost this rank, may be
    # deciding now whether to requeue (no supervisor: supervise/endings.py).
    state.note_ending((Ending.PEER_LOST if lost else Ending.ERROR).value, code)
    forced = stages.peer_forced_code(state)
    lost = lost or forced is not None
    facts = Facts(Ending.PEER_LOST if lost else Ending.ERROR, state.step,
                  peer_forced_code=forced)
    if lost:
        left = stages.peers_left(state) if forced is None else {}
        if left:
            log.error("%s; leaving at step %d", "; ".join(
                f"rank {r} left run.steps at step {s}" for r, s in sorted(left.items())),
                facts.step)
        elif forced is None:
            log.error("a peer rank is gone (%s); leaving at step %d", first_line(exc),
                      facts.step)
        if forced is None:
            rescued(state, "peer lost")
        else:   # the user forced a rank out: every rank leaves at once, no rescue wait
            log.info("no rescue: a rank was forced out with %d (%s)", forced, first_line(exc))
        if parts.exit_mode is ExitMode.EXIT and parts.rescue is not None:
            # The rescue's budget is spent or unused: the rest gets the usual grace.
            parts.handler.deadline.disarm()
            parts.handler.deadline.expect_exit(code, parts.config.signals.grace_s,
                                               f"exit after {type(exc).__name__}")
        if forced is None:   # no supervisor: a peer's own ending ends the job
            facts = replace(facts, peer_code=stages.peers_code(state))
        if facts.peer_code is None:
            requeue_after_failure(state, "peer lost")
    close_rescue(state, clean=False)       # its sockets and thread must not outlive the run
    done = _teardown(state, peers_alive=not lost)
    # A bug keeps its traceback; a lost peer is one line and the code (but an in-process caller
    # in `raise` mode gets the exception itself either way).
    _leave(state, facts, done, error=exc, keep_traceback=not lost)


def hang(state: RunState) -> int:
    """The hang watchdog's thread, before its exit, the main thread stuck or held: first the
    rescue (survivors write the last step boundary), then, with no supervisor, the ranks'
    endings (a peer that raised or left ``run.steps`` while this rank waited for it in a
    collective, as NCCL does: the job leaves with the peer's code, not requeued), then the
    requeue (rank 0, under SLURM, with a committed checkpoint, within the budget), then the
    ending recorded as every other one is. Returns the code the process exits with (HANG, or
    the job's code from a peer's own ending). Its backstop bounds this."""
    # Said first: rank 0, hung in the same collective, reads it before it decides.
    state.note_ending(Ending.HANG.value, int(exitcodes.ExitCode.HANG))
    rescued(state, "hang")
    peer = stages.peers_code(state, own=exitcodes.ExitCode.HANG)
    verdict = requeue_after_failure(state, "hang") if peer is None else None
    return record(state, Facts(Ending.HANG, state.step, requeue=verdict, peer_code=peer))


def give_up(state: RunState, step: int, err: BaseException) -> NoReturn:
    """``checkpoint.max_failed_saves`` periodic saves in a row failed (on every rank alike): stop
    with CHECKPOINT_FAILED, without an emergency save that would fail the same way."""
    state.parts.hang.stop()
    close_rescue(state)
    log.error("stopping at step %d: %s", step, err)
    done = _teardown(state, peers_alive=True)
    _leave(state, Facts(Ending.SAVES_FAILING, step), done)


def lease_lost(state: RunState, step: int) -> NoReturn:
    """Another run took ``checkpoint.dir`` over (rank 0's lease, ``checkpoint/lease.py``):
    every rank stops at ``step`` with LEASE_LOST. No emergency save, no requeue (the holder goes
    on; running this one again would only fight it), and nothing more written into the
    directory: the run ledger is disowned (its ``exit`` event too), the lease not released."""
    parts = state.parts
    parts.hang.stop()
    close_rescue(state)
    # Rank 0's lease said so in its one error line; the other ranks learn it here.
    log.log(logging.INFO if state.rank == 0 else logging.ERROR,
            "stopping at step %d: another run holds %s now (rank 0 lost its lease); nothing "
            "was saved and the job is not requeued", step, RunPaths.from_config(parts.config))
    parts.ledger.disown()         # the holder's ledger: not ours to write any more
    done = _teardown(state, peers_alive=True)
    _leave(state, Facts(Ending.LEASE_LOST, step), done)


def complete(state: RunState, step: int, *, left_early: bool = False) -> None:
    """All steps ran, or the script left ``run.steps`` early without a stop (``left_early``):
    cleanups, drain saves, report; the caller's code goes on."""
    if left_early:
        # Said first, before this rank's sockets close: a peer still in the loop then names
        # this rank and its step instead of "a peer is gone" (stages.peers_left).
        state.note_ending(Ending.LEFT_EARLY.value, 0)
        log.info("left run.steps at step %d without a stop: ranks still in the loop will lose "
                 "this rank", step)
    close_rescue(state)
    state.parts.teardown.run()
    if state.parts.ckpt is not None:
        state.parts.ckpt.close()
    record(state, Facts(Ending.LEFT_EARLY if left_early else Ending.COMPLETED, step))
    state.parts.agreement.release()


def record(state: RunState, facts: Facts) -> int:
    """The run ends with ``facts``: noted in its progress first (a forced exit meanwhile then
    knows it comes too late), then recorded (``outcome.record``). Returns the code."""
    state.progress.ended(facts)
    return outcome.record(state, facts)


def rescued(state: RunState, why: str) -> None:
    """The rescue step (``rescue.py``), its result noted: its time, and a committed rescue as
    the checkpoint a requeue comes back to."""
    result = rescue(state, why)
    if result is None:
        return
    state.progress.took("rescue_s", result.seconds)
    if result.info is not None:
        state.saved(result.info)


def requeue_after_failure(state: RunState, why: str) -> Verdict | None:
    """Rank 0, under SLURM, with a committed checkpoint to come back to, within the restart
    budget: requeue now, since nobody else will (a local launcher sees the exit code). The
    failure's code stays its own (PEER_LOST, HANG): the verdict is logged, None when no
    requeue was tried."""
    parts = state.parts
    if parts.slurm is None or state.rank != 0:
        return None
    if parts.ckpt is not None and parts.ckpt.lease_lost:
        log.warning("%s: not requeued: another run holds %s now (this run lost its lease)",
                    why, RunPaths.from_config(parts.config))
        return None
    if supervisor_decides():
        # `kempner-resilience srun` (spare nodes) started this step: it relaunches the
        # training on a spare, or requeues the job itself, once every survivor has left. (A
        # torchrun agent's private channel is no such supervisor: below.)
        log.warning("%s: leaving the relaunch or requeue to the job's step loop", why)
        return None
    if _relaunch_in_place(why):
        return None
    own = exitcodes.ExitCode.HANG if why == "hang" else exitcodes.ExitCode.PEER_LOST
    try:
        # The policy weighs no requeue without a committed checkpoint to come back to.
        requeued = stages.requeue_decision(state, state.committed_step(), int(own))
    except Exception as e:      # never let the requeue attempt stop the exit
        log.error("%s: requeue failed: %s", why, e)
        return None
    if requeued is None:
        return None
    _note_scontrol(state, requeued)
    verdict = requeued.verdict
    log.warning("%s: %s", why, "job requeued" if verdict is Verdict.REQUEUED
                else f"not requeued ({verdict})")
    return verdict


def _relaunch_in_place(why: str) -> bool:
    """Under a torchrun agent with in-job restarts left and a standby agent waiting (spare
    nodes, ``supervise/torchrun/standby.py``), the agents restart the training on the survivors plus the
    spare from the checkpoint just committed: no requeue (it would end the allocation). Without
    a standby, the requeue as before."""
    from kempner_resilience.supervise.torchrun.standby import live_standbys

    relaunch = offered_relaunch()
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


# ------------------------------------------------------------------------------ composing

def _note_scontrol(state: RunState, requeued: stages.Requeued) -> None:
    if requeued.scontrol_s is not None:
        state.progress.took("scontrol_requeue_s", requeued.scontrol_s)


def _teardown(state: RunState, *, peers_alive: bool) -> TornDown:
    done = stages.teardown(state, peers_alive=peers_alive)
    state.progress.tore_down(done.results)
    state.progress.took("teardown_s", done.seconds)
    return done


def _leave(state: RunState, facts: Facts, done: TornDown, error: BaseException | None = None,
           keep_traceback: bool = False) -> NoReturn:
    parts = state.parts
    code = record(state, facts)
    if not keep_traceback and facts.peer_forced_code is None:   # else peer_forced_code said it
        if facts.ending is Ending.SIGNAL and facts.saved is Saved.NOTHING:
            # The code's table text says "checkpoint committed": not true without state.
            log.warning("exiting with %s (%d): no state to checkpoint (ResilientRun without "
                        "state=)", exitcodes.ExitCode(code).name, code)
        else:
            log.warning("exiting with %s", exitcodes.brief(code))
    leaving.leave(parts.handler.deadline, code, parts.exit_mode,
                  parts.config.watchdog.exit_timeout_s, error, keep_traceback,
                  left_behind=done.left_behind)
