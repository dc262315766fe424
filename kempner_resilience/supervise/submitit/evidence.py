"""A local submitit job's evidence for the one policy (``supervise/policy.py``): the tasks'
return codes (144, submitit's requeue code, read as REQUEUE), the controller's kills and the
channel. The controller is the scheduler: REQUEUE and RELAUNCH both start the tasks again.
No submitit import: the failure matrix runs it as is.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kempner_resilience.config import RequeueConfig
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.supervise.channel import Channel, Progress
from kempner_resilience.supervise.policy import Action, Decision, Evidence, decide, ends_of

__all__ = ["LOCAL_REQUEUE_CODE", "DEFAULT_MAX_RESTARTS", "Supervision"]

#: submitit's ``LOCAL_REQUEUE_RETURN_CODE``: a task's "run me again" to the local controller.
LOCAL_REQUEUE_CODE = 144
#: The restarts allowed when the run said nothing (no report yet: it died before it started):
#: submitit's own controller starts the tasks at most 6 times.
DEFAULT_MAX_RESTARTS = 5
_DEFAULT = RequeueConfig(max_restarts=DEFAULT_MAX_RESTARTS)


@dataclass
class Supervision(Progress):
    """One local job's run-again decisions: the controller calls ``starting()`` before it
    starts the tasks and ``after(codes, killed)`` once they ended."""

    channel: Channel
    restarts: int = 0            # relaunches so far

    def evidence(self, codes: Sequence[int | None], killed: Sequence[int] = ()) -> Evidence:
        """The policy's evidence after a launch: the tasks' endings, the run's budget and the
        no-progress guard's evidence (none before a rank reported its run)."""
        limit = self.channel.requeue(_DEFAULT).restart_limit
        return Evidence(ends_of(codes, killed, {LOCAL_REQUEUE_CODE: int(ExitCode.REQUEUE)}),
                        restarts=self.restarts, max_restarts=limit, **self.guard())

    def after(self, codes: Sequence[int | None], killed: Sequence[int] = ()) -> Decision:
        """The policy's decision after a launch; what it carries goes to the next one."""
        d = self.carry(decide(self.evidence(codes, killed)))
        if d.action is not Action.LEAVE:
            self.restarts += 1
        return d
