"""A local launcher that plays the scheduler when no SLURM is present.

It does what SLURM does for a requeueable job, on one machine: start one process per rank
(gloo, a fresh port per launch), deliver a signal to every rank when training reaches a chosen
step (as ``--signal=USR1@T`` would), and start the job again when it exits with REQUEUE (or
HANG, as a site's requeue-on-failure would), up to a restart budget. ``KEMPNER_RESTART_COUNT``
tells the ranks how often they were restarted, as ``SLURM_RESTART_COUNT`` does.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kempner_resilience.exitcodes import ExitCode, describe

__all__ = ["Launch", "LocalLauncher"]

RELAUNCH_CODES = frozenset({int(ExitCode.REQUEUE), int(ExitCode.HANG)})


def _free_port() -> int:
    with socket.socket() as s:
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
                 relaunch_codes: set[int] | frozenset[int] = RELAUNCH_CODES) -> None:
        self.command = command
        self.ranks = ranks
        self.workdir = Path(workdir)
        self.pending = dict(sorted((interrupts or {}).items()))
        self.max_launches = max_launches
        self.env = env or {}
        self.on_progress = on_progress
        self.on_launch = on_launch
        self.relaunch_codes = frozenset(relaunch_codes)
        self.launches: list[Launch] = []

    def run(self) -> list[Launch]:
        for index in range(self.max_launches):
            launch = self._launch(index)
            self.launches.append(launch)
            if self.on_launch:
                self.on_launch(launch)
            if launch.exit_code not in self.relaunch_codes:
                break
        return self.launches

    def _launch(self, index: int) -> Launch:
        progress = self.workdir / f"progress.{index}"
        report = self.workdir / f"report.{index}.json"
        for p in (progress, report):
            p.unlink(missing_ok=True)
        port = str(_free_port())
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
                                          cwd=self.workdir))
        launch = Launch(index, [], None, 0.0)
        sent_at = None
        seen = 0
        try:
            while any(p.poll() is None for p in procs):
                steps = _rank0_steps(progress)
                if steps and launch.started_step is None:
                    launch.started_step = steps[0]
                if steps and len(steps) != seen:
                    seen = len(steps)
                    if self.on_progress:
                        self.on_progress(index, steps[-1])
                if steps and self.pending and sent_at is None:
                    at = next(iter(self.pending))
                    if steps[-1] >= at:
                        name = self.pending.pop(at)
                        sent_at = time.monotonic()
                        for p in procs:  # as SLURM does: every task gets the signal
                            if p.poll() is None:
                                p.send_signal(getattr(signal, name))
                        launch.signal_name, launch.signal_step = name, steps[-1]
                time.sleep(0.005)
        except KeyboardInterrupt:
            for p in procs:
                p.send_signal(signal.SIGINT)
            for p in procs:
                p.wait()
            raise
        ended = time.monotonic()
        launch.exit_codes = [p.wait() for p in procs]
        launch.seconds = ended - t0
        if sent_at is not None:
            launch.signal_to_exit_s = ended - sent_at
        if report.exists():
            launch.report = json.loads(report.read_text())
        log0 = (self.workdir / f"rank0.{index}.log").read_text(errors="replace").splitlines()
        launch.stderr_tail = log0[-15:]
        return launch


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
