"""The one failure matrix, through the launch-side policy (``supervise/policy.py``): for each way
a job's ranks end, what the supervisor does next and the job's exit code.

Pure: each row is the evidence a backend gathers after a launch (the ranks' endings, the
committed step, the restart budget, the implicated nodes, the spares) and the answer.
"""

from __future__ import annotations

import signal

import pytest

from kempner_resilience.exitcodes import RESCUED, RUN_AGAIN, ExitCode
from kempner_resilience.supervise.policy import (Action, Commits, Evidence, Guard, Kind, RankEnd,
                                                 decide)

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
    from kempner_resilience.integrations import local, torchrun_spares
    from kempner_resilience.slurm import steps

    rescued = {int(c) for c in RESCUED}
    assert set(steps.FAILURE_CODES) == set(torchrun_spares._RESCUED) == rescued
    assert set(local.RELAUNCH_CODES) == {int(c) for c in RUN_AGAIN} == rescued | {REQ}
