"""Moved to ``kempner_resilience.supervise.ray.actor``; this path keeps working."""

from kempner_resilience.supervise.ray.actor import (ActorEnding, TrainingActor, actor_died,
                                                    actor_ends, init_group, stop_context)

__all__ = ["TrainingActor", "ActorEnding", "stop_context", "init_group", "actor_ends", "actor_died"]
