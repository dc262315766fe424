"""One live run per checkpoint directory: a second live run on the same ``checkpoint.dir`` stops
at start with 78 naming the holder, and never costs the holder a checkpoint; a run that died
without a clean exit leaves a lease that the next attempt takes over."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from helpers import env, free_port, run_script, start, write_script
from kempner_resilience.checkpoint import layout, lease
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.core.runpaths import RunPaths

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
    return run_script([sys.executable, str(script), str(ckpt), str(steps), str(step_s)],
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
    steps = [e.step for e in layout.scan(RunPaths(ckpt)) if e.committed]
    assert steps == list(range(5, 61, 5))
    verify = run_script([sys.executable, "-m", "kempner_resilience.cli", "verify", str(ckpt)],
                            capture_output=True, text=True, env=env(), timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    assert not RunPaths(ckpt).lease.exists()     # given up at the clean exit


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
    assert json.loads(RunPaths(ckpt).lease.read_text())["pid"] == first.pid
    again = _run(script, ckpt, 20)
    assert again.returncode == 0, again.stderr
    assert "took over the lease" in again.stderr and "has exited" in again.stderr
    assert "resumed from" in again.stderr


def _foreign_lease(root, **fields):
    root.mkdir(parents=True, exist_ok=True)
    holder = {"host": "some-other-node", "pid": 4242, "start": "1", "job_id": "77",
              "restart_count": None, "run_id": "r", "token": "t", **fields}
    RunPaths(root).lease.write_text(json.dumps(holder))
    return RunPaths(root).lease


def test_a_lease_whose_heartbeat_stopped_long_ago_on_another_host_is_taken_over(tmp_path):
    path = _foreign_lease(tmp_path / "ckpt")
    old = time.time() - 2 * lease.STALE_S
    os.utime(path, (old, old))
    held = lease.acquire(RunPaths(tmp_path / "ckpt"), job_id="78")
    try:
        assert json.loads(path.read_text())["token"] == held.me["token"]
    finally:
        held.release()
    assert not path.exists()


def test_a_requeued_attempt_of_the_same_job_takes_its_predecessors_lease_at_once(tmp_path):
    path = _foreign_lease(tmp_path / "ckpt", job_id="77", restart_count=None)
    t0 = time.monotonic()
    held = lease.acquire(RunPaths(tmp_path / "ckpt"), job_id="77", restart_count=1)
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
            lease.acquire(RunPaths(tmp_path / "ckpt"), job_id="78")
    finally:
        stop.set()
    assert json.loads(path.read_text())["token"] == "t"   # the holder's lease is untouched


# ------------------------------------------------------------------ a run that lost its lease

# A run whose lease names the host in $FAKE_HOST (another node, as far as the lease can tell: it
# records socket.gethostname()), adding ADD to its weights at every step, held at step 30 while
# CKPT.hold exists; its final weights go to OUT.
HOLDER = """
import os, socket, sys, time
if os.environ.get("FAKE_HOST"):
    socket.gethostname = lambda: os.environ["FAKE_HOST"]
import torch
import kempner_resilience as kr

ckpt, total, step_s, add, out = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), \\
    float(sys.argv[4]), sys.argv[5]
cfg = kr.load_config(overrides=[f"checkpoint.dir={ckpt}", "checkpoint.every_steps=5",
                                "checkpoint.keep_last=2"])
model = torch.nn.Linear(8, 8)
with kr.ResilientRun(cfg, state={"model": model}) as run:
    for step in run.steps(total):
        with torch.no_grad():
            model.weight.add_(add)
        print(f"step {step}", flush=True)
        time.sleep(step_s)
        while step == 30 and os.path.exists(ckpt + ".hold"):
            time.sleep(0.05)
