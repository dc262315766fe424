"""Moved to ``kempner_resilience.supervise.ray.relaunch``; this path keeps working."""

from kempner_resilience.supervise.ray.relaunch import (actor_ends, group_decision, group_evidence,
                                                       lost_nodes, recreates, supervise)

__all__ = ["supervise", "actor_ends", "lost_nodes", "group_decision", "group_evidence", "recreates"]
