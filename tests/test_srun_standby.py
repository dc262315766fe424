"""A node's standby and its srun tasks' shims (``supervise/srun/standby.py``, ``shim.py``),
run here without SLURM: the standby listens, each shim is what srun would start as a task."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from helpers import write_script
from kempner_resilience.supervise.local import warm
from kempner_resilience.supervise.srun.standby import SHIM

RANK = """
import json, os, sys, time
print(json.dumps({"pid": os.getpid(), "role": os.environ.get("ROLE"), "cwd": os.getcwd(),
                  "argv": sys.argv, "fds": sorted(os.listdir("/proc/self/fd"))}), flush=True)
sys.stderr.write("on stderr\\n")
if sys.argv[1] == "sleep":
    time.sleep(60)
sys.exit(int(sys.argv[1]))
"""

TRAIN = """
import os, sys, time
import kempner_resilience as kr
cfg = kr.load_config(None, [f"checkpoint.dir={sys.argv[1]}"])
with kr.ResilientRun(cfg) as run:
    for step in run.steps(100_000):
        time.sleep(0.02)
        if step == 3:
            print("training", os.getpid(), flush=True)
"""


FAST_COLD = {"KEMPNER_RESILIENCE_STANDBY_WAIT_S": "0"}


class Standby(str):
    """The standby's socket name, and its process."""
    proc: subprocess.Popen


@pytest.fixture
def standby(tmp_path):
    name = Standby(f"kr-test-standby-{uuid.uuid4().hex[:8]}")
    name.proc = subprocess.Popen([sys.executable, warm.__file__, "--listen", name,
                                  '{"preload": ["torch"], "ignore": [15, 10, 12, 1]}'])
    yield name
    # A test that failed half-way leaves no rank behind: a task still running is killed (a
    # warm rank dies with it; a cold one is the task), then the standby.
    for task in _TASKS:
        if task.poll() is None:
            task.kill()
            task.wait()
    _TASKS.clear()
    name.proc.kill()
    name.proc.wait()


_TASKS: list[subprocess.Popen] = []


def shim(name: str, *args: str, cwd: Path, **env: str) -> subprocess.Popen:
    _TASKS.append(subprocess.Popen([sys.executable, "-S", SHIM, name, sys.executable, *args],
                                   cwd=cwd,
                            env={**os.environ, **env}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True))
    return _TASKS[-1]


def first_line(proc: subprocess.Popen) -> dict:
    import json

    return json.loads(proc.stdout.readline())


def test_a_warm_rank_runs_with_its_tasks_environment_directory_streams_and_exit_code(
        standby, tmp_path):
    script = write_script(tmp_path, RANK, "rank.py")
    proc = shim(standby, str(script), "7", cwd=tmp_path, ROLE="rank 3")
    seen = first_line(proc)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 7
    assert seen["role"] == "rank 3" and seen["cwd"] == str(tmp_path)
    assert seen["argv"] == [str(script), "7"]
    assert seen["pid"] != proc.pid                    # forked by the standby, not the shim
    assert "on stderr" in err


def test_a_warm_rank_holds_the_same_open_files_as_a_cold_one(standby, tmp_path):
    script = write_script(tmp_path, RANK, "rank.py")
    warm_rank = shim(standby, str(script), "0", cwd=tmp_path)
    cold_rank = shim("kr-test-no-standby", str(script), "0", cwd=tmp_path, **FAST_COLD)
    warm_fds, cold_fds = first_line(warm_rank)["fds"], first_line(cold_rank)["fds"]
    for p in (warm_rank, cold_rank):
        p.communicate(timeout=60)
    assert warm_fds == cold_fds


def test_without_a_standby_on_the_node_the_task_runs_the_rank_itself(tmp_path):
    script = write_script(tmp_path, RANK, "rank.py")
    proc = shim("kr-test-no-standby", str(script), "3", cwd=tmp_path, **FAST_COLD)
    seen = first_line(proc)
    proc.communicate(timeout=60)
    assert proc.returncode == 3 and seen["pid"] == proc.pid    # exec'd: the task is the rank


