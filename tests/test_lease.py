"""One live run per checkpoint directory: a second live run on the same ``checkpoint.dir`` stops
at start with 78 naming the holder, and never costs the holder a checkpoint; a run that died
without a clean exit leaves a lease that the next attempt takes over."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from helpers import env, start, write_script
from kempner_resilience.checkpoint import layout, lease
from kempner_resilience.exitcodes import ExitCode

TRAIN = """
import os, sys, time
import torch
import kempner_resilience as kr

cfg = kr.load_config(overrides=[f"checkpoint.dir={sys.argv[1]}", "checkpoint.every_steps=5",
                                "checkpoint.keep_last=100"])
model = torch.nn.Linear(8, 8)
with kr.ResilientRun(cfg, state={"model": model}) as run:
    for step in run.steps(int(sys.argv[2])):
        with torch.no_grad():
            model.weight.add_(1.0)
        print(f"step {step}", flush=True)
        time.sleep(float(sys.argv[3]))
        while step == 30 and not os.path.exists(sys.argv[1] + ".go-on"):
            time.sleep(0.05)                     # held here until the test says go on
print("finished", flush=True)
"""


def _wait_for_line(proc: subprocess.Popen, text: str, timeout: float = 120.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if text in line:
            return
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"never printed {text!r} (exit {proc.poll()}): {proc.stderr.read()}")


def _run(script, ckpt, steps, step_s=0.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), str(ckpt), str(steps), str(step_s)],
                          capture_output=True, text=True, env=env(), timeout=300)


def test_a_second_live_run_on_the_directory_exits_78_naming_the_first_which_keeps_its_checkpoints(
        tmp_path):
    script, ckpt = write_script(tmp_path, TRAIN), tmp_path / "ckpt"
    first = start(script, str(ckpt), "60", "0.1")
    try:
        _wait_for_line(first, "step 12")               # it has committed step 10
        second = _run(script, ckpt, 20)
        assert second.returncode == int(ExitCode.CONFIG), second.stderr
        assert f"pid {first.pid}" in second.stderr and socket.gethostname() in second.stderr
        assert "in use by another live run" in second.stderr
        assert "Traceback" not in second.stderr
        (tmp_path / "ckpt.go-on").touch()
        out, err = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 0 and "finished" in out, err
    steps = [e.step for e in layout.scan(ckpt) if e.committed]
    assert steps == list(range(5, 61, 5))
    verify = subprocess.run([sys.executable, "-m", "kempner_resilience.cli", "verify", str(ckpt)],
                            capture_output=True, text=True, env=env(), timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert not (ckpt / lease.LEASE_FILE).exists()     # given up at the clean exit


def test_the_next_attempt_takes_the_directory_over_from_a_holder_killed_without_a_clean_exit(
        tmp_path):
    script, ckpt = write_script(tmp_path, TRAIN), tmp_path / "ckpt"
    first = start(script, str(ckpt), "60", "0.1")
    try:
        _wait_for_line(first, "step 12")
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=60)
    finally:
        first.kill()
    assert json.loads((ckpt / lease.LEASE_FILE).read_text())["pid"] == first.pid
    again = _run(script, ckpt, 20)
    assert again.returncode == 0, again.stderr
    assert "took over the lease" in again.stderr and "has exited" in again.stderr
    assert "resumed from" in again.stderr


def _foreign_lease(root, **fields):
    root.mkdir(parents=True, exist_ok=True)
    holder = {"host": "some-other-node", "pid": 4242, "start": "1", "job_id": "77",
              "restart_count": None, "run_id": "r", "token": "t", **fields}
    (root / lease.LEASE_FILE).write_text(json.dumps(holder))
    return root / lease.LEASE_FILE


def test_a_lease_whose_heartbeat_stopped_long_ago_on_another_host_is_taken_over(tmp_path):
    path = _foreign_lease(tmp_path / "ckpt")
    old = time.time() - 2 * lease.STALE_S
    os.utime(path, (old, old))
    held = lease.acquire(tmp_path / "ckpt", job_id="78")
    try:
        assert json.loads(path.read_text())["token"] == held.me["token"]
    finally:
        held.release()
    assert not path.exists()


def test_a_requeued_attempt_of_the_same_job_takes_its_predecessors_lease_at_once(tmp_path):
    path = _foreign_lease(tmp_path / "ckpt", job_id="77", restart_count=None)
    t0 = time.monotonic()
    held = lease.acquire(tmp_path / "ckpt", job_id="77", restart_count=1)
    held.release()
    assert time.monotonic() - t0 < lease.HEARTBEAT_S     # no wait for staleness
    assert not path.exists()


def test_a_holder_on_another_host_whose_heartbeat_moves_is_refused(tmp_path):
    path = _foreign_lease(tmp_path / "ckpt")
    stop = threading.Event()

    def beat():
        while not stop.wait(0.3):
            os.utime(path)
    t = threading.Thread(target=beat, daemon=True)
    t.start()
    try:
        with pytest.raises(lease.DirectoryInUseError, match="some-other-node, pid 4242"):
            lease.acquire(tmp_path / "ckpt", job_id="78")
    finally:
        stop.set()
    assert json.loads(path.read_text())["token"] == "t"   # the holder's lease is untouched
