"""How a run ends: the shutdown sequence, the recording of an ending, and leaving.

``sequence`` runs the steps (agreement's decision → emergency save → requeue → teardown) of
``steps``, each of which returns what it did, and notes their results in the run's progress;
``outcome`` records an ending (its code from the one table, ``exitcodes.exit_code``), ``exit``
leaves the process within its bound. It works on the run's state (``runstate/``), never on the
run itself: ``run/`` calls it, not the other way round.
"""

from kempner_resilience.shutdown.outcome import Ending, Facts, Saved, Verdict, exit_code

__all__ = ["Ending", "Facts", "Saved", "Verdict", "exit_code"]
