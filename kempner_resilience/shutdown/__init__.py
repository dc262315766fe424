"""How a run ends: the shutdown sequence, the recording of an ending, and leaving.

``sequence`` runs the steps (agreement's decision → emergency save → requeue → teardown),
``outcome`` records an ending (its code from the one table, ``exitcodes.exit_code``), ``exit``
leaves the process within its bound.
"""

from kempner_resilience.shutdown.outcome import Ending, Facts, Saved, Verdict, exit_code

__all__ = ["Ending", "Facts", "Saved", "Verdict", "exit_code"]
