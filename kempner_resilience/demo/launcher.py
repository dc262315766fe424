"""A local launcher that plays the scheduler when no SLURM is present.

It does what SLURM does for a requeueable job, on one machine: start one process per rank
(gloo, a fresh port per launch), deliver a signal to every rank when training reaches a chosen
step (as ``--signal=USR1@T`` would), and start the job again when it exits with REQUEUE (or
HANG, as a site's requeue-on-failure would), up to a restart budget. ``KEMPNER_RESTART_COUNT``
tells the ranks how often they were restarted, as ``SLURM_RESTART_COUNT`` does.

Ctrl+C works as with torchrun: the ranks run in sessions of their own, so a terminal's SIGINT
(sent to the launcher's whole process group) reaches only the launcher, which forwards exactly
one SIGINT to every rank: they agree on a step, commit the checkpoint and exit 130. A second
Ctrl+C forwards a second SIGINT, which forces every rank out at once. Every wait after a Ctrl+C is
bounded (``stop_timeout_s``); ranks still alive then are killed, so none is ever left behind,
and ranks whose launcher dies get SIGTERM from the kernel (a graceful stop).
"""

from __future__ import annotations

import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kempner_resilience.exitcodes import ExitCode, describe

__all__ = ["Launch", "LocalLauncher", "free_port"]

RELAUNCH_CODES = frozenset({int(ExitCode.REQUEUE), int(ExitCode.HANG)})
_PR_SET_PDEATHSIG = 1


def _die_with_launcher() -> None:
    # Runs in the child between fork and exec. Ranks live in their own session (no terminal
    # SIGINT), so without this a launcher killed with SIGKILL would leave them running.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def free_port() -> int:
    """A free TCP port for a local rendezvous, below the kernel's ephemeral range (32768+) and
    SLURM's ``master_port`` range (20000-31999): a port the kernel handed out for ``bind(0)``
    can be taken as the local end of any new connection (gloo opens many) before rank 0 binds
    it, and the other ranks then wait for a store that never comes."""
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
    interrupted: bool = False     # stopped by Ctrl+C (SIGINT to the launcher): not relaunched
    killed: list[int] = field(default_factory=list)   # ranks killed after stop_timeout_s

    @property
    def exit_code(self) -> int:
        # Ranks agree on their code; a disagreement (a crash) shows the worst one.
        codes = set(self.exit_codes)
        return self.exit_codes[0] if len(codes) == 1 else max(codes, key=lambda c: c != 0)


