"""One failure matrix through every backend (issue 29): each way a job's ranks can end, told in
each backend's own words, gives the same decision (relaunch in place, requeue, leave) and the
same job code on each.

A row is one failure and, per backend, its NATIVE form: what that backend really sees.

- ``srun``: the step loop on spare nodes (``supervise/srun/relaunch.py``): srun's stderr lines (a node
  with no line is silent), whether the loop had to end the step itself (srun waits for a task
  that has not ended), the ranks' hang marks in the supervisor channel, the loop's budget and
  SLURM's; run through ``Relauncher._after_step`` with a constructed ``StepResult``.
- ``local``: the local launcher (``supervise/local/launcher.py``): each rank's ``Popen.returncode``
  (negative: killed by that signal), the ranks it killed after the grace, the launch's index;
  run through ``launch_evidence`` and the policy, as ``LocalLauncher.run`` does.

Every row but the no-progress one commits a newer checkpoint during the failed launch (the
survivors' rescue), so the no-progress guard (``requeue.max_no_progress`` 2, as rank 0 said)
stays out of the way; the budget and the spares are the rows' own.

- ``submitit``: submitit's local controller, ours (``supervise/submitit/local.py``): each
  task's ``Popen.returncode`` (144: submitit's requeue code), the tasks it killed after the
  grace, its restarts so far; the run's budget as rank 0 said it in the channel's run.json; run
  through ``Supervision`` (``supervise/submitit/evidence.py``), as the controller does.
- ``torchrun``: one torchrun agent (``supervise/torchrun/evidence.py``): its own node's
  workers' return codes, whether it was signalled, torch's restarts left, the standbys waiting;
  run through ``observe`` and the policy, as the agent's monitor does.

- ``rank0``: no supervisor (a plain ``srun python train.py``; submitit arrays): rank 0 after it
  lost a peer and rescued, with the endings its peers recorded in the run's directory (a rank
  that recorded none was killed), then the policy's requeue within the run's budget and guard
  (``supervise/endings.py``, ``slurm/requeue.scheduler_decision``), as
  ``shutdown/sequence.fail`` does. Its only way to run again is ``scontrol requeue``: the
  policy's RELAUNCH and REQUEUE alike.

- ``ray``: the Ray driver (``supervise/ray/relaunch.py``) after one incarnation of a
  training group: each training call's outcome as ``ray.get`` gives it (the actor's
  ``ActorEnding``; Ray's ``ActorDiedError`` for an actor whose process is gone, its message as
  Ray 2.60 writes it; ``RayTaskError`` for a call that raised), the ranks the driver killed after
  its bound, the endings the ranks recorded in the run's directory (``supervise/endings.py``;
  a process that exited 42 is only "gone" to Ray), the driver's signal, the restarts so far,
  each actor's Ray node and the nodes Ray holds alive after; run through ``endings_since``,
  ``actor_ends``, ``lost_nodes`` and ``group_decision``, as ``supervise`` does.
  Ray's exceptions are built without a running Ray (``import ray`` only).

submitit under SLURM has no column of its own: its batch script runs the srun step loop
(``supervise/submitit/slurm.py``), whose column is ``srun``; the slurm tests in
tests/test_submitit.py run two rows (an exception, a SIGKILL) on the real cluster.

Adding a backend (Ray next): write its native form's dataclass and a runner
``(native form, tmp_path) -> Decision``, add the runner to ``BACKENDS`` and the form to every
row's ``native`` (or the row and backend to ``NOT_APPLICABLE``, with why).
``test_every_row_is_told_to_every_backend_or_says_why_not`` holds a new backend to that.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest
import ray.exceptions
from ray.core.generated.common_pb2 import ActorDiedErrorContext, NodeDeathInfo

from kempner_resilience.checkpoint import layout
from kempner_resilience.config import load_config
from kempner_resilience.supervise.local.launcher import launch_evidence
from kempner_resilience.supervise.ray.actor import ActorEnding
from kempner_resilience.supervise.ray.relaunch import (actor_ends, group_decision,
                                                           lost_nodes)
from kempner_resilience.supervise.submitit.evidence import Supervision
from kempner_resilience.supervise.torchrun.evidence import implicated_here, observe
from kempner_resilience.supervise.srun.relaunch import Relauncher, StepResult
from kempner_resilience.supervise.srun.taskends import StepReport, parse_srun_line
from kempner_resilience.supervise.channel import Channel, RunReport, newest_commit
from kempner_resilience.config.schema import RequeueConfig
from kempner_resilience.slurm.env import SlurmJob
from kempner_resilience.slurm.requeue import RestartLedger, scheduler_decision
from kempner_resilience.supervise.endings import (RankEnding, endings_since, note_ending,
                                                  peer_decision)
from kempner_resilience.supervise.policy import Action, Commits, Decision, RankEnd, decide
from kempner_resilience.core.runpaths import RunPaths

BEFORE, RESCUED = 10, 20      # the committed step when the launch started, and after its rescue


# ------------------------------------------------------------------------ native forms

@dataclass(frozen=True)
class Srun:
    """A finished srun step as the step loop sees it."""

    lines: tuple[str, ...]                 # srun's stderr ("srun: error: n2: task 1: Killed")
    nodes: tuple[str, ...] = ("n1", "n2", "n3")   # the allocation, SLURM's order
    train: int = 2                         # the nodes the training runs on (the rest: spares)
    tasks_per_node: int = 1
    ended_by_loop: bool = False            # srun had not ended: the loop ended the step
    srun_code: int = 0                     # srun's own status (when it ended by itself)
    hang_seen: tuple[int, ...] = ()        # ranks whose hang watchdog said so in the channel
    relaunches: int = 0                    # relaunches in place before this step
    in_job_restarts: int = 1
    slurm_restart_count: int = 0           # SLURM_RESTART_COUNT: requeues before
    max_restarts: int = 20                 # the run's requeue.max_restarts, as rank 0 said
    stalled: int = 0                       # relaunches in a row before without a newer commit
    rescued: bool = True                   # the launch committed a newer step


@dataclass(frozen=True)
class Local:
    """A finished launch as the local launcher sees it."""

    codes: tuple[int, ...]                 # Popen.returncode per rank (-9: SIGKILLed)
    killed: tuple[int, ...] = ()           # ranks it killed after the grace
    index: int = 0                         # launches before this one
    max_launches: int = 10
    stalled: int = 0
    rescued: bool = True


@dataclass(frozen=True)
class Submitit:
    """A finished launch of a local submitit job's tasks, as our controller sees it."""

    codes: tuple[int, ...]                 # Popen.returncode per task (-9: SIGKILLed)
    killed: tuple[int, ...] = ()           # tasks it killed after the grace
    restarts: int = 0                      # starts of the tasks before this one
    max_restarts: int = 20                 # the run's requeue.max_restarts, as rank 0 said
    stalled: int = 0
    rescued: bool = True


