"""The launch side's supervision: one policy (``policy.py``) that every launcher of ranks asks
whether a job runs again after its ranks ended, and with which exit code."""

from kempner_resilience.supervise.policy import (Action, Commits, Decision, Evidence, Guard, Kind,
                                                 RankEnd, decide, job_code)

__all__ = ["Action", "Commits", "Decision", "Evidence", "Guard", "Kind", "RankEnd", "decide",
           "job_code"]
