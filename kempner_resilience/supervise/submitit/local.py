"""submitit's local executor, supervised: ``ResilientController`` asks the one policy after
each launch (``evidence.py``) and kills the tasks left ``grace_s`` after one ended;
``ResilientLocalExecutor`` starts it; ``ResilientLocalJob._interrupt()`` signals the tasks, as
SLURM does (submitit's signals the controller, which dies of it). Run as a module it is the
controller: ``python -m kempner_resilience.supervise.submitit.local FOLDER [--grace S]``.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from submitit.core.utils import JobPaths
from submitit.local.local import Controller, LocalExecutor, LocalJob, LocalJobEnvironment

from kempner_resilience.core.log import get_logger, set_role
from kempner_resilience.core.procs import children
from kempner_resilience.supervise.submitit.evidence import Supervision
from kempner_resilience.supervise.channel import Channel
from kempner_resilience.supervise.local import warm
from kempner_resilience.supervise.policy import Action

__all__ = ["ResilientLocalJob", "ResilientLocalExecutor", "ResilientController",
           "interrupt_tasks", "local_task_pids", "is_local_executor", "DEFAULT_GRACE_S"]

log = get_logger("kempner_resilience.supervise.submitit.jobs")

#: After a task's end, the others' time to end before they are killed: above the hang
#: watchdog's timeout plus the rescue's budget, so that a survivor that sees its lost peer
#: only through its hang watchdog still commits its rescue (as ``launch``'s grace).
DEFAULT_GRACE_S = 60.0


class ResilientLocalJob(LocalJob):  # type: ignore[misc]
    """A ``submitit.LocalJob`` whose ``_interrupt()`` preempts the tasks, not the controller."""

    def _interrupt(self) -> None:
        interrupt_tasks(self)


def interrupt_tasks(job: Any) -> None:
    """Send submitit's preemption signal to every running task of the local ``job``, as SLURM
    sends it to every task."""
    pids = local_task_pids(job)
    if not pids:
        log.warning("local job %s has no running task to interrupt", job.job_id)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, LocalJobEnvironment._usr_sig())


def _proc(pid: int, name: str) -> bytes:
    try:
        return Path(f"/proc/{pid}/{name}").read_bytes()
    except OSError:
        return b""


def local_task_pids(job: Any) -> list[int]:
    """The running task processes of a local job: the controller's children (its
    grandchildren when a ``setup`` shell runs the controller) that carry a task id, or the
    children of its warm-start process (a fork's ``/proc`` environment is its parent's)."""
    proc = getattr(job, "_process", None)
    if proc is None or proc.poll() is not None:
        return []
    zygote = os.path.abspath(warm.__file__).encode()
    level = [proc.pid]
    for _ in range(3):        # the shell, the controller, the tasks or the warm-start process
        level = children(level)
        found = [c for c in level if b"\0SUBMITIT_LOCAL_GLOBALID=" in b"\0" + _proc(c, "environ")]
        found += children(c for c in level if zygote in _proc(c, "cmdline").split(b"\0"))
        if found:
            return found
    return []


def is_local_executor(executor: Any) -> bool:
    """``executor`` runs jobs on this machine with submitit's local controller
    (``AutoExecutor(cluster="local")`` or a ``LocalExecutor``)."""
    return isinstance(getattr(executor, "_executor", executor), LocalExecutor)


class ResilientLocalExecutor(LocalExecutor):  # type: ignore[misc]
    """A ``LocalExecutor`` whose jobs run under ``ResilientController`` (``grace_s``: see
    ``DEFAULT_GRACE_S``)."""

    def __init__(self, folder: str | os.PathLike[str], max_num_timeout: int = 3,
                 max_pickle_size_gb: float = 1.0, python: str | None = None,
                 grace_s: float = DEFAULT_GRACE_S) -> None:
        super().__init__(folder, max_num_timeout=max_num_timeout,
                         max_pickle_size_gb=max_pickle_size_gb, python=python)
        if not grace_s > 0:
            raise ValueError(f"grace_s={grace_s!r}: must be > 0")
        self.grace_s = float(grace_s)

    @classmethod
    def adopt(cls, executor: Any, grace_s: float = DEFAULT_GRACE_S) -> "ResilientLocalExecutor":
        """This executor with ``executor``'s folder, parameters and limits (an
        ``AutoExecutor(cluster="local")`` or a ``LocalExecutor``; returned as is if ours)."""
        inner = getattr(executor, "_executor", executor)
        if isinstance(inner, cls):
            return inner
        ours = cls(inner.folder, max_num_timeout=inner.max_num_timeout,
                   max_pickle_size_gb=inner.max_pickle_size_gb, python=inner.python,
                   grace_s=grace_s)
        ours.parameters = dict(inner.parameters)
        return ours

    def _submit_command(self, command: str) -> "ResilientLocalJob":
        # submitit's own, with our controller module (its start_controller names its own).
        p = self.parameters
        ntasks = p.get("tasks_per_node", 1)
        gpus = list(p.get("visible_gpus", ()) or range(p.get("gpus_per_node", 0)))
        setup = list(p.get("setup", ()))
        env = dict(os.environ, SUBMITIT_LOCAL_NTASKS=str(ntasks), SUBMITIT_LOCAL_COMMAND=command,
                   SUBMITIT_LOCAL_TIMEOUT_S=str(int(60 * p.get("timeout_min", 2.0))),
                   SUBMITIT_LOCAL_SIGNAL_DELAY_S=str(int(p.get("signal_delay_s", 30))),
                   SUBMITIT_LOCAL_NODEID="0", SUBMITIT_LOCAL_JOB_NUM_NODES="1",
                   SUBMITIT_STDERR_TO_STDOUT="1" if p.get("stderr_to_stdout") else "",
                   SUBMITIT_EXECUTOR="local", SUBMITIT_LOCAL_WITH_SHELL="1" if setup else "",
                   CUDA_VISIBLE_DEVICES=",".join(map(str, gpus[:p.get("gpus_per_node", 0)])))
        cmd: Any = [sys.executable, "-m", __name__, str(self.folder), "--grace",
                    repr(self.grace_s)]
        if setup:
            cmd = " && ".join(setup + [shlex.join(cmd)])
        process = subprocess.Popen(cmd, shell=bool(setup), env=env)
        return ResilientLocalJob(folder=self.folder, job_id=str(process.pid), process=process,
                                 tasks=list(range(ntasks)))


class ResilientController(Controller):  # type: ignore[misc]
    """submitit's local controller, with the one policy deciding whether the tasks start
    again."""

    def __init__(self, folder: Path, grace_s: float = DEFAULT_GRACE_S) -> None:
        super().__init__(folder)
        self.grace_s = grace_s
        self.killed: list[int] = []     # tasks this controller ended after the grace
        self.zygote: warm.Zygote | None = None     # the warm tasks' parent, while run() runs

    def run(self, max_retry: int = 0) -> None:
        """Launch until the policy says leave (``max_retry``: submitit's, unused)."""
        set_role("submitit controller")   # its own process, not a rank (its env may say RANK)
        # Started before the channel is in the environment: the stray sweep looks for it, and
        # the warm-start process is no stray.
        if warm.warm_command(self.command, (warm.UNBUFFERED,)):
            self.zygote = warm.Zygote(dict(os.environ))
        channel = self.open_channel()
        os.environ.update(channel.env())       # the tasks inherit the controller's environment
        supervision = Supervision(channel)
        try:
            while True:
                supervision.starting()
                channel.begin_launch(supervision.restarts)   # the tasks' restart count
                try:
                    self.start_tasks()
                    codes = self.wait()
                finally:
                    self.kill_tasks()
                d = supervision.after(codes, self.killed)
                ranks = f"tasks ended {list(codes)}" + (
                    f" (killed after the grace: {self.killed})" if self.killed else "")
                if d.action is Action.LEAVE:
                    (log.info if d.code == 0 else log.warning)(
                        "local job %s: %s: it ends with %d: %s", self.pid, ranks, d.code, d.why)
                    return
                log.warning("local job %s: %s (%d): starting them again (restart %d): %s",
                            self.pid, ranks, d.code, supervision.restarts, d.why)
        finally:
            channel.remove()
            if self.zygote is not None:
                self.zygote.close()

    def start_tasks(self) -> None:
        """submitit's, each task forked from the warm-start process where there is one: a
        relaunch does not start Python and torch again."""
        if self.zygote is None:
            return super().start_tasks()
        self.folder.mkdir(exist_ok=True)
        for k in range(self.ntasks):
            paths = JobPaths(self.folder, self.pid, k)
            env = dict(os.environ, SUBMITIT_LOCAL_LOCALID=str(k), SUBMITIT_LOCAL_GLOBALID=str(k),
                       SUBMITIT_LOCAL_JOB_ID=self.pid)
            err = paths.stdout if self.stderr_to_stdout else paths.stderr
            try:
                self.tasks.append(self.zygote.spawn(self.command, env, os.getcwd(),
                                                    str(paths.stdout), str(err), append=True))
            except OSError as e:
                log.warning("warm start unavailable (%s): starting the tasks cold", e)
                self.kill_tasks()
                self.zygote = None
                return super().start_tasks()
        return None

    def open_channel(self) -> Channel:
        """This controller's own channel in its folder (``Channel.for_controller``)."""
        return Channel.for_controller(self.pid, Path(str(self.folder).replace("%j", self.pid)))

    def wait(self, freq: int = 24) -> Sequence[int | None]:
        """Until every task ended, within submitit's time limit (its signal ``signal_delay_s``
        before) and ``grace_s`` after the first task's end, when the rest are killed."""
        self.killed = []
        t0 = time.monotonic()
        warned = False
        first_end: float | None = None
        while True:
            codes = [t.poll() for t in self.tasks]
            if all(c is not None for c in codes):
                return codes
            now = time.monotonic()
            if not warned and now - t0 >= self.timeout_s - self.signal_delay_s:
                warned = True
                self._forward_signal(LocalJobEnvironment._usr_sig())
            if now - t0 >= self.timeout_s:
                return codes          # submitit's: the rest are killed by kill_tasks
            if first_end is None and any(c is not None for c in codes):
                first_end = now
            if first_end is not None and now - first_end > self.grace_s:
                self.killed = [r for r, c in enumerate(codes) if c is None]
                log.warning("tasks %s did not end within %.0f s of the first task's end "
                            "(frozen or stuck): killed", self.killed, self.grace_s)
                for r in self.killed:
                    self.tasks[r].send_signal(signal.SIGKILL)
                return [t.wait() for t in self.tasks]
            time.sleep(1.0 / freq)


def main(argv: list[str] | None = None) -> None:
    """The controller process (``ResilientLocalExecutor`` starts it)."""
    p = argparse.ArgumentParser(prog=f"python -m {__name__}")
    p.add_argument("folder", type=Path)
    p.add_argument("--grace", type=float, default=DEFAULT_GRACE_S)
    args = p.parse_args(argv)
    ResilientController(args.folder, args.grace).run()


if __name__ == "__main__":
    main()
