"""Just-in-time rescue: after a peer dies or hangs, the surviving replicas write the state of
the last step boundary as a normal committed checkpoint, so a failure without warning costs one
step instead of a checkpoint interval (Just-in-time checkpointing, EuroSys 2024).

``boundary`` knows when the state is consistent and snapshots what else a step changes;
``link`` keeps each rank's snapshot on a buddy rank too; ``files`` coordinates the survivors on
the checkpoint directory; ``save`` writes the checkpoint; ``rescuer`` runs it all;
``replicas`` decides at start whether every rank holds the full state; ``sharded`` (HSDP) which
ranks hold the same shards, and gathers each shard from a surviving holder for the writer.
"""

from kempner_resilience.rescue.rescuer import RescueResult, Rescuer

__all__ = ["Rescuer", "RescueResult"]
