"""`kempner-resilience launch`: one's own script on local ranks, relaunched until it is done.

Real processes and real signals: the command line is started as a user would start it, the
ranks are its children, a signal reaches one rank with ``os.kill`` (as SLURM's ``--signal`` or a
stray ``kill`` would), Ctrl+C is a SIGINT to the launcher's process group (what a terminal
sends). The user script is the demo trainer (DDP, dropout, Adam, shuffled data), run through
its own command line: nothing in it knows about the launcher.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import assert_bitwise_equal, env, wait_for_file, write_script
from kempner_resilience.exitcodes import ExitCode

STEPS = 30


def launch(*args: str, cwd: Path) -> subprocess.Popen:
    """``kempner-resilience launch ARGS`` as a terminal's foreground job (own process group),
    its ranks started cold, as a user's are by default (``rank_pids`` reads them as its
    children, and their environment from /proc)."""
    return subprocess.Popen([sys.executable, "-m", "kempner_resilience.cli", "launch", *args],
                            cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env(KEMPNER_RESILIENCE_WARM="0"), start_new_session=True)


def finish(proc: subprocess.Popen, timeout: float = 180) -> tuple[int, str]:
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return proc.returncode, err


def trainer(work: Path, out: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kempner_resilience.demo.train", "--steps", str(STEPS),
            "--quiet", "--out", str(out), "--set", f"checkpoint.dir={work / 'ckpt'}",
            "--set", "signals.grace_s=60", "--set", "watchdog.hang_timeout_s=120", *extra]


def rank_pids(launcher: subprocess.Popen) -> dict[int, int]:
    """rank -> pid of the launcher's child processes (its ranks), read from /proc."""
    children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    out = {}
    for pid in map(int, children):
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        rank = next(v for v in environ if v.startswith(b"RANK=")).split(b"=", 1)[1]
        out[int(rank)] = pid
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    work = tmp_path_factory.mktemp("straight")
    code, err = finish(launch("--ranks", "2", "--", *trainer(work, work / "w.pt"), cwd=work))
    assert code == 0, err
    return torch.load(work / "w.pt", weights_only=True)


def launch_trainer(tmp_path):
    """``launch --ranks 2`` of the trainer, slow enough to be signalled mid-run; its progress."""
    progress = tmp_path / "progress"
    proc = launch("--ranks", "2", "--", *trainer(tmp_path, tmp_path / "w.pt", "--step-time",
                                                 "0.05", "--progress", str(progress)),
                  cwd=tmp_path)
    return proc, progress


def test_a_script_signalled_on_one_rank_is_relaunched_and_ends_bitwise_equal_to_a_straight_run(
        tmp_path, reference):
    proc, progress = launch_trainer(tmp_path)
    try:
        wait_for_file(progress, timeout=120, contains="rank 1 step 5\n")
        os.kill(rank_pids(proc)[1], signal.SIGUSR1)      # one rank only: they agree on a stop
    finally:
        code, err = finish(proc)
    assert code == 0, err
    assert "ranks exited [75, 75]" in err and "relaunching (restart 1 of 20)" in err
    assert "KEMPNER_RESTART_COUNT=1): ranks exited [0, 0]" in err
    emergency = [p for p in (tmp_path / "ckpt").glob("step_*")
                 if '"reason":"emergency"' in (p / "MANIFEST.json").read_text()]
    assert len(emergency) == 1
    assert_bitwise_equal(reference, torch.load(tmp_path / "w.pt", weights_only=True))


def test_ctrl_c_checkpoints_every_rank_and_exits_130_without_a_relaunch(tmp_path):
    proc, progress = launch_trainer(tmp_path)
    try:
        wait_for_file(progress, timeout=120, contains="rank 1 step 3\n")
        os.killpg(proc.pid, signal.SIGINT)        # what a terminal sends on Ctrl+C
    finally:
        code, err = finish(proc)
    assert code == ExitCode.SIGINT, err
    assert "ranks exited [130, 130]" in err and "launch 2" not in err
    committed = [p for p in (tmp_path / "ckpt").glob("step_*")
                 if '"reason":"emergency"' in (p / "MANIFEST.json").read_text()]
    assert len(committed) == 1
    assert not (tmp_path / "w.pt").exists()


# A script that records what it was given, then exits with the codes it is told, one a launch.
RECORDER = """
import os, sys
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "KEMPNER_RESTART_COUNT")
with open(sys.argv[1], "a") as f:
    f.write(" ".join(os.environ.get(k, "-") for k in keys) + "\\n")
codes = [int(c) for c in sys.argv[2].split(",")]
sys.exit(codes[min(int(os.environ["KEMPNER_RESTART_COUNT"]), len(codes) - 1)])
"""


def _record(tmp_path: Path, codes: str, *options: str) -> tuple[int, list[list[str]]]:
    script = write_script(tmp_path, RECORDER)
    seen = tmp_path / "seen"
    code, err = finish(launch(*options, "--", sys.executable, str(script), str(seen), codes,
                              cwd=tmp_path), timeout=60)
    lines = seen.read_text().splitlines() if seen.exists() else []
    return code, sorted(line.split() for line in lines)


def test_a_script_that_fails_with_1_is_not_relaunched_and_launch_exits_1(tmp_path):
    code, seen = _record(tmp_path, "1", "--ranks", "2")
    assert code == 1
    assert len(seen) == 2          # one launch of two ranks


def test_each_rank_gets_its_rank_and_a_rendezvous_and_relaunches_count_as_restarts(tmp_path):
    code, seen = _record(tmp_path, "75,81,0", "--ranks", "2")
    assert code == 0
    assert sorted((s[0], s[1], s[2], s[3], s[5]) for s in seen) == [
        (rank, "2", rank, "127.0.0.1", restart) for rank in "01" for restart in "012"]
    for restart in "012":       # both ranks of a launch meet at one port
        ports = {s[4] for s in seen if s[5] == restart}
        assert len(ports) == 1 and ports.pop().isdigit()


def test_ranks_sharing_the_machine_get_one_intra_op_thread_unless_the_user_chose(monkeypatch):
    from kempner_resilience.supervise.local.launcher import LocalLauncher

    def threads(ranks: int) -> str | None:
        launcher = LocalLauncher(["python", "train.py"], ranks=ranks, workdir=None)
        return launcher.rank_env(0, "29500", 0).get("OMP_NUM_THREADS")

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert threads(2) == "1"          # as torchrun does
    assert threads(1) is None         # one rank has the cores to itself
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    assert threads(2) == "4"


def test_a_spent_restart_budget_ends_the_relaunches_with_the_budget_code_not_run_it_again(
        tmp_path):
    # The ranks said 75 (run it again) each time; after the budget nothing runs it again, and
    # the launcher says so with 77, as a rank whose own budget is spent does.
    code, seen = _record(tmp_path, "75", "--ranks", "1", "--max-restarts", "2")
    assert code == ExitCode.NO_REQUEUE
    assert sorted(s[5] for s in seen) == ["0", "1", "2"]    # three launches, counted