torch.save(model.state_dict(), out)
print("finished", flush=True)
"""

TIMEOUT_S = 3.0      # the lease's timeout in these runs (heartbeat: a twelfth of it)


def _files(root):
    """Every file under ``root`` but the lease (its holder's heartbeat touches it), with its
    size and mtime."""
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != ".lease":
            st = p.stat()
            out[str(p.relative_to(root))] = (st.st_size, st.st_mtime_ns)
    return out


def test_a_holder_frozen_past_the_lease_timeout_and_taken_over_exits_82_having_written_nothing(
        tmp_path):
    import torch

    script, ckpt = write_script(tmp_path, HOLDER), tmp_path / "ckpt"
    timeout = {lease.TIMEOUT_ENV: str(TIMEOUT_S)}
    (tmp_path / "ckpt.hold").touch()
    a = start(script, str(ckpt), "100000", "0.05", "1.0", str(tmp_path / "a.pt"),
              FAKE_HOST="node-a-elsewhere", **timeout)
    b = None
    try:
        _wait_for_line(a, "step 12")                   # A committed step 10
        a.send_signal(signal.SIGSTOP)                  # frozen: its heartbeat stops
        holder = json.loads(RunPaths(ckpt).lease.read_text())
        assert holder["host"] == "node-a-elsewhere" and holder["pid"] == a.pid
        b = start(script, str(ckpt), "40", "0.02", "100.0", str(tmp_path / "b.pt"), **timeout)
        _wait_for_line(b, "step 30")                   # B took over, committed 15..30, holds
        time.sleep(1.0)                                # B's retention after its commit is done
        before = _files(ckpt)
        a.send_signal(signal.SIGCONT)
        _, a_err = a.communicate(timeout=60)
        assert a.returncode == int(ExitCode.LEASE_LOST) == 82, a_err
        assert "lost its lease" in a_err and "Traceback" not in a_err
        assert _files(ckpt) == before                  # A wrote, committed, deleted nothing
        (tmp_path / "ckpt.hold").unlink()
        _, b_err = b.communicate(timeout=120)
        assert b.returncode == 0, b_err
        assert "took over the lease" in b_err
    finally:
        a.send_signal(signal.SIGCONT)
        a.kill()
        if b is not None:
            b.kill()
    committed = [e.step for e in layout.scan(RunPaths(ckpt)) if e.committed]
    assert committed == [35, 40]                       # B's, keep_last=2
    verify = run_script([sys.executable, "-m", "kempner_resilience.cli", "verify", str(ckpt)],
                            capture_output=True, text=True, env=env(), timeout=120)
    assert verify.returncode == 0, verify.stdout + verify.stderr
    # The next run resumes from B's last checkpoint: B's weights, bit for bit.
    again = _run_holder(script, ckpt, tmp_path / "c.pt")
    assert again.returncode == 0, again.stderr
    assert "step 40" in again.stderr
    assert torch.equal(torch.load(tmp_path / "c.pt")["weight"],
                       torch.load(tmp_path / "b.pt")["weight"])


def _run_holder(script, ckpt, out) -> subprocess.CompletedProcess:
    return run_script([sys.executable, str(script), str(ckpt), "40", "0", "0", str(out)],
                          capture_output=True, text=True, env=env(), timeout=300)


def test_a_lease_rewritten_to_name_another_host_is_lost_naming_that_holder_and_the_real_times(
        tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    held = lease.acquire(RunPaths(root), stale_s=12.0)           # a heartbeat every second
    path = RunPaths(root).lease
    try:
        # A run on another host took the lease (or someone edited the file) while this one
        # was alive and beating: no pause, no timeout passed.
        path.write_text(json.dumps(dict(held.me, host="node-b-elsewhere", pid=4242,
                                        run_id="run-b", token="theirs")))
        with pytest.raises(lease.LeaseLost) as err:
            held.check()
    finally:
        held.release()
    why = str(err.value)
    assert "the lease now names host node-b-elsewhere, pid 4242, run run-b" in why, why
    assert "another run took it over, or the file was rewritten" in why
    touched = float(re.search(r"heartbeat touched it ([\d.]+) s ago", why).group(1))
    assert touched < 2.0 and "the lease's 12 s timeout" in why
    assert "paused" not in why, "it was never paused"
    assert json.loads(path.read_text())["token"] == "theirs"     # the other's lease stays


def test_a_lease_missing_for_a_few_heartbeats_is_written_again_and_the_heartbeat_goes_on(
        tmp_path):
    root = tmp_path / "ckpt"
    root.mkdir()
    held = lease.acquire(RunPaths(root), stale_s=1.2)            # a heartbeat every 0.1 s
    path, away = RunPaths(root).lease, root / "lease.away"
    try:
        os.rename(path, away)                          # moved away: as a takeover's rename does
        time.sleep(0.35)
        assert json.loads(path.read_text())["token"] == held.me["token"]   # written again
        os.rename(away, path)                          # ... and moved back over it
        time.sleep(0.3)
        assert not held.lost
        before = path.stat().st_mtime_ns
        time.sleep(0.3)
        assert path.stat().st_mtime_ns != before       # the heartbeat still beats
    finally:
        held.release()
    assert not path.exists()


def test_a_lease_that_is_a_dangling_symlink_is_taken_over_at_once_with_a_warning(tmp_path):
    script, ckpt = write_script(tmp_path, TRAIN), tmp_path / "ckpt"
    ckpt.mkdir()
    os.symlink(tmp_path / "nowhere", RunPaths(ckpt).lease)
    proc = run_script([sys.executable, str(script), str(ckpt), "10", "0"],
                          capture_output=True, text=True, env=env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "took over the lease" in proc.stderr and "symbolic link" in proc.stderr
    assert [e.step for e in layout.scan(RunPaths(ckpt)) if e.committed] == [5, 10]


@pytest.mark.parametrize("pid", [0, -1, 10**30, "4242", True])
def test_a_lease_naming_a_pid_no_process_can_have_is_taken_over_at_once(tmp_path, pid):
    path = _foreign_lease(tmp_path / "ckpt", host=socket.gethostname(), pid=pid)
    t0 = time.monotonic()
    held = lease.acquire(RunPaths(tmp_path / "ckpt"), job_id="78", stale_s=30.0)
    try:
        assert json.loads(path.read_text())["token"] == held.me["token"]
    finally:
        held.release()
    assert time.monotonic() - t0 < 5.0                 # no wait for staleness


def test_a_lease_dated_in_the_future_whose_heartbeat_never_moves_is_taken_over(tmp_path):
    path = _foreign_lease(tmp_path / "ckpt")
    future = time.time() + 3600                        # a holder whose clock runs an hour ahead
    os.utime(path, (future, future))
    held = lease.acquire(RunPaths(tmp_path / "ckpt"), job_id="78", stale_s=1.0)
    try:
        assert json.loads(path.read_text())["token"] == held.me["token"]
    finally:
        held.release()


# Two gloo ranks saving every EVERY steps; at step 12 (step 10 committed) rank 0's lease is
# replaced by another run's, as a takeover leaves it, and what the directory holds then is
# written down beside it.
TWO_RANKS = """
import json, os, sys, time
import torch, torch.distributed as dist
import kempner_resilience as kr

ckpt, rank, port, every = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(rank))
dist.init_process_group("gloo", rank=rank, world_size=2)
cfg = kr.load_config(overrides=[f"checkpoint.dir={ckpt}", f"checkpoint.every_steps={every}",
                                "checkpoint.keep_last=2", "watchdog.hang_timeout_s=120"])
