"""The run a training script holds: ResilientRun, its set-up sequence, its state."""

# Scripts that took ResilientRun from this path when the run was one module (run.py) keep
# working.
from kempner_resilience.run.resilient import ResilientRun

__all__ = ["ResilientRun"]
