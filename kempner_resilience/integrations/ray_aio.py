"""Moved to ``kempner_resilience.supervise.ray.aio``; this path keeps working."""

from kempner_resilience.supervise.ray.aio import (AsyncActor, supervise, supervise_tasks)

__all__ = ["supervise_tasks", "supervise", "AsyncActor"]