def test_a_warm_rank_dies_with_its_task(standby, tmp_path):
    script = write_script(tmp_path, RANK, "rank.py")
    proc = shim(standby, str(script), "sleep", cwd=tmp_path)
    rank = first_line(proc)["pid"]
    proc.kill()
    proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and Path(f"/proc/{rank}").exists() \
            and "Z" not in Path(f"/proc/{rank}/stat").read_text().split(")")[1][:3]:
        time.sleep(0.05)
    assert not Path(f"/proc/{rank}").exists() or \
        "Z" in Path(f"/proc/{rank}/stat").read_text().split(")")[1][:3]


def test_a_signal_to_the_task_reaches_a_warm_rank_without_the_package_as_itself(
        standby, tmp_path):
    script = write_script(tmp_path, RANK, "rank.py")
    proc = shim(standby, str(script), "sleep", cwd=tmp_path)
    first_line(proc)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGTERM


def test_a_job_wide_sigterm_reaching_a_warm_rank_both_ways_is_one_graceful_stop(
        standby, tmp_path):
    script = write_script(tmp_path, TRAIN, "train.py")
    proc = shim(standby, str(script), str(tmp_path / "ckpt"), cwd=tmp_path)
    word, rank = proc.stdout.readline().split()
    rank = int(rank)
    assert word == "training" and rank != proc.pid
    # As SLURM does for --signal, the time limit or scancel: the task (the shim) and the
    # standby's step (where the rank lives) each get it.
    os.kill(rank, signal.SIGTERM)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143
    assert "stopping at step" in err and "second SIGTERM" not in err


def test_a_second_job_wide_sigterm_still_forces_the_warm_rank_out(standby, tmp_path):
    # The rank stays in step 3 (past its print) until the second signal forces it out.
    script = write_script(tmp_path, TRAIN.replace('flush=True)', 'flush=True); time.sleep(30)'),
                          "train.py")
    proc = shim(standby, str(script), str(tmp_path / "ckpt"), cwd=tmp_path)
    word, rank = proc.stdout.readline().split()
    rank = int(rank)
    assert word == "training" and rank != proc.pid
    for _ in range(2):
        os.kill(rank, signal.SIGTERM)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143
    assert "second SIGTERM" in err


def test_a_step_after_the_standby_step_ended_runs_its_ranks_cold_and_says_so(tmp_path, caplog):
    from kempner_resilience.config import load_config
    from kempner_resilience.supervise.srun.relaunch import Relauncher
    from kempner_resilience.supervise.srun.standby import Standby

    loop = Relauncher([sys.executable, "train.py"], 1, load_config(None, [f"checkpoint.dir={tmp_path}"]),
                      environ={"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[1-3]",
                               "SLURM_NTASKS_PER_NODE": "2"})
    ended = subprocess.Popen(["true"])
    ended.wait()
    loop.standby = Standby(ended, "kr-test-gone", "7")
    with caplog.at_level("WARNING"):
        cmd = loop.step_command(["n1", "n2"], 1)
    assert SHIM not in cmd and cmd[-2:] == [sys.executable, "train.py"]
    assert "the standby step is over" in caplog.text


def test_the_standby_keeps_no_thread_or_file_of_five_ranks_it_forked(standby, tmp_path):
    script = write_script(tmp_path, RANK, "rank.py")

    def held() -> tuple[int, int]:
        pid = standby.proc.pid
        return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))

    first = shim(standby, str(script), "0", cwd=tmp_path)
    first.communicate(timeout=60)
    before = held()
    for code in range(5):
        proc = shim(standby, str(script), str(code), cwd=tmp_path)
        proc.communicate(timeout=60)
        assert proc.returncode == code
    time.sleep(0.3)         # the standby closes a rank's connection once it reaped the rank
    assert held() == before


def test_a_warm_rank_killed_by_sigkill_ends_its_task_with_sigkill(standby, tmp_path):
    script = write_script(tmp_path, RANK, "rank.py")
    proc = shim(standby, str(script), "sleep", cwd=tmp_path)
    os.kill(first_line(proc)["pid"], signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
