"""``kempner-resilience check-resume``: does a script resume exactly? Found before the real job.

``check.py`` runs the script twice (``runs.py``: uninterrupted, then stopped at chosen steps and
relaunched) and compares the two runs' checkpoints step by step (``snapshot.py`` reads one,
``compare.py`` compares two); ``diagnose.py`` names the likely cause of the first difference,
``render.py`` words the report. The stops are raised by the run itself at the chosen steps
(``stop/rehearsal.py``), so a check gives the same verdict every time.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CheckOptions", "Outcome", "Verdict", "check_resume"]


def __getattr__(name: str) -> Any:
    # Loaded on first use: ``check.py`` imports torch (seconds), and the verb answers a wrong
    # command line (``options.py``, a submodule of this package) without it.
    if name in __all__:
        from kempner_resilience.checkresume import check

        return getattr(check, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
