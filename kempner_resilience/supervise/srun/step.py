"""One srun step of the relaunch loop (``relaunch.py``): start it, read srun's reports of its
tasks' ends as they come (passed on to the job's log), and end it early when waiting longer
only waits for a dead node: after a failure once the nodes that can still report have, or once
rank 0 said in the supervisor's channel that the run finished.

SLURM notices a dead node only after ``SlurmdTimeout`` (300 s in production); srun waits that long
for its tasks, and the step stays "completing" there. Ending the step here (srun killed, the step
cancelled) is what lets the loop relaunch on a spare within seconds and lets a finished job end.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from kempner_resilience.core.log import get_logger
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.supervise.srun.taskends import StepReport, parse_srun_line
from kempner_resilience.supervise.channel import Channel

__all__ = ["SrunStep", "StepResult", "FinishWatch", "end_step", "step_id", "SETTLE_S",
           "SETTLE_MAX_S", "END_STEP_S", "FINISHED_GRACE_S"]

_log = get_logger("kempner_resilience.supervise.srun.relaunch")

# After a failure ending, once every node that reported has reported all its tasks, this long
# without news and the step is over on every node that can still report: the silent ones are
# dead. The survivors report as they finish their rescue (srun's --kill-on-bad-exit SIGTERMs
# them at the first bad exit, their slurmstepd SIGKILLs them KillWait later).
SETTLE_S = 2.0
# Without news for this long the step is over whatever was reported (a survivor node that
# reported some of its tasks only: SLURM's KillWait, 30 s by default, has passed).
SETTLE_MAX_S = 45.0
# The ending of an old step (srun killed, the step cancelled) is bounded by this.
END_STEP_S = 10.0
# After rank 0 said that its run finished (exit code 0 in the channel), this long for the step
# to end by itself; then the step is ended here: srun may be waiting for a task on a dead node
# that SLURM has not noticed yet (SlurmdTimeout), while the training is over.
FINISHED_GRACE_S = 20.0


@dataclass
class StepResult:
    code: int                            # srun's exit status (ours when we ended it)
    report: StepReport
    first_bad_t: float | None = None     # wall time of srun's first bad task report
    ended_t: float | None = None         # wall time the step was over (srun gone)
    ended_by_us: bool = False
    finished: bool = False               # ended here after rank 0 said the run finished


@dataclass
class SrunStep:
    """One step: ``cmd`` (srun and its arguments, named ``kr-step-INDEX``) run with ``env`` on
    ``nodes``; ``run()`` returns when it is over, by itself or ended here."""

    cmd: Sequence[str]
    env: Mapping[str, str]
    nodes: list[str]
    tasks_per_node: int
    job_id: str
    index: int
    channel: Channel
    settle_s: float = SETTLE_S
    finished_grace_s: float = FINISHED_GRACE_S
    agents: bool = False                 # the tasks restart their own workers: a failure is
                                         # theirs, the step is never ended for it
    stopping: Callable[[], bool] = field(default=lambda: False)   # the job is being stopped
    launch: str | None = None            # the ranks' launch name in the channel (ranks_died)

    def run(self) -> StepResult:
        report = StepReport(list(self.nodes), len(self.nodes) * self.tasks_per_node)
        proc = subprocess.Popen(list(self.cmd), env=dict(self.env), stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, text=True, errors="replace")
        res = StepResult(0, report)
        last_news = [time.monotonic()]
        lock = threading.Lock()

        def read() -> None:
            assert proc.stderr is not None
            for line in proc.stderr:
                sys.stderr.write(line)
                sys.stderr.flush()
                end = parse_srun_line(line)
                if end is not None:
                    with lock:
                        report.add(end)
                        last_news[0] = time.monotonic()
                        if res.first_bad_t is None and report.failed:
                            res.first_bad_t = time.time()

        reader = threading.Thread(target=read, name="kr-srun-stderr", daemon=True)
        reader.start()
        finish = FinishWatch(self.channel, self.finished_grace_s)
        while proc.poll() is None:
            time.sleep(0.1)
            with lock:
                failed = report.failed and not self.stopping() and not self.agents
                quiet = time.monotonic() - last_news[0]
                done = report.complete or (quiet >= self.settle_s and
                                           report.heard_complete(self.tasks_per_node))
            if failed and not done:
                done = self._only_the_dead_left(report, lock)
            if failed and (done or quiet >= SETTLE_MAX_S):
                # The tasks that can still report have; the silent ones are on a dead node,
                # which SLURM may take SlurmdTimeout to notice. End the step now.
                end_step(proc, self.job_id, f"kr-step-{self.index}")
                res.ended_by_us = True
                break
            if not failed and finish.over():
                _log.warning("step %d: rank 0 finished the run %.0f s ago and the step has not "
                             "ended (a task on a node SLURM has not yet declared dead): ending "
                             "it, the job is done", self.index, self.finished_grace_s)
                end_step(proc, self.job_id, f"kr-step-{self.index}")
                res.finished = True
                break
        res.code = proc.wait()
        res.ended_t = time.time()
        reader.join(timeout=2.0)
        if res.finished:
            res.code = 0
        elif res.ended_by_us:
            res.code = int(ExitCode.PEER_LOST)
        return res

    def _only_the_dead_left(self, report: StepReport, lock: threading.Lock) -> bool:
        """Every task has reported its end but those of the ranks the survivors saw die
        without a word (their rescue links, ``Channel.ranks_died``): nothing is left to hear
        from, so the step ends without the settle (the survivors name the dead once their
        rescue is over, and exit after it)."""
        died = self.channel.ranks_died(self.launch) if self.launch is not None else set()
        if not died:
            return False
        with lock:
            return len(report.reported_tasks | died) >= report.ntasks


def end_step(proc: subprocess.Popen[Any], job_id: str, name: str) -> None:
    """The job's step ``name`` ended: its srun ``proc`` killed, then the step cancelled, each
    bounded by END_STEP_S."""
    step = step_id(job_id, name)
    proc.kill()
    try:
        proc.wait(timeout=END_STEP_S)
    except subprocess.TimeoutExpired:
        _log.error("srun (pid %d) did not exit after SIGKILL", proc.pid)
    if step is None:
        return
    # SLURM then forgets the step on the live nodes at once; on a dead node it stays
    # "completing" until SlurmdTimeout, which the next step's --overlap gets around.
    try:
        out = subprocess.run(["scancel", "--quiet", step], capture_output=True, text=True,
                             timeout=END_STEP_S, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as e:
        _log.warning("scancel %s failed (%s); going on without it", step, e)
        return
    if out.returncode:
        _log.info("scancel %s: %s", step, (out.stderr or out.stdout).strip())


def step_id(job_id: str, name: str) -> str | None:
    """JOB.STEP of the job's newest step named ``name``; an old step may still be listed,
    completing on a dead node."""
    try:
        out = subprocess.run(["squeue", "-h", "-s", "-j", job_id, "-o", "%i %j"],
                             capture_output=True, text=True, timeout=END_STEP_S,
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired):
        return None
    ids = [line.split()[0] for line in out.stdout.splitlines() if line.split()[1:] == [name]]
    return ids[-1] if ids else None


class FinishWatch:
    """Whether rank 0 said, in this launch, that its run finished (exit code 0) at least
    ``grace_s`` ago. A report already there at the launch is an earlier launch's and never
    counts; the channel is read at most once a second."""

    def __init__(self, channel: Channel, grace_s: float) -> None:
        self.channel, self.grace_s = channel, grace_s
        self.before = channel.read()
        self.seen: float | None = None       # monotonic time the finish was first read
        self.next = 0.0

    def over(self) -> bool:
        now = time.monotonic()
        if self.seen is None and now >= self.next:
            self.next = now + 1.0
            r = self.channel.read()
            if r is not None and r.code == 0 and r != self.before:
                self.seen = now
        return self.seen is not None and now - self.seen >= self.grace_s
