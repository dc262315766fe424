"""The run's state, shared by its set-up (``run/begin.py``), its loop (``run/resilient.py``)
and its shutdown (``shutdown/``): the parts built at set-up (frozen), the progress the run
makes (its own, behind a narrow API), and the two together. It imports neither ``run/`` nor
``shutdown/``, so those folders import it and never each other backwards."""

from kempner_resilience.runstate.parts import RunParts
from kempner_resilience.runstate.progress import Progress
from kempner_resilience.runstate.state import RunState

__all__ = ["RunParts", "Progress", "RunState"]
