"""The one failure matrix, through the launch-side policy (``supervise/policy.py``): for each way
a job's ranks end, what the supervisor does next and the job's exit code.

Pure: each row is the evidence a backend gathers after a launch (the ranks' endings, the
committed step, the restart budget, the implicated nodes, the spares) and the answer.
"""

from __future__ import annotations

import signal

import pytest

from kempner_resilience.config import RequeueConfig
from kempner_resilience.exitcodes import RESCUED, RUN_AGAIN, ExitCode, Verdict
from kempner_resilience.supervise.policy import (Action, Commits, Evidence, Guard, Kind, RankEnd,
                                                 decide, requeue_evidence, reusable)

OK, ERR, HANG, REQ, LOST = 0, int(ExitCode.ERROR), int(ExitCode.HANG), \
    int(ExitCode.REQUEUE), int(ExitCode.PEER_LOST)


def exited(code: int) -> RankEnd:
    return RankEnd(code)


def killed(signum: int = signal.SIGKILL) -> RankEnd:
    return RankEnd(128 + signum, signaled=True)


def frozen() -> RankEnd:
    """A rank that never ended: the supervisor killed it after the grace."""
    return RankEnd(128 + signal.SIGKILL, signaled=True, by_supervisor=True)


COMMITTED = Commits(before=10, now=20)      # the launch committed a newer step
ROWS = {
    # name: (evidence, action, job code)
    "rank SIGKILLed, the survivor rescued and said 81": (
        Evidence((killed(), exited(LOST)), commits=COMMITTED), Action.RELAUNCH, LOST),
    "a node killed (both its ranks), a spare waits": (
        Evidence((exited(LOST), exited(LOST), killed(), killed()), commits=COMMITTED,
                 implicated=frozenset({"n2"}), spares=1), Action.RELAUNCH, LOST),
    "rank hung with the GIL held (its backstop: 42), the survivor lost it": (
        Evidence((exited(LOST), exited(HANG)), commits=COMMITTED), Action.RELAUNCH, HANG),
    "rank frozen (SIGSTOP) after the other's hang watchdog: killed after the grace": (
        Evidence((frozen(), exited(HANG)), commits=COMMITTED), Action.RELAUNCH, HANG),
    "rank 1's exception, seen by rank 0 as a lost peer": (
        Evidence((exited(LOST), exited(ERR)), commits=COMMITTED), Action.LEAVE, ERR),
    "rank 0 left run.steps early (exit 0), rank 1 lost it": (
        Evidence((exited(OK), exited(LOST)), commits=COMMITTED), Action.LEAVE, ERR),
    "rank 0 left run.steps early, rank 1 stuck until the grace": (
        Evidence((exited(OK), frozen()), commits=COMMITTED), Action.LEAVE, ERR),
    "a signal: every rank committed and asked to run again (75)": (
        Evidence((exited(REQ), exited(REQ)), commits=COMMITTED), Action.REQUEUE, REQ),
    "no spare left for the implicated node: the scheduler reruns it": (
        Evidence((killed(), exited(LOST)), commits=COMMITTED, implicated=frozenset({"n1"}),
                 spares=0), Action.REQUEUE, LOST),
    "the restart budget is spent: the job's code stays": (
        Evidence((killed(), exited(LOST)), commits=COMMITTED, restarts=3, max_restarts=3),
        Action.LEAVE, LOST),
    "the restart budget is spent after the ranks asked to run again: 77, not 75": (
        Evidence((exited(REQ), exited(REQ)), commits=COMMITTED, restarts=3, max_restarts=3),
        Action.LEAVE, int(ExitCode.NO_REQUEUE)),
    "the relaunches in place spent, the scheduler behind still requeues: its turn": (
        Evidence((killed(), exited(LOST)), commits=COMMITTED, restarts=1, max_restarts=1,
                 scheduler_left=True), Action.REQUEUE, LOST),
    "no progress: the committed step stayed over max_no_progress relaunches": (
        Evidence((killed(), exited(LOST)), commits=Commits(20, 20), restarts=2, stalled=1,
                 max_no_progress=2), Action.LEAVE, int(ExitCode.NO_REQUEUE)),
    "nothing ever committed: a fresh start loses nothing": (
        Evidence((killed(), exited(LOST)), commits=Commits(None, None)), Action.RELAUNCH, LOST),
    "another run took checkpoint.dir over, its peer lost it": (
        Evidence((exited(int(ExitCode.LEASE_LOST)), exited(LOST))), Action.LEAVE,
        int(ExitCode.LEASE_LOST)),
    "Ctrl+C: checkpointed and stopped": (
        Evidence((exited(130), exited(130)), stopping=True), Action.LEAVE, 130),
    "every rank killed on its own": (
        Evidence((killed(), killed())), Action.RELAUNCH, 128 + signal.SIGKILL),
    "every rank finished": (Evidence((exited(OK), exited(OK))), Action.LEAVE, OK),
}


@pytest.mark.parametrize("name", list(ROWS))
def test_the_failure_matrix_decides_each_ending_and_its_job_code(name):
    evidence, action, code = ROWS[name]
    decision = decide(evidence)
    assert (decision.action, decision.code) == (action, code), decision.why


def test_a_rank_that_left_early_is_named_and_its_ending_is_not_called_a_node_failure():
    decision = decide(Evidence((exited(OK), exited(LOST), exited(LOST))))
    assert decision.kind is Kind.LEFT_EARLY and decision.left_early == (0,)
    assert "left run.steps early" in decision.why


