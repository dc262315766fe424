"""A training actor's run: the ResilientRun of an actor whose group the driver formed.

The actor-loop shape (the loop inside each training actor, a rank of one ResilientRun):

```python
class Trainer(krr.TrainingActor):
    def train(self, steps):
        model, optim = build()                             # the group is up
        with self.resilient_run(state={"model": model, "optim": optim}) as run:
            for step in run.steps(steps):
                train_step(model, optim, step)

with krr.RayDriver(cfg) as driver:
    results = driver.run_group(Trainer, 2, "train", 1000, cancel=[episodes])
```

The driver forms the group and hands each actor its config and stop board
(``supervise/ray/actor.py``: ``kr_setup``); ``resilient_run`` builds the run from them,
inside the stop context (the driver's stop, Ray's SIGTERM, the run's ``SystemExit`` caught),
so the user ships neither. It lives in the run layer because it builds a ResilientRun; the
rest of the actor's side is the library's.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Mapping

from kempner_resilience.supervise.ray import actor as ray_actor
from kempner_resilience.run.resilient import ResilientRun

__all__ = ["TrainingActor"]


class TrainingActor(ray_actor.TrainingActor):
    """Mixin for a Ray training actor class (``kempner_resilience.ray.TrainingActor``): the
    driver forms its group (``RayDriver.run_group``) and ``resilient_run`` is its run.

    After the ``with`` block the method goes on, whether the run completed or stopped:
    ``self.kr_ending`` says which (``code`` 0, or the run's exit code), and the driver reads it
    with the method's result.
    """

    @contextlib.contextmanager
    def resilient_run(self, state: Mapping[str, Any] | None = None,
                      **kwargs: Any) -> Iterator[ResilientRun]:
        """A ``ResilientRun`` over this actor's group with the driver's config (``kwargs`` as
        ResilientRun's), around which the driver's stop and Ray's SIGTERM are handled; the
        run's ending goes to ``self.kr_ending``."""
        if self.kr_config is None:
            raise RuntimeError(f"{type(self).__name__}.resilient_run: the actor has no group "
                               "yet; create the actors with driver.run_group(...), which forms "
                               "the group and hands over the run's config")
        with ray_actor.stop_context(self.kr_board) as ending:
            self.kr_ending = ending
            with ResilientRun(self.kr_config, state, **kwargs) as run:
                yield run
