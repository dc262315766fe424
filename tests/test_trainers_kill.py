"""SIGKILL of a rank at random moments of an adapted script's checkpoint saves (20 kills).

The Accelerate script of the trainer tests (the representative adapter: its checkpoint is the
run's, written by ``ResilientAccelerate``) trains on two gloo ranks with a commit at every step,
under ``kempner-resilience launch --warm``: the launcher relaunches after each kill, as a
requeueing scheduler would, and a relaunch costs a fork, so twenty kills fit in one job. Most of
a step's time is its save (the step itself is a few milliseconds), so a random moment lands in
one: in DCP's writes, the fsyncs, rank 0's manifest, retention. After every kill the next launch
must resume from a committed step, verified against its manifest, and never from older than the
newest commit that existed when the rank was killed.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import env, require
from trainers_helpers import SCRIPTS, finish
from kempner_resilience.checkpoint import MANIFEST_NAME, layout
from kempner_resilience.core.runpaths import RunPaths

require("accelerate")

KILLS = 20


def _start(work: Path) -> subprocess.Popen:
    cfg = work / "resilience.yaml"
    cfg.write_text(f"checkpoint:\n  dir: {work / 'ckpt'}\n  every_steps: 1\n  keep_last: 1000\n"
                   "requeue:\n  max_restarts: 100\n  max_no_progress: 100\n"
                   "watchdog:\n  hang_timeout_s: 0\n")
    cmd = [sys.executable, "-m", "kempner_resilience.cli", "launch", "--warm", "--ranks", "2",
           "--max-restarts", "100", "--stop-timeout", "20", "--", sys.executable,
           str(SCRIPTS / "accelerate_train.py"), "--steps", "100000", "--step-s", "0",
           "--progress", str(work / "progress")]
    return subprocess.Popen(
        cmd, cwd=work, stdin=subprocess.DEVNULL, start_new_session=True,
        stdout=open(work / "launch.out", "w"), stderr=subprocess.STDOUT,
        env=env(KEMPNER_RESILIENCE_CONFIG=str(cfg), ACCELERATE_USE_CPU="true",
                OMP_NUM_THREADS="1"))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _ranks_training(work: Path, seen: set[int], launcher: subprocess.Popen) -> list[int]:
    """The pids of a launch not seen before, once both ranks are alive and it trained a step."""
    deadline = time.monotonic() + 120
    progress = work / "progress"
    pids: list[int] = []
    size = -1
    while True:
        assert launcher.poll() is None, (work / "launch.out").read_text()[-4000:]
        assert time.monotonic() < deadline, ("no new launch trained a step within 120 s:\n"
                                             + (work / "launch.out").read_text()[-4000:])
        now = progress.stat().st_size if progress.exists() else 0
        if not pids:
            try:
                pids = [int((work / f"progress.pid{r}").read_text()) for r in (0, 1)]
            except (OSError, ValueError):
                pids = []
            if seen & set(pids) or not all(_alive(p) for p in pids):
                pids = []
            size = now
        elif now > size:
            return pids
        time.sleep(0.01)


def _committed(root: Path) -> list[layout.Entry]:
    return [e for e in layout.scan(RunPaths(root)) if e.committed]


def _resumed_steps(out: str) -> list[tuple[int, Path]]:
    """Every launch's resume, in order: (step, directory)."""
    return [(int(step), Path(path)) for path, step in
            re.findall(r"resumed from (\S+) \(step (\d+),", out)]


def test_a_rank_sigkilled_at_random_moments_of_its_saves_never_resumes_a_partial_step_nor_loses_a_committed_one(
        tmp_path):
    root = tmp_path / "ckpt"
    rng = random.Random(4242)
    launcher = _start(tmp_path)
    seen: set[int] = set()
    newest_at_kill: list[int] = []
    in_save = 0
    try:
        for _ in range(KILLS):
            pids = _ranks_training(tmp_path, seen, launcher)
            seen |= set(pids)
            time.sleep(rng.uniform(0.0, 0.3))
            entries = layout.scan(RunPaths(root))
            newest = max((e.step for e in entries if e.committed), default=0)
            os.kill(pids[rng.randrange(2)], signal.SIGKILL)
            newest_at_kill.append(newest)
            in_save += any(not e.committed and e.step > newest for e in entries)
            while any(_alive(p) for p in pids):       # the survivor's rescue, or its end
                assert launcher.poll() is None, (tmp_path / "launch.out").read_text()[-4000:]
                time.sleep(0.02)
            # Still there, and whole: the newest step committed when the rank was killed.
            kept = {e.step: e for e in _committed(root)}
            assert newest == 0 or newest in kept, sorted(kept)
            if newest:
                layout.verify_entry(kept[newest])
        _ranks_training(tmp_path, seen, launcher)      # the run after the last kill resumed
        launcher.send_signal(signal.SIGTERM)           # a checkpoint, then 143
        assert finish(launcher, 120) == 143, (tmp_path / "launch.out").read_text()[-4000:]
    finally:
        if launcher.poll() is None:        # a failed assertion: no rank outlives the test
            finish(launcher, 0.1)
    out = (tmp_path / "launch.out").read_text()
    resumes = _resumed_steps(out)
    assert len(resumes) == KILLS, out[-4000:]
    for (step, path), newest in zip(resumes, newest_at_kill):
        assert step >= newest, f"resumed from step {step}, older than its commit {newest}"
        assert (path / MANIFEST_NAME).exists(), f"resumed from a partial step: {path}"
    committed = {e.path: e for e in _committed(root)}
    for step, path in resumes:               # every one resumed from verifies byte for byte
        layout.verify_entry(committed[path])
    assert in_save >= KILLS // 4, f"only {in_save} of {KILLS} kills landed inside a save"
