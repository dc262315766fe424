"""Putting the job back in the queue, and deciding whether it should be.

Two separate jobs:

* ``scheduler_decision``: whether the scheduler may run the job again, asked of the one policy
  (``supervise/policy.py``: the restart budget, the no-progress guard, a committed checkpoint to
  come back to), with the restart record next to the checkpoints (``RestartLedger``) as its
  memory. It works the same outside SLURM (there a "requeue" decision means "exit with REQUEUE
  and let the local launcher relaunch").
* ``requeue_job``: ``scontrol requeue <id>`` with a time limit and retries. Call it only after the
  emergency checkpoint is committed: SLURM SIGTERMs every task of the job at once. With
  ``exclude`` (the run's recorded bad nodes, ``slurm/badnodes.py``) the requeued job's
  ``ExcNodeList`` gains them right after the requeue, so it never runs on them again.

Neither raises into the caller for an expected failure: they return a value carrying the
verdict (``exitcodes.Verdict``: requeued, or why not); the exit code is the one table's
(``exitcodes.exit_code``), never chosen here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from kempner_resilience.config import RequeueConfig
from kempner_resilience.exitcodes import ExitCode, Verdict
from kempner_resilience.core.fileio import load_json_bounded, write_atomic
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.runpaths import RunPaths
from kempner_resilience.slurm.badnodes import bad_nodes, exclude_for_requeue, requeue_excluding
from kempner_resilience.slurm.env import SlurmJob
from kempner_resilience.slurm.scontrol import ScontrolResult, run_scontrol
from kempner_resilience.supervise.policy import (Decision, Guard, RankEnd, decide,
                                                 requeue_evidence)

__all__ = ["RequeueResult", "requeue_job", "RestartLedger", "scheduler_decision",
           "decide_requeue", "REQUESTED"]

#: The ranks' ending when they stopped on a signal and asked to run again (75).
REQUESTED: tuple[RankEnd, ...] = (RankEnd(int(ExitCode.REQUEUE)),)

_log = get_logger(__name__)

# The restart record (``RunPaths.restarts``: restart count and committed step per attempt, for
# the budget and the no-progress guard) is not the run ledger (``RunPaths.ledger``).


# ------------------------------------------------------------------------ scontrol requeue

@dataclass(frozen=True)
class RequeueResult:
    """What ``requeue_job`` did: ``verdict`` REQUEUED on success, SCONTROL_FAILED otherwise."""

    ok: bool
    job_id: str
    message: str
    attempts: int
    returncode: int | None = None
    #: The nodes the requeued job is now kept off (empty: none asked, or the update failed).
    excluded: tuple[str, ...] = ()
    #: Why the exclusion asked for did not take (None: it did, or none was asked).
    exclude_error: str | None = None

    @property
    def verdict(self) -> Verdict:
        return Verdict.REQUEUED if self.ok else Verdict.SCONTROL_FAILED


def _fix_for(res: ScontrolResult, job_id: str) -> str:
    """A hint naming the fix for a failed ``scontrol requeue``."""
    text = (res.stderr + res.stdout).lower()
    if res.missing:
        return ("scontrol is not on PATH (common inside enroot/pyxis containers): bind-mount "
                "the host's scontrol, slurm.conf and munge socket into the container, or let "
                "the batch script requeue when the job exits with code "
                f"{int(ExitCode.REQUEUE_FAILED)}; until then resubmit the job by hand")
    if res.timed_out:
        return ("slurmctld did not answer: raise requeue.scontrol_timeout_s if the controller "
                f"is just slow, else resubmit the job by hand (`sbatch` again; job {job_id} is "
                "not requeued)")
    if "presently disabled" in text:
        return ("the job cannot be requeued: it was submitted with --no-requeue or the cluster "
                "sets JobRequeue=0 without --requeue; submit with `#SBATCH --requeue`")
    if "invalid job id" in text:
        return (f"slurmctld does not know job {job_id} (already finished, or a wrong id); for "
                "array tasks the id must be ARRAYJOBID_TASKID")
    if "access/permission denied" in text or "not authorized" in text:
        return "only the job's owner (or an operator) may requeue it; run as the job's user"
    return "resubmit the job by hand; see the scontrol message above"


def requeue_job(job: SlurmJob | str, config: RequeueConfig, *,
                exclude: Iterable[str] = (), min_nodes: int | None = None) -> RequeueResult:
    """Run ``scontrol requeue <job.requeue_id>`` (argument list, no shell) with a time limit.

    Retries ``config.retries`` extra times after a failure that may be transient (non-zero exit,
    hang); a missing binary or a job that cannot be requeued is not retried. Never raises for
    those failures: the result's ``message`` says what happened and how to fix it.

    ``exclude``: nodes the job must not run on again. Once requeued (pending: the only state in
    which SLURM lets its excluded nodes change, and it cannot start again while this process
    runs) its ``ExcNodeList`` gains them; a failed update is logged with its fix and leaves the
    requeue standing (``excluded`` empty, ``exclude_error`` says why). ``min_nodes``: the
    nodes the training needs (the rest are spares), so that the requeued job may ask for fewer
    nodes rather than never start (``badnodes.exclude_for_requeue``).
    """
    nodes = sorted(set(exclude))
    if nodes and isinstance(job, SlurmJob) and job.step_id in (None, "batch"):
        # The batch step is SIGKILLed at once on a requeue: both commands run in a step.
        both = requeue_excluding(job.requeue_id, nodes, min_nodes=min_nodes,
                                 timeout=float(config.scontrol_timeout_s))
        if both is not None and both.returncode not in (None, 3):
            _log.info("requeued job %s (with the exclusion: %s)", job.requeue_id,
                      "ok" if both.ok else both.describe())
            return RequeueResult(True, job.requeue_id, f"job {job.requeue_id} requeued", 1, 0,
                                 excluded=tuple(nodes) if both.ok else (),
                                 exclude_error=None if both.ok else both.describe())
        # The requeue itself failed (or scontrol did not run): the usual path, with retries.
    result = _requeue(job, config)
    if not result.ok or not nodes:
        return result
    res = exclude_for_requeue(result.job_id, set(nodes), min_nodes=min_nodes,
                              timeout=float(config.scontrol_timeout_s))
    if res is not None and res.ok:
        return dataclasses.replace(result, excluded=tuple(nodes))
    return dataclasses.replace(result, exclude_error=res.describe() if res else "not run")


def _requeue(job: SlurmJob | str, config: RequeueConfig) -> RequeueResult:
    job_id = job.requeue_id if isinstance(job, SlurmJob) else str(job)
    attempts = 0
    res: ScontrolResult | None = None
    for attempt in range(1 + max(0, int(config.retries))):
        attempts = attempt + 1
        res = run_scontrol(["requeue", job_id], float(config.scontrol_timeout_s))
        if res.ok:
            _log.info("requeued job %s (scontrol took %.2fs)", job_id, res.seconds)
            return RequeueResult(True, job_id, f"job {job_id} requeued", attempts, 0)
        out = res.stderr + res.stdout
        if "pending execution" in out:
            # SLURM requeued the job itself already (preemption with PreemptMode=REQUEUE hit
            # while we were checkpointing): the outcome we wanted.
            _log.info("job %s was already requeued by SLURM", job_id)
            return RequeueResult(True, job_id, f"job {job_id} already requeued by SLURM",
                                 attempts, res.returncode)
        permanent = res.missing or "presently disabled" in out
        _log.warning("requeue attempt %d failed: %s", attempts, res.describe())
        if permanent:
            break
        if attempt < config.retries:
            time.sleep(min(1.0 * (attempt + 1), 5.0))
    assert res is not None
    message = f"requeue of job {job_id} failed: {res.describe()}. Fix: {_fix_for(res, job_id)}"
    _log.error("%s", message)
    return RequeueResult(False, job_id, message, attempts, res.returncode)


# ------------------------------------------------------------------------ restart budget

@dataclass
class RestartLedger:
    """restart_count -> committed step at each requeue decision, in a small JSON file.

    The no-progress guard needs this history across restarts (each restart is a new process).
    Written atomically (``fileio.write_atomic``) by the one process that decides (rank 0).
    A ledger belonging to another job id (a fresh ``sbatch`` reusing the checkpoint directory)
    is started over.
    """

    path: Path
    job_id: str | None = None
    entries: dict[int, dict[str, Any]] = field(default_factory=dict)

    @classmethod
    def for_checkpoint_dir(cls, where: RunPaths | str | os.PathLike[str]) -> "RestartLedger":
        """The run's restart decisions (``where``: the run's ``RunPaths``; a directory path is
        still taken, as this class is public)."""
        return cls.load(RunPaths.of(where).restarts)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "RestartLedger":
        """Read the ledger; a missing or unreadable file gives an empty one (logged)."""
        p = Path(path)
        try:
            data = load_json_bounded(p)    # bounded: a FIFO or /dev/zero is unreadable
            entries = {int(k): dict(v) for k, v in data.get("restarts", {}).items()}
            return cls(p, data.get("job_id"), entries)
        except FileNotFoundError:
            return cls(p)
        except (OSError, ValueError, TypeError, AttributeError) as e:
            _log.warning("restart ledger %s unreadable (%s); starting a new one", p, e)
            return cls(p)

    def record(self, restart_count: int, committed_step: int | None, requeue: bool,
               job_id: str | None = None) -> None:
        """The decision at ``restart_count``: the committed step it saw, whether it requeued."""
        if job_id is not None and self.job_id is not None and job_id != self.job_id:
            self.entries.clear()
        if job_id is not None:
            self.job_id = job_id
        self.entries[int(restart_count)] = {"step": committed_step,
                                            "outcome": "requeue" if requeue else "no_requeue",
                                            "time": time.time()}

    def history(self, before: int, job_id: str | None = None) -> list[tuple[int, int | None]]:
        """(restart_count, step) of earlier decisions of this job, oldest first."""
        if job_id is not None and self.job_id is not None and job_id != self.job_id:
            return []
        return [(rc, e.get("step")) for rc, e in sorted(self.entries.items()) if rc < before]

    def save(self) -> None:
        """Atomic write: readers see the old or the new ledger, never half of one."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = {"version": 1, "job_id": self.job_id,
                "restarts": {str(k): v for k, v in sorted(self.entries.items())}}
        write_atomic(self.path, json.dumps(data, indent=1))


