"""Everything a Ray job needs, in one module: ``import kempner_resilience.ray as krr``.

The driver-loop shape (SkyRL's, verl's, OpenRLHF's trainer: the loop in the driver, passive
worker groups):

```python
import kempner_resilience.ray as krr

policy = krr.WorkerGroup(PolicyWorker, 2)              # PolicyWorker(krr.Worker)
ref = krr.WorkerGroup(RefWorker, 1)
with krr.RayRun(krr.load_config(), state={"data": loader, "policy": policy,
                                          "ref": ref}) as run:
    for step in run.steps(total):
        ...                                            # generate, forward, update
```

``krr.supervise_loop(train)`` runs ``train`` again when a group is lost (the one policy).

The actor-loop shape (the loop inside each training actor): ``RayDriver``, ``TrainingActor``,
``AsyncActor``, ``supervise`` (a training group recreated after a loss) and
``supervise_tasks`` (an asyncio actor's work as one task group). docs/ray.md shows both.
"""

from __future__ import annotations

from kempner_resilience.config import ResilienceConfig, load_config
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.integrations.ray_actor import ActorEnding, TrainingActor, stop_context
from kempner_resilience.integrations.ray_aio import AsyncActor, supervise_tasks
from kempner_resilience.integrations.ray_driver import RayDriver
from kempner_resilience.integrations.ray_group import GroupLost, Worker, WorkerGroup
from kempner_resilience.integrations.ray_supervise import supervise
from kempner_resilience.run.ray_run import RayRun, supervise_loop

__all__ = ["RayRun", "WorkerGroup", "Worker", "GroupLost", "supervise_loop", "RayDriver",
           "TrainingActor", "AsyncActor", "ActorEnding", "stop_context", "supervise",
           "supervise_tasks", "load_config", "ResilienceConfig", "ExitCode"]
