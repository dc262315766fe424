"""`kempner-resilience launch` asks the one policy (``supervise/policy.py``) and never hangs.

Real processes: the launcher is started as a user starts it, its ranks end as the test's script
tells them (an exit code, a SIGSTOP of their own), and a real training script raises on one
rank. What is asserted is what a user sees: launch's exit status, how often the ranks were
started, and what the log says.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import env, write_script
from kempner_resilience.exitcodes import ExitCode

# Records "RANK RESTART PID", then ends as told: argv[2] is one entry per launch (";"), each one
# action per rank (","): an exit code, or "freeze" (SIGSTOP itself, as a frozen node does).
SCRIPT = """
import os, signal, sys, time
rank, restart = int(os.environ["RANK"]), int(os.environ["KEMPNER_RESTART_COUNT"])
with open(sys.argv[1], "a") as f:
    f.write(f"{rank} {restart} {os.getpid()}\\n")
launches = sys.argv[2].split(";")
action = launches[min(restart, len(launches) - 1)].split(",")[rank]
if action == "freeze":
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(3600)
if rank == 0 and action == "81":
    time.sleep(0.5)          # a survivor notices its lost peer after the peer's own end
sys.exit(int(action))
"""


def _launch(tmp_path: Path, plan: str, *options: str, timeout: float = 60):
    """(exit status, stderr, [(rank, restart)] started) of ``launch OPTIONS -- SCRIPT``; every
    rank the script started is killed afterwards, whatever happened (a frozen one included)."""
    script = write_script(tmp_path, SCRIPT)
    seen = tmp_path / "seen"

    def started() -> list[tuple[int, ...]]:
        lines = seen.read_text().split("\n") if seen.exists() else []
        return [tuple(map(int, line.split())) for line in lines if line]

    def kill_ranks() -> None:       # no rank of ours outlives the test (a frozen one included)
        for _, _, pid in started():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    proc = subprocess.Popen([sys.executable, "-m", "kempner_resilience.cli", "launch", *options,
                             "--", sys.executable, str(script), str(seen), plan],
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env(), start_new_session=True)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        kill_ranks()                # they hold the launcher's stderr open
        _, err = proc.communicate()
        err += "\n[test] launch did not end within the test's timeout"
    finally:
        kill_ranks()
    return proc.returncode, err, sorted((rank, restart) for rank, restart, _ in started())


def test_a_rank_error_its_peer_saw_as_a_lost_peer_exits_1_without_a_relaunch(tmp_path):
    code, err, started = _launch(tmp_path, "81,1", "--ranks", "2")
    assert code == ExitCode.ERROR, err
    assert started == [(0, 0), (1, 0)]        # one launch, not --max-restarts of them
    assert "not relaunched" in err


def test_a_rank_frozen_after_another_hung_is_killed_after_the_grace_and_the_job_relaunched(
        tmp_path):
    code, err, started = _launch(tmp_path, "freeze,42;0,0", "--ranks", "2",
                                 "--stop-timeout", "2")
    assert code == 0, err
    assert started == [(0, 0), (0, 1), (1, 0), (1, 1)]     # killed, then relaunched once
    assert "ranks [0] did not stop within --stop-timeout and were killed" in err


def test_a_frozen_rank_with_no_restart_left_ends_launch_with_the_hang(tmp_path):
    code, err, started = _launch(tmp_path, "freeze,42", "--ranks", "2", "--stop-timeout", "2",
                                 "--max-restarts", "0")
    assert code == ExitCode.HANG, err
    assert started == [(0, 0), (1, 0)]
    assert "restart budget" in err


def test_a_rank_that_left_the_loop_early_is_named_in_the_log_and_not_relaunched(tmp_path):
    code, err, started = _launch(tmp_path, "0,81", "--ranks", "2")
    assert code == ExitCode.ERROR, err
    assert started == [(0, 0), (1, 0)]
    assert "rank(s) [0] left run.steps early" in err


# A DDP training under ResilientRun whose rank 1 raises at step 3: a deterministic bug.
RAISES = """
import os, sys
import kempner_resilience as kr
import torch, torch.distributed as dist
from torch import nn

rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
model = nn.parallel.DistributedDataParallel(nn.Linear(8, 8))
optim = torch.optim.SGD(model.parameters(), lr=1e-3)
cfg = kr.load_config(None, [f"checkpoint.dir={sys.argv[1]}", "watchdog.hang_timeout_s=60",
                            "rescue.budget_s=10"])
with kr.ResilientRun(cfg, state={"model": model, "optim": optim}) as run:
    for step in run.steps(1000):
        if rank == 1 and step == 3:
            raise ValueError("a bug on rank 1")
        optim.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        optim.step()
"""


@pytest.mark.slow
def test_a_training_script_that_raises_on_one_rank_ends_launch_with_its_error_not_a_relaunch(
        tmp_path):
    script = write_script(tmp_path, RAISES, "train.py")
    proc = subprocess.Popen([sys.executable, "-m", "kempner_resilience.cli", "launch",
                             "--ranks", "2", "--", sys.executable, str(script),
                             str(tmp_path / "ckpt")], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env(),
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == ExitCode.ERROR, err
    assert "launch 2 " not in err and "ValueError: a bug on rank 1" in err


# A training that sets checkpoint.dir in code and dies at step 3 of every launch: the first
# launch commits step 2, every later one resumes there and dies before it commits anything new.
STALLS = """
import os, sys
import kempner_resilience as kr
import torch

cfg = kr.load_config(None, [f"checkpoint.dir={sys.argv[1]}", "checkpoint.every_steps=2",
                            "requeue.max_no_progress=2"])
model = torch.nn.Linear(2, 2)
with open(sys.argv[2], "a") as f:
    f.write("launch\\n")
with kr.ResilientRun(cfg, state={"model": model}) as run:
    for step in run.steps(100):
        if step == 3:
            os._exit(81)
"""


def test_launch_stops_a_run_that_makes_no_progress_whatever_way_the_script_sets_its_directory(
        tmp_path):
    # launch is given no checkpoint directory: rank 0 names its run's in the channel.
    script = write_script(tmp_path, STALLS, "train.py")
    seen = tmp_path / "launches"
    tmp = tmp_path / "tmp"      # the launcher's own temporary directory: no other test's
    tmp.mkdir()
    res = subprocess.run([sys.executable, "-m", "kempner_resilience.cli", "launch", "--",
                          sys.executable, str(script), str(tmp_path / "ckpt"), str(seen)],
                         cwd=tmp_path, capture_output=True, text=True, env=env(TMPDIR=str(tmp)),
                         timeout=240)
    assert res.returncode == ExitCode.NO_REQUEUE, res.stderr[-3000:]
    # committed 2 (progress), then 2 relaunches in a row without a newer step: not 21 launches
    assert seen.read_text().count("launch") == 3, res.stderr[-3000:]
    assert "no progress" in res.stderr
    # the launcher's channel went with it
    assert not list(tmp.glob("kempner-resilience-launch-*"))