def scheduler_decision(ends: tuple[RankEnd, ...],
                       job_or_restart_count: SlurmJob | int | None,
                       ledger: RestartLedger | str | os.PathLike[str] | None,
                       committed_step: int | None,
                       config: RequeueConfig, *, save: bool = True) -> Decision:
    """The one policy's answer to "may the scheduler run this job again?"
    (``supervise.policy.requeue_evidence``), recorded in ``ledger`` and logged.

    ``ends``: how the ranks ended (``REQUESTED``: they stopped and asked to run again; a
    failure's code). ``job_or_restart_count``: the SlurmJob, or the restart count (a local
    launcher's), or None (then the number of earlier decisions in the ledger stands in for
    it). ``ledger``: a RestartLedger, a ledger file path, or None (no checkpoints to see: no
    no-progress guard, no committed-checkpoint rule). ``committed_step``: the newest committed
    checkpoint's step (None: none yet). Does not need SLURM. ``decision.verdict`` is the
    requeue step's; a decision with nothing committed (``Guard.NOTHING_COMMITTED``) weighed no
    requeue and is neither recorded nor logged (the caller says it in its words).
    """
    if ledger is not None and not isinstance(ledger, RestartLedger):
        ledger = RestartLedger.load(ledger)
    job_id = None
    if isinstance(job_or_restart_count, SlurmJob):
        restart_count = job_or_restart_count.restart_count
        job_id = job_or_restart_count.requeue_id
    elif job_or_restart_count is None:
        restart_count = len(ledger.entries) if ledger is not None else 0
    else:
        restart_count = int(job_or_restart_count)
    history = None if ledger is None else [s for _, s in ledger.history(restart_count, job_id)]
    decision = decide(requeue_evidence(ends, config, restart_count, history, committed_step))
    if decision.guard is Guard.NOTHING_COMMITTED:
        return decision
    if ledger is not None:
        ledger.record(restart_count, committed_step, decision.runs_again, job_id)
        if save:
            try:
                ledger.save()
            except OSError as e:  # the decision stands; only the history is lost
                _log.warning("could not write restart ledger %s: %s", ledger.path, e)
    log = _log.info if decision.runs_again else _log.warning
    log("restart decision: %s (%s)", "requeue" if decision.runs_again else "no_requeue",
        decision.why)
    return decision


