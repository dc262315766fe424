"""A local launcher that plays the scheduler when no SLURM is present: one process per rank on
this machine, started again while the one policy says so.

The ranks run in sessions of their own: a terminal's Ctrl+C reaches only the launcher, which
forwards one signal to every rank per signal it gets. Every wait is bounded by
``stop_timeout_s``; a rank still there then counts as hung for the policy. What the ranks left
running is killed, as SLURM ends a step's processes: a relaunch never runs beside them.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

from kempner_resilience.core.log import get_logger
from kempner_resilience.core.runpaths import RunPaths
from kempner_resilience.core.strays import clock_ticks_now, end_strays
from kempner_resilience.supervise.channel import CHANNEL_ENV, Channel, Progress
from kempner_resilience.supervise.local.standby import standby_or_zygote
from kempner_resilience.supervise.local.warm import Forker, parent_death, warm_command
from kempner_resilience.supervise.policy import (RUN_AGAIN, Action, Commits, Decision, Evidence,
                                                 decide, ends_of, job_code)

__all__ = ["Launch", "LocalLauncher", "free_port", "launch_evidence", "warm_parent",
           "start_rank", "RELAUNCH_CODES", "FORWARDED_SIGNALS", "KILL_AFTER_TERM_S"]

_log = get_logger(__name__)

# The run-again codes; the decision itself is the policy's.
RELAUNCH_CODES = frozenset(int(c) for c in RUN_AGAIN)
# After the grace, a rank still alive gets SIGTERM (a graceful stop if it can still run), then
# SIGKILL this much later (a SIGSTOPped rank cannot act on SIGTERM at all).
KILL_AFTER_TERM_S = 10.0
# Signals to the launcher that it forwards to every rank (once per signal received).
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# Not passed on: started inside an allocation, a rank that saw them would `scontrol requeue`
# the allocation itself, where the launcher is the ranks' scheduler.
_SCHEDULER_VARS = ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_RESTART_COUNT")


def free_port() -> int:
    """A free TCP port for a local rendezvous, below the ephemeral range (32768+) and SLURM's
    ``master_port`` range (20000-31999): a port from ``bind(0)`` can become the local end of a
    new connection (gloo opens many) before rank 0 binds it, and the store never comes."""
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(10000, 20000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:      # everything there taken: let the kernel choose
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_evidence(codes: Sequence[int], killed: Sequence[int] = (), *, index: int = 0,
                    max_launches: int = 10, commits: Commits | None = None, stalled: int = 0,
                    max_no_progress: int = 2, interrupted: bool = False,
                    relaunch_codes: frozenset[int] | None = None) -> Evidence:
    """The policy's evidence after launch ``index`` (0: the first); ``max_launches`` counts
    the first. One machine: no nodes to implicate, no spares, no scheduler behind it."""
    return Evidence(ends_of(codes, killed), restarts=index, max_restarts=max_launches - 1,
                    commits=commits, stalled=stalled, max_no_progress=max_no_progress,
                    stopping=interrupted, relaunch_codes=relaunch_codes)


@dataclass
class Launch:
    """What one launch of all ranks did."""

    index: int
    exit_codes: list[int]
    started_step: int | None
    seconds: float
    signal_name: str | None = None
    signal_step: int | None = None
    signal_to_exit_s: float | None = None
    report: dict = field(default_factory=dict)
    stderr_tail: list[str] = field(default_factory=list)
    interrupted: bool = False     # stopped by Ctrl+C or SIGTERM to the launcher: not relaunched
    killed: list[int] = field(default_factory=list)   # ranks killed after stop_timeout_s
    decision: Decision | None = None  # the policy's answer for this launch (run() sets it)

    @property
    def exit_code(self) -> int:
        """The job's code: the policy's decision, else the one rule (``policy.job_code``)."""
        return job_code(ends_of(self.exit_codes, self.killed))[0] if self.decision is None \
            else self.decision.code


class LocalLauncher:
    """Runs ``command`` as ``ranks`` processes until it completes or stops asking to rerun.

    ``workdir``: the demo trainer's (rank logs, ``--progress FILE``, ``interrupts``: step ->
    the signal sent once when rank 0 reaches it); None runs the user's script unchanged, on
    this process's streams or, with ``log_dir``, in ``log_dir/rank<r>.<launch>.log``.
    ``relaunch_codes``: relaunch exactly those (a caller that plays a scheduler); None: the
    policy decides. ``zygote``: a shared warm-start process (``warm_parent``) the caller owns.
    """

    def __init__(self, command: list[str], *, ranks: int, workdir: Path | None,
                 interrupts: dict[int, str] | None = None, max_launches: int = 10,
                 env: dict[str, str] | None = None,
                 on_progress: Callable[[int, int], None] | None = None,
                 on_launch: Callable[[Launch], None] | None = None,
                 relaunch_codes: set[int] | frozenset[int] | None = None,
                 stop_timeout_s: float = 60.0, run_paths: RunPaths | None = None,
                 max_no_progress: int = 2, log_dir: Path | None = None,
                 zygote: Forker | None = None) -> None:
        if workdir is None and interrupts:
            raise ValueError("interrupts need a workdir (rank 0's progress file is read there)")
        self.command = list(command)
        self.ranks = ranks
        self.workdir = None if workdir is None else Path(workdir)
        self.pending = dict(sorted((interrupts or {}).items()))
        self.max_launches = max_launches
        self.env = env or {}
        self.on_progress = on_progress
        self.on_launch = on_launch
        self.relaunch_codes = None if relaunch_codes is None else frozenset(relaunch_codes)
        self.stop_timeout_s = stop_timeout_s
        self.run_paths = run_paths
        self.max_no_progress = max_no_progress
        self.log_dir = None if log_dir is None else Path(log_dir)
        self.launches: list[Launch] = []
        self.channel: Channel | None = None   # the ranks' word, while run() runs
        self._zygote: Forker | None = None  # the warm ranks' parent, in run()
        self._shared = zygote                  # the caller's, never ended here
        self._received: list[int] = []     # signals to forward, appended by the handler

    def run(self) -> list[Launch]:
        """Launch until the job completes, stops asking to rerun, or Ctrl+C/SIGTERM stops it
        (the last launch ``interrupted``). On the main thread SIGINT and SIGTERM are taken over."""
        self.channel = Channel.private("kempner-resilience-launch-")
        warm = warm_command(self.command)
        own = warm and self._shared is None
        self._zygote = standby_or_zygote(self._zygote_env()) if own else \
            self._shared if warm else None
        main = threading.current_thread() is threading.main_thread()
        previous = {s: signal.signal(s, self._on_signal) for s in FORWARDED_SIGNALS} if main else {}
        progress = Progress(self.channel, self.run_paths, self.max_no_progress)
        try:
            for index in range(self.max_launches):
                progress.starting()
                launch = self._launch(index)
                if self._received:      # a signal after the ranks had exited: no relaunch
                    launch.interrupted = True
                    del self._received[:]
                launch.decision = progress.carry(decide(launch_evidence(
                    launch.exit_codes, launch.killed, index=index,
                    max_launches=self.max_launches, interrupted=launch.interrupted,
                    relaunch_codes=self.relaunch_codes, **progress.guard())))
                self.launches.append(launch)
                if self.on_launch:
                    self.on_launch(launch)
                if launch.decision.action is Action.LEAVE:
                    break
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)
            if own and self._zygote is not None:
                self._zygote.close()
            self.channel.remove()
        return self.launches

    def _zygote_env(self) -> dict[str, str]:
        """The ranks' environment less what differs from rank to rank or launch to launch,
        and less the channel (the stray sweep looks for it, and the zygote is no stray)."""
        env = self.rank_env(0, "0", 0)
        for key in ("RANK", "LOCAL_RANK", "MASTER_PORT", "KEMPNER_RESTART_COUNT",
                    *(self.channel.env() if self.channel is not None else {})):
            env.pop(key, None)
        return env

    def _on_signal(self, signum: int, frame: object) -> None:
        self._received.append(signum)       # only record: the wait loop forwards it

    def rank_env(self, rank: int, port: str, index: int) -> dict[str, str]:
        """The environment of ``rank`` in launch ``index``."""
        env = {k: v for k, v in os.environ.items() if k not in _SCHEDULER_VARS}
        env.update(self.env)
        env.update(RANK=str(rank), WORLD_SIZE=str(self.ranks), LOCAL_RANK=str(rank),
                   LOCAL_WORLD_SIZE=str(self.ranks), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=port, KEMPNER_RESTART_COUNT=str(index), PYTHONUNBUFFERED="1")
        if self.ranks > 1:
            # torchrun's default: ranks that share a machine's cores, each with as many
            # intra-op threads as there are cores, spin against each other (2 demo ranks on
            # 2 cores: 13 CPU-s for 300 steps instead of 8-9).
            env.setdefault("OMP_NUM_THREADS", "1")
        if self.channel is not None:
            env.update(self.channel.env())
        return env

    def _launch(self, index: int) -> Launch:
        progress = report = None
        command = self.command
        if self.workdir is not None:
            progress, report = self.workdir / f"progress.{index}", self.workdir / f"report.{index}.json"
            progress.unlink(missing_ok=True)
            report.unlink(missing_ok=True)
            command = command + ["--progress", str(progress)]
        port = str(free_port())
        if self.channel is not None:
            self.channel.begin_launch(index)     # the ranks' restart count (budget, ledger)
        procs = []
        t0 = time.monotonic()
        since = clock_ticks_now()       # what the ranks start from now on is this launch's
        cwd = None if self.workdir is None else str(self.workdir)
        for rank in range(self.ranks):
            env = self.rank_env(rank, port, index)
            out = err = None
            if self.workdir is not None:
                env["KEMPNER_RESILIENCE_REPORT"] = str(report)
                out, err = os.devnull, str(self.workdir / f"rank{rank}.{index}.log")
            elif self.log_dir is not None:
                out = err = str(self.log_dir / f"rank{rank}.{index}.log")
            try:
                proc, self._zygote = start_rank(self._zygote, command, env, cwd, out, err)
            except BaseException:
                self._signal_all(procs, signal.SIGKILL)  # no rank outlives a failed start
                raise
            procs.append(proc)
        launch = Launch(index, [], None, 0.0)
        sent_at = None
        seen = 0
        forwarded = 0            # signals to the launcher forwarded to the ranks
        stop_by: float | None = None
        first_end: float | None = None   # when the first rank ended: the others' grace runs
        termed_at: float | None = None   # when the ranks left after the grace got SIGTERM
        try:
            while any(p.poll() is None for p in procs):
                now = time.monotonic()
                if first_end is None and any(p.poll() is not None for p in procs):
                    first_end = now
                if first_end is not None and stop_by is None and termed_at is None \
                        and now > first_end + self.stop_timeout_s:
                    launch.killed = [r for r, p in enumerate(procs) if p.poll() is None]
                    _log.warning("launch %d: ranks %s did not end within %.0f s of the first "
                                 "rank's end (frozen or stuck): SIGTERM, then SIGKILL", index + 1,
                                 launch.killed, self.stop_timeout_s)
                    self._signal_all(procs, signal.SIGTERM)
                    termed_at = now
                if termed_at is not None and now > termed_at + min(KILL_AFTER_TERM_S,
                                                                   self.stop_timeout_s):
                    self._signal_all(procs, signal.SIGKILL)
                    break
                while len(self._received) > forwarded:
                    signum = self._received[forwarded]
                    forwarded += 1
                    launch.interrupted = True
                    stop_by = stop_by or time.monotonic() + self.stop_timeout_s
                    self._signal_all(procs, signum)
                if stop_by is not None and time.monotonic() > stop_by:
                    launch.killed = [r for r, p in enumerate(procs) if p.poll() is None]
                    self._signal_all(procs, signal.SIGKILL)
                    break
                steps = _rank0_steps(progress) if progress is not None else []
                if steps and launch.started_step is None:
                    launch.started_step = steps[0]
                if steps and len(steps) != seen:
                    seen = len(steps)
                    if self.on_progress:
                        self.on_progress(index, steps[-1])
                if steps and self.pending and sent_at is None and not launch.interrupted:
                    at = next(iter(self.pending))
                    if steps[-1] >= at:
                        name = self.pending.pop(at)
                        sent_at = time.monotonic()
                        # as SLURM does: every task gets the signal
                        self._signal_all(procs, getattr(signal, name))
                        launch.signal_name, launch.signal_step = name, steps[-1]
                time.sleep(0.005)
        except KeyboardInterrupt:      # not on the main thread, or before run() took SIGINT
            launch.interrupted = True
            self._signal_all(procs, signal.SIGINT)
            end = time.monotonic() + self.stop_timeout_s
            for p in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(max(end - time.monotonic(), 0.0))
        finally:
            # Whatever ended the wait (an error here included), no rank outlives the launch,
            # nor anything a rank started: the ranks' sessions and the channel's mark.
            self._signal_all(procs, signal.SIGKILL)
            self._end_strays(index, procs, since)
        # The received signals are consumed: a relaunch must not forward them again.
        del self._received[:forwarded]
        ended = time.monotonic()
        launch.exit_codes = [p.wait() for p in procs]      # all dead by now: returns at once
        launch.seconds = ended - t0
        if sent_at is not None:
            launch.signal_to_exit_s = ended - sent_at
        if report is not None and report.exists():
            launch.report = json.loads(report.read_text())
        if self.workdir is not None:
            log0 = (self.workdir / f"rank0.{index}.log").read_text(errors="replace")
            launch.stderr_tail = log0.splitlines()[-15:]
        return launch

    def _end_strays(self, index: int, procs: list[subprocess.Popen],
                    since: int | None) -> None:
        """End what the ranks of launch ``index`` started and left running, as SLURM ends a
        step's processes (``core/strays.py``): the channel's path is unique to this launcher."""
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(KILL_AFTER_TERM_S)     # SIGKILLed: only the kernel's teardown is left
        mark = (CHANNEL_ENV, self.channel.env()[CHANNEL_ENV]) if self.channel is not None else None
        ended = end_strays([p.pid for p in procs], mark, since)
        if ended:
            _log.warning("launch %d: ended %d process(es) the ranks had started and left "
                         "running (pids %s)", index + 1, len(ended),
                         ", ".join(map(str, sorted(ended))))

    @staticmethod
    def _signal_all(procs: list[subprocess.Popen], signum: int) -> None:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.send_signal(signum)


def warm_parent(command: Sequence[str], ranks: int) -> Forker | None:
    """One warm-start process shared by several launchers of ``command`` (None: it starts
    cold): the machine's standby when one fits, else a zygote; the caller closes it."""
    if not warm_command(command):
        return None
    return standby_or_zygote(LocalLauncher(list(command), ranks=ranks, workdir=None)._zygote_env())