@dataclass(frozen=True)
class Torchrun:
    """A failed worker group as one torchrun agent sees it: its own node's workers only."""

    codes: dict[int, int]                  # {global rank: return code} (-9: SIGKILLed)
    killed: tuple[int, ...] = ()           # ranks the agent killed at its deadline
    signalled: bool = False                # a signal reached the agent
    restarts_left: int = 1                 # torch's in-place restarts left (--max-restarts)
    max_restarts: int = 1
    standbys: int | None = 1               # standby agents waiting (spares)
    stalled: int = 0
    rescued: bool = True                   # the run's directory (rank 0's report) has a
                                           # newer commit than when the group started


@dataclass(frozen=True)
class Rank0:
    """Rank 0 without a supervisor, after it lost a peer (its own ending: 81) and rescued."""

    recorded: dict[int, tuple[str, int]]   # rank -> (kind, code) it recorded; absent: none
    world: int = 2
    restarts: int = 0                      # SLURM_RESTART_COUNT
    max_restarts: int | str = 20           # the run's requeue.max_restarts


@dataclass(frozen=True)
class Ray:
    """One incarnation of a training group as the Ray driver sees it once ``wait_group`` is
    back: rank r's call's outcome at index r."""

    outcomes: tuple[Any, ...]              # ActorEnding, or the exception ray.get raised
    killed: tuple[int, ...] = ()           # ranks whose actors the driver killed after its bound
    recorded: dict[int, tuple[str, int]] = field(default_factory=dict)
                                           # rank -> (kind, code) it recorded in the run's
                                           # directory before its process died (the hang path)
    driver_signal: int | None = None       # a signal the driver received (its own stop)
    nodes: tuple[str, ...] | None = None   # rank r's Ray node (None: one node per rank)
    alive: tuple[str, ...] | None = None   # Ray's live nodes after (None: every node, no more)
    restarts: int = 0                      # incarnations before this one
    max_restarts: int | str = 20           # the config's requeue.max_restarts
    stalled: int = 0
    rescued: bool = True


