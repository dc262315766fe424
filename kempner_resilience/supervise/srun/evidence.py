"""A finished srun step as the one policy's evidence, with no I/O: each task's ending
(``task_ends``), the loop's state (``LoopState``) and the implicated nodes
(``StepReport.implicated``, with the ranks' hang marks)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kempner_resilience.supervise.srun.taskends import StepReport
from kempner_resilience.supervise.policy import KILLED, Commits, Evidence, RankEnd

__all__ = ["LoopState", "task_ends", "step_evidence"]


@dataclass(frozen=True)
class LoopState:
    """What the step loop knows beside the step itself."""

    relaunches: int = 0                   # relaunches in place before this step (its index)
    max_relaunches: int = 1               # --in-job-restarts, within requeue.max_restarts
    requeue_left: bool = False            # SLURM would still requeue the job: requeue.enabled
                                          # and SLURM_RESTART_COUNT < requeue.max_restarts
    committed_before: int | None = None   # the run's newest committed step when the step began
    committed_now: int | None = None      # ... and now (None: nothing committed)
    stalled: int = 0                      # the previous decision's ``Decision.stalled``
    max_no_progress: int = 0              # the run's requeue.max_no_progress (0: no guard)
    spares: int = 0                       # the allocation's nodes outside the step, not bad
    stopping: bool = False                # a signal came to the loop: no relaunch


def task_ends(report: StepReport, *, srun_code: int, ended_by_loop: bool,
              tasks_per_node: int) -> tuple[RankEnd, ...]:
    """Each task's ending (task r at index r), from srun's reports and how the step ended.

    srun reports bad endings only, so an unreported task exited 0, unless the loop ended the
    step (``ended_by_loop``, after a failure). Then a task on a silent or dead node died with
    it (SIGKILL, its own death), and a task on a node that reported its other tasks was stuck
    and ended by the loop (``by_supervisor``: a hang). If srun failed before any task reported
    (a launch error), every task ends with srun's status ``srun_code``."""
    ends: dict[int, RankEnd] = {}
    for e in report.ends:
        if e.code is None:
            continue
        for t in e.tasks:
            if 0 <= t < report.ntasks and t not in ends:     # srun's first word on a task
                ends[t] = RankEnd(e.code, signaled=e.signaled)
    named = any(e.code is not None or e.node_failure for e in report.ends)
    if not ended_by_loop and srun_code != 0 and not named:
        # srun failed on its own (it could not launch the step): its status is everyone's.
        own = RankEnd.from_returncode(srun_code)
        return tuple(ends.get(t, own) for t in range(report.ntasks))
    dead = {e.node for e in report.ends if e.node_failure}
    if ended_by_loop:
        dead |= set(report.nodes) - {e.node for e in report.ends if not e.node_failure}
    unreported = replace(KILLED, by_supervisor=True) if ended_by_loop else RankEnd(0)
    return tuple(ends[t] if t in ends
                 else KILLED if report.node_of(t, tasks_per_node) in dead else unreported
                 for t in range(report.ntasks))


def step_evidence(report: StepReport, state: LoopState, *, srun_code: int, ended_by_loop: bool,
                  hang_seen: set[int] | None = None, tasks_per_node: int = 1) -> Evidence:
    """The policy's evidence for a finished step: its tasks' endings (``task_ends``), the
    nodes it implicates (``StepReport.implicated`` with the ranks' hang marks ``hang_seen``)
    and the loop's ``state``. The loop's budget is of relaunches in place; SLURM stands behind
    it while its requeue budget lasts (``Evidence.scheduler_left``)."""
    ends = task_ends(report, srun_code=srun_code, ended_by_loop=ended_by_loop, tasks_per_node=tasks_per_node)
    return Evidence(ends, restarts=state.relaunches, max_restarts=state.max_relaunches,
                    commits=Commits(state.committed_before, state.committed_now),
                    stalled=state.stalled, max_no_progress=state.max_no_progress,
                    implicated=frozenset(report.implicated(hang_seen, tasks_per_node)),
                    spares=state.spares, stopping=state.stopping,
                    scheduler_left=state.requeue_left)
