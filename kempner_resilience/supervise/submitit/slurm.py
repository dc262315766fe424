"""submitit's SLURM executor, supervised: with ``use_srun=False`` its batch script runs

    <python> -m kempner_resilience.cli srun --srun-args '--unbuffered --output <folder>/%j_%t_log.out
        --error <folder>/%j_%t_log.err' -- <python> -u -m submitit.core._submit <folder>

so a submitit job gets what a ``kempner-resilience sbatch`` job gets (the one policy after every
step, the channel, ``spares``), and its per-task logs stay where ``job.stdout()`` reads them.
An array is one ``sbatch --array`` of jobs, each with its own loop (logs ``%A_%a``, not ``%j``).
"""

from __future__ import annotations

import os
import shlex
import sys
from typing import Any

from submitit.core import utils
from submitit.slurm.slurm import SlurmExecutor

__all__ = ["ResilientSlurmExecutor", "is_slurm_executor"]


def is_slurm_executor(executor: Any) -> bool:
    """An ``AutoExecutor(cluster="slurm")`` or a ``SlurmExecutor``."""
    return isinstance(getattr(executor, "_executor", executor), SlurmExecutor)


class ResilientSlurmExecutor(SlurmExecutor):  # type: ignore[misc]
    """A ``SlurmExecutor`` whose batch script runs the training under ``kempner-resilience
    srun``. ``spares``: nodes of the allocation kept as spares (ask for ``nodes`` = training
    nodes + spares); ``in_job_restarts``: relaunches in place before a failure requeues the job
    (default: ``spares``)."""

    def __init__(self, folder: str | os.PathLike[str], max_num_timeout: int = 3,
                 max_pickle_size_gb: float = 1.0, python: str | None = None,
                 spares: int = 0, in_job_restarts: int | None = None) -> None:
        super().__init__(folder, max_num_timeout=max_num_timeout,
                         max_pickle_size_gb=max_pickle_size_gb, python=python)
        if spares < 0 or (in_job_restarts is not None and in_job_restarts < 0):
            raise ValueError(f"spares={spares}, in_job_restarts={in_job_restarts}: must be >= 0")
        self.spares = int(spares)
        self.in_job_restarts = in_job_restarts
        self.parameters["use_srun"] = False      # our loop runs srun
        self._array = False                      # an array's batch script is being written

    @classmethod
    def adopt(cls, executor: Any, spares: int = 0,
              in_job_restarts: int | None = None) -> "ResilientSlurmExecutor":
        """This executor with ``executor``'s folder, parameters and limits (an
        ``AutoExecutor(cluster="slurm")`` or a ``SlurmExecutor``; returned as is if ours)."""
        inner = getattr(executor, "_executor", executor)
        if isinstance(inner, cls):
            return inner
        ours = cls(inner.folder, max_num_timeout=inner.max_num_timeout,
                   max_pickle_size_gb=inner.max_pickle_size_gb, python=inner.python,
                   spares=spares, in_job_restarts=in_job_restarts)
        ours.parameters = dict(inner.parameters, use_srun=False)
        return ours

    def loop_command(self) -> list[str]:
        """The loop's command line, up to its ``--``: srun's options for submitit's per-task
        logs (the script's own ``srun`` line, which ``use_srun=False`` leaves out)."""
        paths = utils.JobPaths(folder=self.folder)
        # An array task's files are <array id>_<index>_<task>: submitit's names (its
        # _make_sbatch_string), which srun expands from %A and %a as sbatch does.
        name = (lambda p: str(p).replace("%j", "%A_%a")) if self._array else str
        logs = ["--unbuffered", "--output", name(paths.stdout)]
        if not self.parameters.get("stderr_to_stdout"):
            logs += ["--error", name(paths.stderr)]
        logs += list(self.parameters.get("srun_args") or ())
        cmd = [sys.executable, "-m", "kempner_resilience.cli", "srun", "--spares",
               str(self.spares), "--srun-args", shlex.join(logs)]
        if self.in_job_restarts is not None:
            cmd += ["--in-job-restarts", str(self.in_job_restarts)]
        return cmd

    @property
    def _submitit_command_str(self) -> str:
        # submitit's command (its python, -u -m submitit.core._submit <folder>) after ours.
        return " ".join([shlex.join(self.loop_command()), "--", super()._submitit_command_str])

    def _internal_process_submissions(self, delayed_submissions: list[Any]) -> list[Any]:
        if len(delayed_submissions) <= 1:
            return super()._internal_process_submissions(delayed_submissions)
        # submitit writes one batch script for the array from _submitit_command_str: the
        # flag gives its loop command the array's log names.
        self._array = True
        try:
            return super()._internal_process_submissions(delayed_submissions)
        finally:
            self._array = False