def _died(node_died: bool = False) -> ray.exceptions.ActorDiedError:
    """Ray's error for a call whose actor process is gone: a process that died or exited on
    its own (the raylet sees its socket close, whatever the exit code), or its node's death."""
    context = ActorDiedErrorContext(
        class_name="Trainer", actor_id=bytes(16), pid=4242,
        error_message="Worker unexpectedly exits with a connection error code 2. End of file. "
                      "Some common causes include: (1) the process was killed by the OOM "
                      "killer due to high memory usage, ...")
    if node_died:
        context = ActorDiedErrorContext(
            class_name="Trainer", actor_id=bytes(16),
            error_message="The actor died because its node has died. Node Id: b",
            node_death_info=NodeDeathInfo(reason=NodeDeathInfo.UNEXPECTED_TERMINATION,
                                          reason_message="health check failed"))
    return ray.exceptions.ActorDiedError(context)


def _raised(error: BaseException) -> ray.exceptions.RayTaskError:
    """Ray's error for a call whose method raised, as ``ray.get`` raises it."""
    return ray.exceptions.RayTaskError("Trainer.train", f"Traceback ...\n{error!r}",
                                       error).as_instanceof_cause()


def _commit(root: Path, step: int) -> None:
    path = layout.create_step_dir(RunPaths(root), step)
    (path / "__0_0.distcp").write_bytes(b"x")
    layout.write_manifest(path, {"format": layout.FORMAT, "step": step, "committed_at": step,
                                 "files": {"__0_0.distcp": {"size": 1, "crc32": 0x8CDC1683}}})


def through_srun(step: Srun, tmp_path: Path) -> Decision:
    run_dir = tmp_path / "run"
    _commit(run_dir, RESCUED if step.rescued else BEFORE)
    env = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": ",".join(step.nodes),
           "SLURM_NTASKS_PER_NODE": str(step.tasks_per_node),
           "SLURM_RESTART_COUNT": str(step.slurm_restart_count),
           "SLURM_SUBMIT_DIR": str(tmp_path)}
    loop = Relauncher(["python", "train.py"], len(step.nodes) - step.train,
                      load_config(None, []), step.in_job_restarts, environ=env)
    loop.channel.report(RunReport(str(run_dir), "r", RESCUED, None,
                                  {"max_restarts": step.max_restarts, "max_no_progress": 2}))
    loop._stalled = step.stalled
    for rank in step.hang_seen:
        loop.channel.note_hang_seen(f"{step.slurm_restart_count}.{step.relaunches}", rank)
    report = StepReport(list(step.nodes[:step.train]), step.train * step.tasks_per_node)
    for line in step.lines:
        end = parse_srun_line(line)
        assert end is not None, line
        report.add(end)
    result = StepResult(step.srun_code, report, ended_by_us=step.ended_by_loop)
    return loop._after_step(result, step.relaunches, BEFORE)[1]


def through_local(launch: Local, tmp_path: Path) -> Decision:
    return decide(launch_evidence(launch.codes, launch.killed, index=launch.index,
                                  max_launches=launch.max_launches, stalled=launch.stalled,
                                  commits=Commits(BEFORE, RESCUED if launch.rescued
                                                  else BEFORE)))


