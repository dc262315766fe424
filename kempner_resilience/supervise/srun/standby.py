"""The allocation's standby: one warm-start process per node, so a step's ranks start warm.

Every rank of an srun step would pay Python's start-up, ``import torch`` and DCP again (3-10 s).
The standby is one more srun step (``kr-standby``, ``--overlap``, one task per node, spares
included) whose task is the zygote of ``local/warm.py``: it imports torch once and forks a rank
whenever a training task's ``shim.py`` asks. What a warm rank shares with a cold one and what
differs: docs/slurm.md ("Warm ranks under srun").
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Sequence

from kempner_resilience.core.log import get_logger
from kempner_resilience.supervise.local import warm
from kempner_resilience.supervise.srun.step import end_step

__all__ = ["Standby", "SHIM"]

_log = get_logger("kempner_resilience.supervise.srun.relaunch")

#: The srun task of a warm rank (run as a file: it imports nothing of the package).
SHIM = str(Path(__file__).with_name("shim.py"))


class Standby:
    """The standby step (started by ``start``), the shim command (``wrap``), its end
    (``close``)."""

    def __init__(self, proc: subprocess.Popen[bytes], name: str, job_id: str) -> None:
        self.proc, self.name, self.job_id = proc, name, job_id

    @classmethod
    def start(cls, srun: Sequence[str], nodes: Sequence[str], job_id: str, restart: int,
              env: Mapping[str, str]) -> "Standby":
        # The socket name of this job attempt's standby on every node.
        name = f"kempner-resilience-standby-{os.getuid()}-{job_id}-{restart}"
        # The standby outlives what SLURM sends every step (its ranks get it and decide); its
        # own end is the step's cancel (SIGKILL after KillWait) or the job's.
        ignore = [int(getattr(signal, n)) for n in warm.STEP_SIGNALS]
        cmd = [*srun, "--overlap", "--no-kill", "--kill-on-bad-exit=0", "--job-name=kr-standby",
               f"--nodes={len(nodes)}", f"--ntasks={len(nodes)}", "--ntasks-per-node=1",
               f"--nodelist={','.join(nodes)}", *warm.listen_command(name, ignore=ignore)]
        _log.info("standby: warm ranks forked on every node (%s)", ",".join(nodes))
        proc = subprocess.Popen(cmd, env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        return cls(proc, name, job_id)

    def gone(self) -> str | None:
        """Why the standby step is over (its srun exited), or None while it runs."""
        code = self.proc.poll()
        return None if code is None else f"its srun exited with {code}"

    def wrap(self, command: Sequence[str]) -> list[str]:
        """``command`` as a warm rank's srun task."""
        return [sys.executable, "-S", SHIM, self.name, *command]

    def close(self) -> None:
        """End the standby step (bounded): its ranks, if any are left, die with it."""
        end_step(self.proc, self.job_id, "kr-standby")