def test_relaunches_without_a_newer_committed_step_are_counted_and_progress_resets_them():
    stalled = decide(Evidence((exited(LOST),), restarts=1, commits=Commits(20, 20),
                              max_no_progress=3))
    assert (stalled.action, stalled.stalled) == (Action.RELAUNCH, 1)
    moved = decide(Evidence((exited(LOST),), restarts=2, stalled=1, commits=Commits(20, 30),
                            max_no_progress=3))
    assert (moved.action, moved.stalled) == (Action.RELAUNCH, 0)
    spent = decide(Evidence((exited(LOST),), restarts=3, stalled=2, commits=Commits(20, 20),
                            max_no_progress=3))
    assert (spent.action, spent.code, spent.guard) == (Action.LEAVE, int(ExitCode.NO_REQUEUE),
                                                       Guard.NO_PROGRESS)


def test_every_backend_takes_its_restartable_endings_from_the_one_definition():
    from kempner_resilience.supervise.local import launcher as local
    from kempner_resilience.supervise.srun import taskends as steps
    from kempner_resilience.supervise.torchrun import spares as torchrun_spares

    rescued = {int(c) for c in RESCUED}
    assert set(steps.FAILURE_CODES) == set(torchrun_spares._RESCUED) == rescued
    assert set(local.RELAUNCH_CODES) == {int(c) for c in RUN_AGAIN} == rescued | {REQ}


# ------------------------------------------------------------------------ the scheduler's requeue

def requeue(ends, restarts=0, history=(), committed=20, **config):
    """The policy's answer for the scheduler's requeue: the run's requeue settings, SLURM's
    restart count, the committed step at each earlier requeue decision."""
    cfg = RequeueConfig(**{"max_no_progress": 0, **config})
    return decide(requeue_evidence(tuple(ends), cfg, restarts,
                                   None if history is None else list(history), committed))


@pytest.mark.parametrize("budget,restarts,runs_again", [
    (0, 0, False), (1, 0, True), (1, 1, False), ("unlimited", 10**5, True)])
def test_the_requeue_budget_comes_from_requeue_max_restarts(budget, restarts, runs_again):
    d = requeue((exited(LOST),), restarts=restarts, history=[20] * restarts, max_restarts=budget)
    assert d.runs_again is runs_again
    assert d.verdict is (Verdict.REQUEUED if runs_again else Verdict.BUDGET_SPENT)


def test_a_spent_requeue_budget_keeps_a_failure_s_code_and_gives_a_stop_77():
    failed = requeue((exited(HANG),), restarts=3, history=[20] * 3, max_restarts=3)
    asked = requeue((exited(REQ),), restarts=3, history=[20] * 3, max_restarts=3)
    assert (failed.action, failed.code) == (Action.LEAVE, HANG)
    assert (asked.action, asked.code) == (Action.LEAVE, int(ExitCode.NO_REQUEUE))
    assert "restart budget exhausted" in failed.why and "requeue.max_restarts=3" in failed.why


def test_a_requeue_with_nothing_committed_to_come_back_to_is_not_tried():
    d = requeue((exited(LOST),), committed=None)
    assert (d.action, d.code, d.guard, d.verdict) == (Action.LEAVE, LOST,
                                                      Guard.NOTHING_COMMITTED, None)


def test_a_run_that_cannot_see_its_checkpoints_is_requeued_without_the_commit_rule():
    assert requeue((exited(REQ),), history=None, committed=None).action is Action.REQUEUE


def test_requeue_enabled_false_never_requeues():
    d = requeue((exited(REQ),), enabled=False)
    assert (d.action, d.verdict) == (Action.LEAVE, Verdict.DISABLED)


def test_the_requeue_history_is_folded_into_the_one_no_progress_count():
    # 50, 80, 80, then 80 again: the third requeue in a row without a newer committed step.
    stuck = requeue((exited(REQ),), restarts=3, history=[50, 80, 80], committed=80,
                    max_no_progress=2)
    assert (stuck.action, stuck.code, stuck.verdict) == (
        Action.LEAVE, int(ExitCode.NO_REQUEUE), Verdict.NO_PROGRESS)
    moved = requeue((exited(REQ),), restarts=3, history=[50, 80, 80], committed=90,
                    max_no_progress=2)
    assert (moved.action, moved.stalled) == (Action.REQUEUE, 0)


def test_the_caller_s_relaunch_codes_run_again_within_the_budget_and_others_leave():
    codes = frozenset({LOST})
    again = decide(Evidence((exited(LOST),), max_restarts=2, relaunch_codes=codes))
    spent = decide(Evidence((exited(LOST),), restarts=2, max_restarts=2, relaunch_codes=codes))
    other = decide(Evidence((exited(HANG),), max_restarts=2, relaunch_codes=codes))
    assert [d.action for d in (again, spent, other)] == [Action.RELAUNCH, Action.LEAVE,
                                                         Action.LEAVE]


@pytest.mark.parametrize("end, warm", [
    (exited(OK), True),                                  # completed
    (exited(LOST), True),                                # a peer lost, rescued, its run ended
    (exited(REQ), True),                                 # stopped to run again
    (exited(int(ExitCode.SIGTERM)), True),               # stopped by a signal, saved
    (exited(HANG), False),                               # its own watchdog found it hung
    (RankEnd(HANG, by_supervisor=True), False),          # ended by its supervisor for silence
    (killed(), False),                                   # gone: the OOM killer, a node's death
    (killed(signal.SIGTERM), False),                     # killed by a signal, not a run's stop
])
def test_only_a_rank_whose_own_run_ended_it_may_serve_the_next_incarnation_warm(end, warm):
    assert reusable(end) is warm
