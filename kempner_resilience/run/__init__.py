"""The run a training script holds: ResilientRun, its set-up sequence, its state."""

# `from kempner_resilience.run import ResilientRun` worked when the run was one module (run.py);
# scripts written then keep working.
from kempner_resilience.run.resilient import ResilientRun

__all__ = ["ResilientRun"]
