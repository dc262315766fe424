"""Moved to ``kempner_resilience.supervise.ray.group``; this path keeps working."""

from kempner_resilience.supervise.ray.group import (GroupLost, Worker, WorkerGroup)

__all__ = ["WorkerGroup", "Worker", "GroupLost"]