def decide_requeue(job_or_restart_count: SlurmJob | int | None,
                   ledger: RestartLedger | str | os.PathLike[str] | None,
                   committed_step: int | None,
                   config: RequeueConfig, *, save: bool = True) -> Decision:
    """Deprecated: ``scheduler_decision(REQUESTED, ...)``, the policy's decision for ranks that
    asked to run again (``decision.runs_again``, ``decision.verdict``)."""
    warnings.warn("decide_requeue is deprecated: the one policy decides the requeue "
                  "(kempner_resilience.slurm.scheduler_decision)", DeprecationWarning,
                  stacklevel=2)
    return scheduler_decision(REQUESTED, job_or_restart_count, ledger, committed_step, config,
                              save=save)


def requeue_run(job: SlurmJob, paths: RunPaths, config: RequeueConfig,
                committed_step: int | None, *, ends: tuple[RankEnd, ...] = REQUESTED,
                exclude: Iterable[str] = (), min_nodes: int | None = None, before: Any = None
                ) -> tuple[Decision, RequeueResult | None]:
    """The job back to the queue on behalf of ranks that could not ask themselves (a
    supervisor after a failure: the srun step loop, the Ray driver), as rank 0 does it: when
    the policy says so for ``ends`` (``scheduler_decision`` over the run's restart record: a
    committed checkpoint to come back to, the restart budget, the no-progress guard), keeping
    ``exclude`` and the run's recorded bad nodes out of the requeued job. ``before`` (a
    callable) runs between the decision and the requeue: a requeue SIGKILLs the batch step at
    once, so whatever must outlive it is written there. The result is None when the decision
    was not to requeue."""
    decision = scheduler_decision(ends, job, RestartLedger.for_checkpoint_dir(paths),
                                  committed_step, config)
    if not decision.runs_again:
        return decision, None
    if before is not None:
        before()
    return decision, requeue_job(job, config, exclude=set(exclude) | bad_nodes(paths),
                                 min_nodes=min_nodes)