def through_submitit(launch: Submitit, tmp_path: Path) -> Decision:
    run_dir = tmp_path / "run"
    channel = Channel.for_job("7", environ={}, cwd=tmp_path / "logs")
    channel.report(RunReport(str(run_dir), "r", BEFORE, None,
                             {"max_restarts": launch.max_restarts, "max_no_progress": 2}))
    _commit(run_dir, BEFORE)
    supervision = Supervision(channel, restarts=launch.restarts, stalled=launch.stalled)
    supervision.starting()
    if launch.rescued:
        _commit(run_dir, RESCUED)
    return supervision.after(launch.codes, launch.killed)


def through_torchrun(group: Torchrun, tmp_path: Path) -> Decision:
    here = implicated_here(group.codes)
    return decide(observe(group.codes, signalled=group.signalled,
                          restarts_left=group.restarts_left, max_restarts=group.max_restarts,
                          standbys=group.standbys, node="this node" if here else None,
                          killed=group.killed, stalled=group.stalled, max_no_progress=2,
                          commits=Commits(BEFORE, RESCUED if group.rescued else BEFORE)))


def through_rank0(view: Rank0, tmp_path: Path) -> Decision:
    paths = RunPaths(tmp_path / "run")
    for rank, (kind, code) in view.recorded.items():
        note_ending(paths, "t", RankEnding(rank, kind, code, RESCUED))
    decision, _ = peer_decision(paths, "t", RankEnd(81), 0, view.world, wait_s=0.0)
    if decision.action is Action.LEAVE:
        return decision
    job = SlurmJob(job_id="7", restart_count=view.restarts)
    requeue = scheduler_decision((RankEnd(81),), job, RestartLedger.for_checkpoint_dir(paths),
                                 RESCUED, RequeueConfig(max_restarts=view.max_restarts))
    return decision if requeue.runs_again else requeue


def through_ray(group: Ray, tmp_path: Path) -> Decision:
    config = load_config(overrides=[f"checkpoint.dir={tmp_path / 'run'}",
                                    f"requeue.max_restarts={group.max_restarts}",
                                    "requeue.max_no_progress=2"])
    paths = RunPaths.from_config(config)
    _commit(paths.root, BEFORE)
    before, known = newest_commit(paths), set(paths.all_endings())
    if group.rescued:
        _commit(paths.root, RESCUED)
    for rank, (kind, code) in group.recorded.items():   # the incarnation's own token
        note_ending(paths, "incarnation", RankEnding(rank, kind, code, RESCUED))
    nodes = group.nodes or tuple(f"node-{r}" for r in range(len(group.outcomes)))
    ends = actor_ends(group.outcomes, group.killed,
                      driver_stopping=group.driver_signal is not None,
                      recorded=endings_since(paths, known, range(len(group.outcomes))))
    decision, _ = group_decision(ends, config, nodes=nodes,
                                 lost=lost_nodes(group.outcomes, group.killed, nodes),
                                 alive=set(nodes) if group.alive is None else group.alive,
                                 restarts=group.restarts, stalled=group.stalled,
                                 commits=Commits(before, newest_commit(paths)))
    return decision


#: backend -> runner of its native form.
BACKENDS: dict[str, Callable[[Any, Path], Decision]] = {
    "srun": through_srun,
    "local": through_local,
    "submitit": through_submitit,
    "torchrun": through_torchrun,
    "rank0": through_rank0,
    "ray": through_ray,
}


# ------------------------------------------------------------------------ the matrix

@dataclass(frozen=True)
class Row:
    action: Action
    code: int
    native: dict[str, Any] = field(default_factory=dict)   # backend -> its native form


def _err(node: str, tasks: str, what: str) -> str:
    return f"srun: error: {node}: {'tasks' if '-' in tasks else 'task'} {tasks}: {what}"


KILLED_BESIDE_A_SURVIVOR = (_err("n2", "1", "Killed"), _err("n1", "0", "Exited with exit code 81"))

