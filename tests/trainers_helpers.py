"""What the trainer adapters' tests share: a 2-rank job under its library's launcher,
interrupted by signals at chosen steps and run again, and its final state compared."""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path
from typing import Sequence

import torch

from helpers import assert_bitwise_equal, env, wait_for_file
from kempner_resilience.checkpoint import MANIFEST_NAME

SCRIPTS = Path(__file__).resolve().parent / "trainer_scripts"


def start(work: Path, cmd: Sequence[str], name: str) -> subprocess.Popen:
    """``cmd`` in ``work`` (its own session: a Ctrl+C goes to its process group), its
    checkpoints in ``work/ckpt``, no network (HF_HUB_OFFLINE)."""
    return subprocess.Popen(
        list(cmd), cwd=work, stdin=subprocess.DEVNULL, start_new_session=True,
        stdout=open(work / f"{name}.out", "w"), stderr=subprocess.STDOUT,
        env=env(KEMPNER_RESILIENCE_CONFIG=str(_config(work)), HF_HUB_OFFLINE="1",
                OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false"))


def write_config(work: Path, every_steps: int = 0) -> Path:
    """The run's config in ``work`` (checkpoint.dir ``work/ckpt``, no hang watchdog), with a
    periodic save every ``every_steps`` (0: none); ``start`` keeps one written before it."""
    path = work / "resilience.yaml"
    path.write_text(f"checkpoint:\n  dir: {work / 'ckpt'}\n  every_steps: {every_steps}\n"
                    "watchdog:\n  hang_timeout_s: 0\n")
    return path


def _config(work: Path) -> Path:
    path = work / "resilience.yaml"
    return path if path.exists() else write_config(work)


def finish(proc: subprocess.Popen, timeout: float = 240) -> int:
    try:
        return proc.wait(timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def last_steps(progress: Path) -> dict[int, int]:
    """Each rank's last step started, from its ``rank R step S`` lines."""
    last: dict[int, int] = {}
    for rank, step in re.findall(r"^rank (\d+) step (\d+)$", progress.read_text(), re.M):
        last[int(rank)] = max(last.get(int(rank), -1), int(step))
    return last


def committed_steps(work: Path) -> list[int]:
    return sorted(int(p.name.split("_")[1]) for p in (work / "ckpt").glob("step_*")
                  if (p / MANIFEST_NAME).exists())


def interrupt(work: Path, cmd: Sequence[str], at_step: int, signum: int,
              group: bool = False) -> tuple[int, str]:
    """Run ``cmd`` and send ``signum`` to the launcher (its process group with ``group``, as
    a terminal's Ctrl+C) once rank 0 has reached ``at_step``; its exit code and output."""
    name = f"launch{len(list(work.glob('launch*.out')))}"
    proc = start(work, cmd, name)
    try:
        wait_for_file(work / "progress", timeout=180, contains=f"rank 0 step {at_step}\n")
    except BaseException:
        finish(proc, 0.1)
        raise
    if group:
        os.killpg(proc.pid, signum)
    else:
        os.kill(proc.pid, signum)
    return finish(proc), (work / f"{name}.out").read_text()


def kill_held(work: Path, cmd: Sequence[str], at_step: int, rank: int = 1) -> tuple[int, str]:
    """Run ``cmd`` (a script of tests/trainer_scripts/) holding every rank at step ``at_step``
    (``--hold``); once both hold, SIGKILL ``rank`` and let the other go on: its exit code and
    output."""
    name = f"launch{len(list(work.glob('launch*.out')))}"
    hold = work / "hold"
    hold.touch()
    proc = start(work, [*cmd, "--hold", str(hold), "--hold-at", str(at_step)], name)
    try:
        for r in (0, 1):
            wait_for_file(work / "progress", timeout=180, contains=f"rank {r} holds at {at_step} ")
        held = re.search(rf"^rank {rank} holds at {at_step} pid (\d+)$",
                         (work / "progress").read_text(), re.M)
        assert held is not None
        os.kill(int(held.group(1)), signal.SIGKILL)
    except BaseException:
        finish(proc, 0.1)
        raise
    finally:
        hold.unlink()
    return finish(proc), (work / f"{name}.out").read_text()


def run_to_end(work: Path, cmd: Sequence[str]) -> tuple[int, str]:
    name = f"launch{len(list(work.glob('launch*.out')))}"
    code = finish(start(work, cmd, name))
    return code, (work / f"{name}.out").read_text()


def assert_same_final(a: Path, b: Path) -> None:
    """Two runs' final state files (model, optimizer, scheduler, RNG) are bitwise equal."""
    assert_bitwise_equal(torch.load(a, weights_only=False), torch.load(b, weights_only=False))


__all__ = ["SCRIPTS", "start", "finish", "last_steps", "committed_steps", "interrupt",
           "kill_held", "run_to_end", "assert_same_final", "signal"]
