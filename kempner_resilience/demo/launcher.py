"""The demo's use of the local launcher (``supervise/local/launcher.py``): the trainer's command line.

``LocalLauncher``, ``Launch`` and ``free_port`` live in ``kempner_resilience.supervise.local.launcher``
(``kempner-resilience launch`` runs a user's script with them); they are importable from here
as well, as before.
"""

from __future__ import annotations

import sys
from pathlib import Path

from kempner_resilience.supervise.local.launcher import (RELAUNCH_CODES, Launch, LocalLauncher,
                                                   free_port)

__all__ = ["Launch", "LocalLauncher", "free_port", "train_command", "RELAUNCH_CODES"]


def train_command(steps: int, *, step_time: float, out: Path, overrides: list[str],
                  hang_at: int = -1) -> list[str]:
    cmd = [sys.executable, "-m", "kempner_resilience.demo.train", "--steps", str(steps),
           "--step-time", str(step_time), "--out", str(out), "--quiet"]
    for o in overrides:
        cmd += ["--set", o]
    if hang_at >= 0:
        cmd += ["--hang-at", str(hang_at)]
    return cmd