class LocalLauncher:
    """Runs ``command`` as ``ranks`` processes until it completes or stops asking to rerun.

    ``interrupts`` maps a training step to the signal delivered when rank 0 reaches it (each
    is delivered once over the whole job). ``on_progress(step)`` is called as steps complete.
    """

    def __init__(self, command: list[str], *, ranks: int, workdir: Path,
                 interrupts: dict[int, str] | None = None, max_launches: int = 10,
                 env: dict[str, str] | None = None,
                 on_progress: Callable[[int, int], None] | None = None,
                 on_launch: Callable[[Launch], None] | None = None,
                 relaunch_codes: set[int] | frozenset[int] = RELAUNCH_CODES,
                 stop_timeout_s: float = 60.0) -> None:
        self.command = command
        self.ranks = ranks
        self.workdir = Path(workdir)
        self.pending = dict(sorted((interrupts or {}).items()))
        self.max_launches = max_launches
        self.env = env or {}
        self.on_progress = on_progress
        self.on_launch = on_launch
        self.relaunch_codes = frozenset(relaunch_codes)
        self.stop_timeout_s = stop_timeout_s
        self.launches: list[Launch] = []
        self._ctrl_c = 0

    def run(self) -> list[Launch]:
        """Launch until the job completes, stops asking to rerun, or Ctrl+C stops it (then the
        last launch has ``interrupted`` set). SIGINT is taken over while this runs (main thread
        only: elsewhere Ctrl+C keeps raising KeyboardInterrupt, which is handled the same way)."""
        main = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, self._on_sigint) if main else None
        try:
            for index in range(self.max_launches):
                launch = self._launch(index)
                self.launches.append(launch)
                if self.on_launch:
                    self.on_launch(launch)
                if launch.interrupted or launch.exit_code not in self.relaunch_codes:
                    break
        finally:
            if main:
                signal.signal(signal.SIGINT, previous)
        return self.launches

    def _on_sigint(self, signum: int, frame: object) -> None:
        self._ctrl_c += 1       # only record: the wait loop forwards it

    def _launch(self, index: int) -> Launch:
        progress = self.workdir / f"progress.{index}"
        report = self.workdir / f"report.{index}.json"
        for p in (progress, report):
            p.unlink(missing_ok=True)
        port = str(free_port())
        procs = []
        t0 = time.monotonic()
        for rank in range(self.ranks):
            env = dict(os.environ, **self.env, RANK=str(rank), WORLD_SIZE=str(self.ranks),
                       LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                       KEMPNER_RESTART_COUNT=str(index), KEMPNER_RESILIENCE_REPORT=str(report),
                       PYTHONUNBUFFERED="1")
            err = open(self.workdir / f"rank{rank}.{index}.log", "w")
            procs.append(subprocess.Popen(self.command + ["--progress", str(progress)],
                                          env=env, stdout=subprocess.DEVNULL, stderr=err,
                                          cwd=self.workdir, start_new_session=True,
                                          preexec_fn=_die_with_launcher))
        launch = Launch(index, [], None, 0.0)
        sent_at = None
        seen = 0
        forwarded = 0            # Ctrl+Cs forwarded to the ranks
        stop_by: float | None = None
        try:
            while any(p.poll() is None for p in procs):
                if self._ctrl_c > forwarded:
                    forwarded = self._ctrl_c
                    launch.interrupted = True
                    stop_by = stop_by or time.monotonic() + self.stop_timeout_s
                    self._signal_all(procs, signal.SIGINT)
                if stop_by is not None and time.monotonic() > stop_by:
                    launch.killed = [r for r, p in enumerate(procs) if p.poll() is None]
                    self._signal_all(procs, signal.SIGKILL)
                    break
                steps = _rank0_steps(progress)
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
            self._ctrl_c += 1
            launch.interrupted = True
            self._signal_all(procs, signal.SIGINT)
            _wait_all(procs, self.stop_timeout_s)
        finally:
            # Whatever ended the wait (an error here included), no rank outlives the launch.
            self._signal_all(procs, signal.SIGKILL)
        ended = time.monotonic()
        launch.exit_codes = [p.wait() for p in procs]      # all dead by now: returns at once
        launch.seconds = ended - t0
        if sent_at is not None:
            launch.signal_to_exit_s = ended - sent_at
        if report.exists():
            launch.report = json.loads(report.read_text())
        log0 = (self.workdir / f"rank0.{index}.log").read_text(errors="replace").splitlines()
        launch.stderr_tail = log0[-15:]
        return launch

    @staticmethod
    def _signal_all(procs: list[subprocess.Popen], signum: int) -> None:
        for p in procs:
            if p.poll() is None:
                try:
                    p.send_signal(signum)
                except ProcessLookupError:
                    pass


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    for p in procs:
        try:
            p.wait(max(end - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            pass


def _rank0_steps(progress: Path) -> list[int]:
    try:
        text = progress.read_text()
    except FileNotFoundError:
        return []
    return [int(line.split()[3]) for line in text.splitlines()
            if line.startswith("rank 0 step ") and len(line.split()) == 4]


def train_command(steps: int, *, step_time: float, out: Path, overrides: list[str],
                  hang_at: int = -1) -> list[str]:
    cmd = [sys.executable, "-m", "kempner_resilience.demo.train", "--steps", str(steps),
           "--step-time", str(step_time), "--out", str(out), "--quiet"]
    for o in overrides:
        cmd += ["--set", o]
    if hang_at >= 0:
        cmd += ["--hang-at", str(hang_at)]
    return cmd


def explain(code: int) -> str:
    return describe(code)