def start_rank(parent: Forker | None, command: list[str], env: dict[str, str], cwd: str | None,
               out: str | None, err: str | None) -> tuple[Any, Forker | None]:
    """A rank forked by ``parent``, or started cold when there is none or it fails to fork;
    and the parent for the next rank (None once it failed: they start cold too)."""
    if parent is not None:
        try:
            return parent.spawn(command, env, cwd, out, err), parent
        except OSError as e:
            _log.warning("warm start unavailable (%s): starting the ranks cold", e)
    return _start_cold(command, env, cwd, out, err), None


def _start_cold(command: list[str], env: dict[str, str], cwd: str | None, out: str | None,
                err: str | None) -> subprocess.Popen:
    """A rank started cold, in a session of its own: a terminal's Ctrl+C is the launcher's to
    pass on, and the kernel SIGTERMs it if the launcher dies (none is left running)."""
    files = {p: open(p, "w") for p in {out, err} - {None, os.devnull}}
    try:
        return subprocess.Popen(command, env=env, cwd=cwd, start_new_session=True,
                                stdout=subprocess.DEVNULL if out == os.devnull else files.get(out),
                                stderr=files.get(err), preexec_fn=parent_death(signal.SIGTERM))
    finally:
        for f in files.values():
            f.close()           # the rank holds its own copy


def _rank0_steps(progress: Path) -> list[int]:
    try:
        text = progress.read_text()
    except FileNotFoundError:
        return []
    return [int(line.split()[3]) for line in text.splitlines()
            if line.startswith("rank 0 step ") and len(line.split()) == 4]
