"""submitit's local controller as a supervisor on the one policy (``supervise/policy.py``).

submitit's own controller reruns a job's tasks only when one exits 144 (its requeue code): a
rank that rescued a lost peer and exited 81, or a rank killed beside it, ended the job without
its result. ``ResilientController`` (``local.py``) asks the policy instead after each launch.
Its evidence: each task's ``Popen.returncode``, the tasks it ended after the grace, and what
the ranks said in the channel (the run's directory, so its committed step, and its
``requeue.max_restarts`` and ``requeue.max_no_progress``). No submitit import: the failure
matrix runs it as is. One machine: no node is implicated, no spare needed; the controller is
the scheduler, so REQUEUE and RELAUNCH both start the tasks again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.supervise.channel import Channel, newest_commit
from kempner_resilience.supervise.policy import (Action, Commits, Decision, Evidence, RankEnd,
                                                 decide, ends_of)

__all__ = ["LOCAL_REQUEUE_CODE", "DEFAULT_MAX_RESTARTS", "task_ends", "Supervision"]

#: submitit's ``LOCAL_REQUEUE_RETURN_CODE``: a task's "run me again" to the local controller.
LOCAL_REQUEUE_CODE = 144
#: The restarts allowed when the run said nothing (no report yet: it died before it started):
#: submitit's own controller starts the tasks at most 6 times.
DEFAULT_MAX_RESTARTS = 5


def task_ends(codes: Sequence[int | None], killed: Sequence[int] = ()) -> tuple[RankEnd, ...]:
    """The policy's endings of the tasks' ``Popen.returncode`` (``policy.ends_of``), 144
    read as REQUEUE."""
    return ends_of(codes, killed, {LOCAL_REQUEUE_CODE: int(ExitCode.REQUEUE)})


@dataclass
class Supervision:
    """One local job's run-again decisions, launch after launch: the controller calls
    ``starting()`` before it starts the tasks and ``after(codes, killed)`` once they ended."""

    channel: Channel
    restarts: int = 0            # relaunches so far
    stalled: int = 0             # relaunches in a row without a newer commit (the policy's)
    before: int | None = None    # the committed step when this launch started

    def starting(self) -> None:
        """A launch starts: its committed step before (the no-progress guard's baseline)."""
        self.before = newest_commit(self.channel.run_paths())

    def evidence(self, codes: Sequence[int | None], killed: Sequence[int] = ()) -> Evidence:
        """The policy's evidence after a launch: the tasks' endings, the run's commits (None
        when no rank ever reported its run: the guard cannot apply), its budget and guard."""
        paths = self.channel.run_paths()
        commits = None if paths is None else Commits(self.before, newest_commit(paths))
        budget = self.channel.restart_limit(DEFAULT_MAX_RESTARTS)
        return Evidence(task_ends(codes, killed), restarts=self.restarts, max_restarts=budget,
                        commits=commits, stalled=self.stalled,
                        max_no_progress=self.channel.requeue_setting("max_no_progress", 2))

    def after(self, codes: Sequence[int | None], killed: Sequence[int] = ()) -> Decision:
        """The policy's decision after a launch; what it carries goes to the next one."""
        d = decide(self.evidence(codes, killed))
        self.stalled = d.stalled
        if d.action is not Action.LEAVE:
            self.restarts += 1
        return d
