"""How a run ends: the shutdown sequence, the outcome → exit code table, and leaving.

``sequence`` runs the steps (agreement's decision → emergency save → requeue → teardown),
``outcome`` decides the exit code in one place, ``exit`` leaves the process within its bound.
"""

from kempner_resilience.shutdown.outcome import Ending, Outcome, Saved, exit_code

__all__ = ["Ending", "Outcome", "Saved", "exit_code"]