ROWS: dict[str, Row] = {
    "every rank finished": Row(Action.LEAVE, 0, {
        "srun": Srun(()),
        "local": Local((0, 0)),
        "submitit": Submitit((0, 0)),
        "torchrun": Torchrun({0: 0, 1: 0}),
        "ray": Ray((ActorEnding(0), ActorEnding(0))),
    }),
    "a rank SIGKILLed, the survivor rescued and said 81": Row(Action.RELAUNCH, 81, {
        "srun": Srun(KILLED_BESIDE_A_SURVIVOR, ended_by_loop=True),
        "local": Local((81, -9)),
        "submitit": Submitit((81, -9)),
        "torchrun": Torchrun({0: 81, 1: -9}),
        "rank0": Rank0({}),
        # the actor's process SIGKILLed alone: its node answers, Ray holds it alive
        "ray": Ray((ActorEnding(81), _died())),
    }),
    "a node killed: it says nothing, its peers rescued and said 81": Row(Action.RELAUNCH, 81, {
        "srun": Srun((_err("n1", "0-1", "Exited with exit code 81"),), tasks_per_node=2,
                     ended_by_loop=True),
        "local": Local((81, 81, -9, -9)),
        "submitit": Submitit((81, 81, -9, -9)),
        # the survivor's agent: its own workers said 81; the dead node's agent died with it
        "torchrun": Torchrun({0: 81, 1: 81}),
        "rank0": Rank0({1: ("peer-lost", 81)}, world=4),
        # Ray marks the node dead; a live node beside the group's is the spare
        "ray": Ray((ActorEnding(81), ActorEnding(81), _died(node_died=True),
                    _died(node_died=True)), nodes=("a", "a", "b", "b"), alive=("a", "c")),
    }),
    "a rank hung with the GIL held: its kernel timer's 42, no hang mark": Row(
        Action.RELAUNCH, 42, {
            "srun": Srun((_err("n2", "1", "Exited with exit code 42"),
                          _err("n1", "0", "Exited with exit code 42")),
                         hang_seen=(0,), ended_by_loop=True),
            "local": Local((42, 42)),
            "submitit": Submitit((42, 42)),
            "torchrun": Torchrun({0: 42, 1: 42}),
            # both actors' processes exit 42, which Ray reports only as gone; rank 0's
            # watchdog ran in Python and recorded its hang first, rank 1's backstop wrote none
            "ray": Ray((_died(), _died()), recorded={0: ("hang", 42)}),
        }),
    "a rank frozen (SIGSTOP): ended by the supervisor after the grace": Row(
        Action.RELAUNCH, 42, {
            # rank 1 on n1 never ends; n1's other task and n2's did: the loop ends the step.
            "srun": Srun((_err("n2", "2-3", "Exited with exit code 42"),
                          _err("n1", "0", "Exited with exit code 42")),
                         tasks_per_node=2, hang_seen=(0, 2, 3), ended_by_loop=True),
            "local": Local((42, -9), killed=(1,)),
            "submitit": Submitit((42, -9), killed=(1,)),
            "torchrun": Torchrun({0: 42, 1: -9}, killed=(1,)),
            # rank 0's watchdog recorded its hang and exited 42 (to Ray: gone); rank 1's call
            # is still pending (ray.get's timeout) when the driver kills its actor
            "ray": Ray((_died(), ray.exceptions.GetTimeoutError("not ready")), killed=(1,),
                       recorded={0: ("hang", 42)}),
        }),
    "rank 1's exception, which rank 0 saw as a lost peer [81, 1]": Row(Action.LEAVE, 1, {
        "srun": Srun((_err("n1", "0", "Exited with exit code 81"),
                      _err("n2", "1", "Exited with exit code 1")), srun_code=1),
        "local": Local((81, 1)),
        "submitit": Submitit((81, 1)),
        "torchrun": Torchrun({0: 81, 1: 1}),
        "rank0": Rank0({1: ("error", 1)}),
        "ray": Ray((ActorEnding(81), _raised(ValueError("bad batch")))),
    }),
    "rank 0 left run.steps early [0, 81]": Row(Action.LEAVE, 1, {
        # srun ends by itself once rank 1 has: rank 0's silence is an exit 0.
        "srun": Srun((_err("n2", "1", "Exited with exit code 81"),), srun_code=81),
        "local": Local((0, 81)),
        "submitit": Submitit((0, 81)),
        "torchrun": Torchrun({0: 0, 1: 81}),
        "ray": Ray((ActorEnding(0), ActorEnding(81))),
    }),
    "a signal: every rank committed and asked to run again (75)": Row(Action.REQUEUE, 75, {
        "srun": Srun((_err("n1", "0", "Exited with exit code 75"),
                      _err("n2", "1", "Exited with exit code 75")), srun_code=75),
        "local": Local((75, 75)),
        # submitit's native requeue: ResilientJob turns a REQUEUE into its 144
        "submitit": Submitit((144, 144)),
        # the ranks' own time-limit stop (no signal at the agent)
        "torchrun": Torchrun({0: 75, 1: 75}),
        # Ray or its node sent SIGTERM (a drain, an eviction), not the driver: the actors
        # committed at one boundary and ended 143, which asks to run again
        "ray": Ray((ActorEnding(143), ActorEnding(143))),
    }),
    "no spare left for the node of the killed rank": Row(Action.REQUEUE, 81, {
        "srun": Srun(KILLED_BESIDE_A_SURVIVOR, nodes=("n1", "n2"), ended_by_loop=True),
        "torchrun": Torchrun({0: 81, 1: -9}, standbys=0),
        "ray": Ray((ActorEnding(81), _died(node_died=True)), nodes=("a", "b"), alive=("a",)),
    }),
    "the restart budget spent": Row(Action.LEAVE, 81, {
        # the relaunches in place and SLURM's requeues alike
        "srun": Srun(KILLED_BESIDE_A_SURVIVOR, ended_by_loop=True, relaunches=1,
                     in_job_restarts=1, slurm_restart_count=3, max_restarts=3),
        "local": Local((81, -9), index=9, max_launches=10),
        "submitit": Submitit((81, -9), restarts=3, max_restarts=3),
        "torchrun": Torchrun({0: 81, 1: -9}, restarts_left=0),
        "rank0": Rank0({}, restarts=3, max_restarts=3),
        "ray": Ray((ActorEnding(81), _died()), restarts=3, max_restarts=3),
    }),
    # One meaning of requeue.max_restarts (and of each launcher's own budget) everywhere:
    # torchrun's --max-restarts and Ray Train's max_failures, 0 = never run again.
    "a restart budget of 0: the first failure is not run again": Row(Action.LEAVE, 81, {
        "srun": Srun(KILLED_BESIDE_A_SURVIVOR, ended_by_loop=True, max_restarts=0),
        "local": Local((81, -9), max_launches=1),          # launch --max-restarts 0
        "submitit": Submitit((81, -9), max_restarts=0),
        "torchrun": Torchrun({0: 81, 1: -9}, restarts_left=0, max_restarts=0),
        "rank0": Rank0({}, max_restarts=0),
        "ray": Ray((ActorEnding(81), _died()), max_restarts=0),
    }),
    "a restart budget of 1: the first failure is run again": Row(Action.RELAUNCH, 81, {
        "srun": Srun(KILLED_BESIDE_A_SURVIVOR, ended_by_loop=True, max_restarts=1),
        "local": Local((81, -9), max_launches=2),
        "submitit": Submitit((81, -9), max_restarts=1),
        "torchrun": Torchrun({0: 81, 1: -9}, restarts_left=1, max_restarts=1),
        "rank0": Rank0({}, max_restarts=1),
        "ray": Ray((ActorEnding(81), _died()), max_restarts=1),
    }),
    "an unlimited restart budget after 50 restarts": Row(Action.RELAUNCH, 81, {
        "srun": Srun(KILLED_BESIDE_A_SURVIVOR, ended_by_loop=True, slurm_restart_count=50,
                     max_restarts=-1),                    # as rank 0 reports `unlimited`
        "local": Local((81, -9), index=50, max_launches=10**6),
        "submitit": Submitit((81, -9), restarts=50, max_restarts=-1),
        # torchrun's --max-restarts has no unlimited: a large number is its spelling
        "torchrun": Torchrun({0: 81, 1: -9}, restarts_left=10**6 - 50, max_restarts=10**6),
        "rank0": Rank0({}, restarts=50, max_restarts="unlimited"),
        "ray": Ray((ActorEnding(81), _died()), restarts=50, max_restarts="unlimited"),
    }),
    "a relaunch that committed nothing newer, the second in a row: no progress": Row(
        Action.LEAVE, 77, {
            "srun": Srun(KILLED_BESIDE_A_SURVIVOR, ended_by_loop=True, relaunches=1,
                         in_job_restarts=3, stalled=1, rescued=False),
            "local": Local((81, -9), index=1, stalled=1, rescued=False),
            "submitit": Submitit((81, -9), restarts=1, stalled=1, rescued=False),
            "torchrun": Torchrun({0: 81, 1: -9}, restarts_left=2, max_restarts=3, stalled=1,
                                 rescued=False),
            "ray": Ray((ActorEnding(81), _died()), restarts=1, stalled=1, rescued=False),
        }),
}

