"""``kempner-resilience check-resume``: does a script resume exactly? Found before the real job.

``check.py`` runs the script twice (``runs.py``: uninterrupted, then stopped at chosen steps and
relaunched) and compares the two runs' checkpoints step by step (``snapshot.py`` reads one,
``compare.py`` compares two); ``diagnose.py`` names the likely cause of the first difference,
``render.py`` words the report. The stops are raised by the run itself at the chosen steps
(``stop/rehearsal.py``), so a check gives the same verdict every time.
"""

from kempner_resilience.checkresume.check import CheckOptions, Outcome, Verdict, check_resume

__all__ = ["CheckOptions", "Outcome", "Verdict", "check_resume"]