model = torch.nn.Linear(8, 8)

def listing():
    return {os.path.relpath(os.path.join(d, n), ckpt): os.stat(os.path.join(d, n)).st_size
            for d, _, names in os.walk(ckpt) for n in names if n != ".lease"}

with kr.ResilientRun(cfg, state={"model": model}) as run:
    for step in run.steps(200):
        print(f"step {step}", flush=True)
        with torch.no_grad():
            model.weight.add_(1.0)
        if rank == 0 and step == 12:
            other = {"host": "node-b", "pid": 4242, "start": "1", "job_id": "99",
                     "restart_count": 0, "run_id": "r", "token": "the-new-holder"}
            with open(ckpt + "/.lease.new", "w") as f:
                json.dump(other, f)
            os.replace(ckpt + "/.lease.new", ckpt + "/.lease")
            with open(ckpt + ".listing", "w") as f:
                json.dump(listing(), f)
        dist.all_reduce(torch.ones(1))
        time.sleep(0.05)
print("finished", flush=True)
"""


# every 5: the save at step 15 finds the lease lost (rank 0's check, every rank told by the
# save's broadcast); every 10: no save comes first, the ranks agree on the stop as on a signal's.
@pytest.mark.parametrize("every", [5, 10])
def test_every_rank_stops_with_82_at_one_step_when_rank_0_loses_its_lease(tmp_path, every):
    script, ckpt = write_script(tmp_path, TWO_RANKS), tmp_path / "ckpt"
    port = str(free_port())
    procs = [start(script, str(ckpt), str(r), port, str(every), **{lease.TIMEOUT_ENV: "1.2"})
             for r in (0, 1)]
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == int(ExitCode.LEASE_LOST), err
        assert "Traceback" not in err and "finished" not in out
    last = [[ln for ln in out.splitlines() if ln.startswith("step ")][-1] for out, _ in outs]
    assert last[0] == last[1]                          # both stopped at the same boundary
    assert int(last[0].split()[1]) < (15 if every == 5 else 20)
    assert "lost its lease" in outs[0][1] and "rank 0 lost its lease" in outs[1][1]
    if every == 10:
        assert "the lease lost here at step" in outs[0][1]   # agreed through the store
    listed = json.loads((tmp_path / "ckpt.listing").read_text())
    now = {str(p.relative_to(ckpt)): p.stat().st_size for p in ckpt.rglob("*")
           if p.is_file() and p.name != ".lease"}
    assert now == listed                               # nothing written after the takeover
    assert json.loads(RunPaths(ckpt).lease.read_text())["token"] == "the-new-holder"