#: (row, backend) -> why that backend cannot meet that row.
NOT_APPLICABLE: dict[tuple[str, str], str] = {
    ("no spare left for the node of the killed rank", "local"):
        "one machine: no node to keep out, no spare to run on; it relaunches where it ran",
    ("no spare left for the node of the killed rank", "submitit"):
        "submitit's local executor runs one machine's tasks: no node to keep out, no spare to "
        "run on; it relaunches where it ran (under SLURM, submitit's tasks are srun's)",
}

_RANK0 = "rank 0 decides after it lost a peer, and only then"
NOT_APPLICABLE.update({
    ("every rank finished", "rank0"): _RANK0 + ": here no rank lost one",
    ("a rank hung with the GIL held: its kernel timer's 42, no hang mark", "rank0"):
        _RANK0 + ": a hang is its own path (the watchdog's), which requeues as before",
    ("a rank frozen (SIGSTOP): ended by the supervisor after the grace", "rank0"):
        _RANK0 + ": no supervisor ends a frozen rank; the hang watchdogs do",
    ("rank 0 left run.steps early [0, 81]", "rank0"):
        _RANK0 + ": rank 0 is the one that left; nobody requeues, srun's status is 81",
    ("a signal: every rank committed and asked to run again (75)", "rank0"):
        _RANK0 + ": a stop requeues through the ranks' own requeue step",
    ("no spare left for the node of the killed rank", "rank0"):
        "no spares without a supervisor: rank 0 always runs the job again by a requeue",
    ("a relaunch that committed nothing newer, the second in a row: no progress", "rank0"):
        "rank 0 stops requeueing (no_requeue, logged) but exits 81, and srun's status is the "
        "highest task code (a killed peer's 137): no process can make the job's code 77",
})

CASES = [(name, backend) for name, row in ROWS.items() for backend in BACKENDS
         if backend in row.native]


@pytest.mark.parametrize("name,backend", CASES, ids=[f"{b}: {n}" for n, b in CASES])
def test_each_backend_decides_each_row_the_same_with_the_same_job_code(name, backend,
                                                                      tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    row = ROWS[name]
    decision = BACKENDS[backend](row.native[backend], tmp_path)
    assert (decision.action, decision.code) == (row.action, row.code), decision.why


def test_every_row_is_told_to_every_backend_or_says_why_not():
    missing = [(name, backend) for name, row in ROWS.items() for backend in BACKENDS
               if backend not in row.native and (name, backend) not in NOT_APPLICABLE]
    assert missing == []
    assert all(name in ROWS and backend in BACKENDS for name, backend in NOT_APPLICABLE)

