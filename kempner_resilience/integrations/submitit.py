"""Moved to ``kempner_resilience.supervise.submitit.jobs``; this path keeps working."""

from kempner_resilience.supervise.submitit.jobs import *  # noqa: F401,F403
from kempner_resilience.supervise.submitit.jobs import __all__  # noqa: F401
