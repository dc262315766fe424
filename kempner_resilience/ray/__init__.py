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

The actor-loop shape (the loop inside each training actor), in five names:

```python
class Trainer(krr.TrainingActor):
    def train(self, steps):
        with self.resilient_run(state={"model": model, "optim": optim}) as run:
            for step in run.steps(steps): ...

class Rollout(krr.AsyncActor):
    async def run(self, n):
        return await self.main(krr.supervise_tasks(episode(i) for i in range(n)))

with krr.RayDriver(krr.load_config()) as driver:
    episodes = driver.track(ray.remote(Rollout).remote())[0].run.remote(50)
    results = driver.run_group(Trainer, 2, "train", 1000, cancel=[episodes])
```

``run_group`` forms the group (no address, port or ``init_group``), hands each actor the
driver's config and stop board, and re-forms it when an actor is lost. The earlier names
(``stop_context``, ``supervise``; ``TrainingActor.address``/``init_group`` warn) keep
working. docs/ray.md shows both shapes.

``ray.init(runtime_env=krr.warm_runtime_env())`` forks the Python workers on the driver's
node from one process that imported torch (with ``KEMPNER_RESILIENCE_WARM=1``): an actor, and
one that replaces a lost actor, is up in under a second.
"""

from __future__ import annotations

from kempner_resilience.config import ResilienceConfig, load_config
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.supervise.ray.actor import ActorEnding, stop_context
from kempner_resilience.supervise.ray.aio import AsyncActor, supervise_tasks
from kempner_resilience.supervise.ray.driver import RayDriver
from kempner_resilience.supervise.ray.group import GroupLost, Worker, WorkerGroup
from kempner_resilience.supervise.ray.relaunch import supervise
from kempner_resilience.supervise.ray.warm import warm_runtime_env
from kempner_resilience.run.ray_actor_run import TrainingActor
from kempner_resilience.run.ray_run import RayRun, supervise_loop

__all__ = ["RayRun", "WorkerGroup", "Worker", "GroupLost", "supervise_loop", "RayDriver",
           "TrainingActor", "AsyncActor", "ActorEnding", "stop_context", "supervise",
           "supervise_tasks", "warm_runtime_env", "load_config", "ResilienceConfig", "ExitCode"]
