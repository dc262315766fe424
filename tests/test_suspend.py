"""A suspended job is not a hung one (issue 20): ``scontrol suspend``/``resume`` and
``PreemptMode=SUSPEND`` stop every task (SIGSTOP, or a cgroup freeze) and continue it later.

Real processes: 2 DDP ranks over gloo (the demo's model, Adam, shuffled data, per-rank RNG),
stopped for twice ``watchdog.hang_timeout_s`` in the middle of training, then continued. The run
goes on and ends bitwise equal to an uninterrupted one. Before, the hang backstop's kernel timer
expired during the stop and ended every rank with HANG at SIGCONT, before any Python ran.

The backstop that replaced it, a monitor process per rank, never outlives its rank.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from helpers import (assert_bitwise_equal, child_pids, env, start_running, wait_for_file,
                     write_script)
from kempner_resilience.demo.launcher import LocalLauncher

HELPER = Path(__file__).resolve().parent / "checkpoint_helpers" / "rescue_job.py"
STEPS, EVERY, STOP_AT, HANG_TIMEOUT_S = 24, 10, 12, 3.0


@pytest.fixture(scope="module", autouse=True)
def _cold_ranks():
    """The ranks started cold: ``_ranks`` finds them as this process's children running the
    helper (a warm rank is the zygote's child, its command line the zygote's)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KEMPNER_RESILIENCE_WARM", "0")
        yield


def _ranks() -> list[int]:
    """Our children running the helper: the launcher's ranks."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2:].split()[1]) == me and str(HELPER).encode() in cmdline:
            found.append(int(entry))
    return found


def run_job(work: Path, stop=None):
    """The job, in one launch; ``stop(pids)`` is called once rank 0 finished step STOP_AT."""
    work.mkdir(parents=True, exist_ok=True)
    out = work / "weights.pt"
    cmd = [sys.executable, str(HELPER), "--steps", str(STEPS), "--out", str(out),
           "--step-time", "0.02",
           "--set", f"checkpoint.dir={work / 'ckpt'}", "--set", f"checkpoint.every_steps={EVERY}",
           "--set", f"watchdog.hang_timeout_s={HANG_TIMEOUT_S}"]
    stopped: list[int] = []

    def on_progress(index: int, step: int) -> None:
        if stop is not None and step >= STOP_AT and not stopped:
            stopped.extend(_ranks())
            stop(stopped)

    [launch] = LocalLauncher(cmd, ranks=2, workdir=work, max_launches=1, stop_timeout_s=90,
                             on_progress=on_progress).run()
    assert stop is None or len(stopped) == 2
    weights = torch.load(out, weights_only=True) if out.exists() else None
    return launch, weights


def logs(work: Path) -> str:
    return "".join(p.read_text() for p in sorted(work.glob("rank*.0.log")))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    launch, weights = run_job(tmp_path_factory.mktemp("suspend-ref"))
    assert launch.exit_codes == [0, 0]
    return weights


def _stop_then_continue(send, pids: list[int]) -> None:
    """Stop every pid now (``send(pid, sig)``), continue them after twice the hang timeout."""
    for pid in pids:
        send(pid, signal.SIGSTOP)

    def resume() -> None:
        for pid in pids:
            send(pid, signal.SIGCONT)

    threading.Timer(2 * HANG_TIMEOUT_S, resume).start()


@pytest.mark.slow
def test_a_job_stopped_for_twice_the_hang_timeout_goes_on_when_continued(tmp_path, reference):
    # Each rank's process group, its helper processes too: what a suspend does to every task.
    begun = time.monotonic()
    launch, weights = run_job(tmp_path, stop=lambda pids: _stop_then_continue(os.killpg, pids))
    assert launch.exit_codes == [0, 0], launch.stderr_tail
    assert time.monotonic() - begun >= 2 * HANG_TIMEOUT_S   # the stop did happen
    assert "hang clock paused" in logs(tmp_path)
    assert_bitwise_equal(reference, weights)


# One step stopped in its middle that still has a while to go after the resume (a long step):
# no heartbeat comes to save the rank, the hang clocks themselves must not have run.
LONG_STEP = """
import os, sys, time
import kempner_resilience as kr
inside, go = sys.argv[1], sys.argv[2]
with kr.ResilientRun(kr.load_config(overrides=["watchdog.hang_timeout_s=%s"])) as run:
    for step in run.steps(6):
        time.sleep(0.05)
        if step == 3:
            open(inside, "w").write("stop me")
            while not os.path.exists(go):     # the test continues us, then says go
                time.sleep(0.01)
            end = time.monotonic() + 1.0      # the rest of the step: 1 s with no heartbeat
            while time.monotonic() < end:
                time.sleep(0.01)
print("done", flush=True)
"""


@pytest.mark.parametrize("send", [os.killpg, os.kill], ids=["with-its-helpers", "alone"])
def test_a_process_stopped_inside_a_long_step_is_not_taken_for_hung(tmp_path, send):
    # os.killpg: the process and its hang monitor stop together (a suspend, a cgroup freeze);
    # os.kill: the process alone, the monitor sees it stopped.
    script = write_script(tmp_path, LONG_STEP % HANG_TIMEOUT_S)
    inside, go = tmp_path / "inside", tmp_path / "go"
    proc = subprocess.Popen([sys.executable, str(script), str(inside), str(go)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env(), start_new_session=True)
    try:
        wait_for_file(inside)
        send(proc.pid, signal.SIGSTOP)
        time.sleep(2 * HANG_TIMEOUT_S)
        send(proc.pid, signal.SIGCONT)
        go.write_text("go")
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "done" in out
    assert "hang clock paused" in err


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def test_the_hang_backstop_monitor_ends_with_its_rank_when_the_rank_is_killed(tmp_path):
    script = write_script(tmp_path, """
        import sys, time
        import kempner_resilience as kr
        with kr.ResilientRun(kr.load_config(overrides=["watchdog.hang_timeout_s=60"])) as run:
            for step in run.steps(10**6):
                if step == 1:
                    open(sys.argv[1], "w").write("running")
                time.sleep(0.01)
    """)
    proc = start_running(script, tmp_path / "stamp")
    try:
        [monitor] = child_pids(proc.pid)        # the backstop's monitor process
        assert not _gone(monitor)
    finally:
        proc.kill()
        proc.communicate()
    end = time.monotonic() + 30
    while not _gone(monitor) and time.monotonic() < end:
        time.sleep(0.01)
    assert _gone(monitor), "the monitor outlived its rank"
