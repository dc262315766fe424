"""The run knows when its allocation ends and stops in time to save, with no signal at all.

The end time is given through ``SLURM_JOB_END_TIME`` (as SLURM exports it) to real training
processes that run outside any SLURM job: they must stop on their own, commit the checkpoint of
the agreed step, exit with the requeue code, and resume to a result bitwise equal to an
uninterrupted run. (tests/test_slurm_time_limit.py does the same on the real cluster.)
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import time
from pathlib import Path

import pytest
import torch

import kempner_resilience as kr
from helpers import assert_bitwise_equal, env
from kempner_resilience.demo.launcher import LocalLauncher, train_command
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.core.ledger import read_ledger
from kempner_resilience.slurm.clock import RunClock, job_end_time

STEPS = 60


def train(work, out, *, end_time=None, extra=(), step_time=0.1):
    # A run with no end to race (the reference, the requeued attempt) passes step_time=0: the
    # step time is a sleep, it changes no tensor.
    cmd = train_command(STEPS, step_time=step_time, out=out,
                        overrides=[f"checkpoint.dir={work / 'ckpt'}", "signals.grace_s=60",
                                   "requeue.time_limit_margin_s=3", *extra])
    e = env()
    for k in ("SLURM_JOB_ID", "SLURM_JOB_END_TIME"):
        e.pop(k, None)
    if end_time is not None:
        e["SLURM_JOB_END_TIME"] = str(int(end_time))
    proc = subprocess.run(cmd, env=e, cwd=work, capture_output=True, text=True, timeout=120)
    return proc, time.time()


def test_end_time_comes_from_slurm_job_end_time():
    assert job_end_time({"SLURM_JOB_END_TIME": "1795435630"}) == 1795435630.0
    assert job_end_time({}) is None
    assert job_end_time({"SLURM_JOB_END_TIME": "soon"}) is None


def test_end_time_is_asked_of_squeue_once_when_the_environment_lacks_it(tmp_path):
    squeue = tmp_path / "squeue"
    squeue.write_text("#!/bin/sh\necho \"$@\" >> \"$(dirname \"$0\")/calls\"\n"
                      "echo 2030-01-02T03:04:05\n")
    squeue.chmod(squeue.stat().st_mode | stat.S_IEXEC)
    old = os.environ["PATH"]
    os.environ["PATH"] = f"{tmp_path}:{old}"
    try:
        end = job_end_time({"SLURM_JOB_ID": "4242"}, timeout=10)
    finally:
        os.environ["PATH"] = old
    assert end == time.mktime(time.strptime("2030-01-02T03:04:05", "%Y-%m-%dT%H:%M:%S"))
    assert (tmp_path / "calls").read_text().split() == ["-h", "-j", "4242", "-o", "%e"]


def _end_time_with(tmp_path: Path, monkeypatch, squeue: str,
                   timeout: float) -> tuple[float | None, list[str]]:
    """``job_end_time`` with a fake squeue running ``squeue`` (shell) and a fake scontrol that
    fails; the end and the tools called, in order."""
    for tool, body in (("squeue", squeue), ("scontrol", "exit 1")):
        fake = tmp_path / tool
        fake.write_text(f"#!/bin/sh\necho {tool} >> \"$(dirname \"$0\")/calls\"\n{body}\n")
        fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    end = job_end_time({"SLURM_JOB_ID": "4242"}, timeout=timeout)
    return end, (tmp_path / "calls").read_text().split()


def test_an_unreachable_controller_is_asked_once_and_the_log_says_the_end_is_unknown(
        tmp_path, monkeypatch, caplog):
    with caplog.at_level("WARNING"):
        end, calls = _end_time_with(
            tmp_path, monkeypatch, "echo 'slurm_load_jobs error: Unable to contact slurm "
                                   "controller (connect failure)' >&2; exit 1", timeout=10)
    # scontrol would have waited as long as squeue did: it is not asked.
    assert end is None and calls == ["squeue"]
    assert "the allocation's end is unknown (slurm_load_jobs error: Unable to contact slurm " \
           "controller (connect failure))" in caplog.text


def test_a_squeue_that_times_out_is_followed_by_scontrol_a_busy_controller_may_answer(
        tmp_path, monkeypatch, caplog):
    with caplog.at_level("WARNING"):
        end, calls = _end_time_with(tmp_path, monkeypatch, "exec sleep 30", timeout=0.5)
    assert end is None and calls == ["squeue", "scontrol"]
    assert "the allocation's end is unknown (squeue did not answer within 0.5 s)" in caplog.text


def test_clock_stops_once_time_left_is_below_save_plus_one_step_plus_margin():
    clock = RunClock(time.time() + 20, margin_s=5)
    clock.set_save_estimate(3.0)
    assert not clock.due(time.monotonic())          # 20 s left, 8 s needed
    clock.observe_step(14.0)                        # a step of 14 s no longer fits
    assert clock.due(time.monotonic())
    clock.observe_step(0.01)
    assert clock.due(time.monotonic()), "a decided stop stays decided"


def test_clock_never_stops_without_an_end_or_with_the_stop_turned_off():
    assert RunClock(None).remaining() is None
    assert not RunClock(None).due(time.monotonic() + 1e9)
    off = RunClock(time.time() + 1, stop_enabled=False)
    assert off.remaining() is not None and not off.due(time.monotonic() + 1e6)


def test_time_remaining_is_none_outside_slurm_and_counts_down_with_an_end_time(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("SLURM_JOB_END_TIME", raising=False)
    with kr.ResilientRun(exit_mode="raise") as run:
        assert run.time_remaining() is None
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time()) + 3600))
    with kr.ResilientRun(exit_mode="raise") as run:
        assert 3500 < run.time_remaining() <= 3600


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory):
    """The uninterrupted run's weights, and how long its process took to reach the loop."""
    work = tmp_path_factory.mktemp("ref")
    launched = time.time()
    proc, _ = train(work, work / "w.pt", step_time=0)
    assert proc.returncode == 0, proc.stderr
    loop = next(e for e in read_ledger(work / "ckpt" / "ledger.jsonl") if e["ev"] == "loop")
    return torch.load(work / "w.pt", weights_only=True), loop["t"] - launched


@pytest.fixture(scope="module")
def reference(reference_run):
    return reference_run[0]


def test_run_without_a_signal_stops_saves_before_its_end_and_resumes_bitwise(tmp_path,
                                                                               reference_run):
    reference, startup_s = reference_run
    # The end comes 12 s after the loop began in the reference run. The loop's 30 s of steps
    # (60 of 0.5 s) outlast it, and the stop (about 5 s before the end: save estimate, a step,
    # the margin) still comes inside the loop if this process starts up to 7 s slower or 20 s
    # faster than the reference did: on a loaded machine start-ups vary (19 s was seen, and a
    # reference 9 s slower than this process once let 15 s of steps finish before the end).
    end = time.time() + max(12.0, startup_s + 12.0)
    # As a SLURM rank leaves (SLURM_JOB_ID comes with the end time there; the test removes
    # it): in `exit` mode, without the interpreter's finalisation, which took 4 s once under
    # the suite's load after a 9 s start-up.
    first, exited_at = train(tmp_path, tmp_path / "w.pt", end_time=end, step_time=0.5,
                             extra=("watchdog.exit_mode=exit",))
    assert first.returncode == ExitCode.REQUEUE, first.stderr
    assert exited_at < end, "it must be gone before the allocation ends"
    events = read_ledger(tmp_path / "ckpt" / "ledger.jsonl")
    stop = next(e for e in events if e["ev"] == "stop")
    assert stop["signal"] == "time-limit"
    assert (tmp_path / "ckpt" / f"step_{stop['step']:09d}" / "MANIFEST.json").exists()
    assert not (tmp_path / "w.pt").exists(), "the loop must not have finished"
    second, _ = train(tmp_path, tmp_path / "w.pt", step_time=0)   # the requeued attempt
    assert second.returncode == 0, second.stderr
    resumes = [e for e in read_ledger(tmp_path / "ckpt" / "ledger.jsonl") if e["ev"] == "resume"]
    assert [r["step"] for r in resumes] == [stop["step"]]
    assert_bitwise_equal(reference, torch.load(tmp_path / "w.pt", weights_only=True))


def test_two_ranks_agree_on_one_step_when_the_allocation_ends(tmp_path):
    # Long enough (20 s of steps) that the run cannot end before the allocation does (12 s),
    # however fast the ranks start.
    cmd = train_command(400, step_time=0.05, out=tmp_path / "w.pt",
                        overrides=[f"checkpoint.dir={tmp_path / 'ckpt'}", "signals.grace_s=60",
                                   "requeue.time_limit_margin_s=1"])
    launch = LocalLauncher(cmd, ranks=2, workdir=tmp_path, max_launches=1,
                           env={"SLURM_JOB_END_TIME": str(int(time.time() + 12))}).run()[-1]
    assert launch.exit_codes == [ExitCode.REQUEUE, ExitCode.REQUEUE], launch.stderr_tail
    stop = launch.report["stop_step"]
    assert launch.report["saved_step"] == stop
    manifest = json.loads((tmp_path / "ckpt" / f"step_{stop:09d}" / "MANIFEST.json").read_text())
    assert manifest["world_size"] == 2 and manifest["reason"] == "emergency"


def test_should_stop_turns_true_near_the_end_and_the_next_boundary_stops_to_requeue(
        monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv("SLURM_JOB_END_TIME", str(int(time.time()) + 10))   # < 30 s margin
    ran = []
    with pytest.raises(SystemExit) as ended:
        with kr.ResilientRun(exit_mode="raise") as run:
            assert run.should_stop()
            for step in run.steps(5):
                ran.append(step)
    assert ended.value.code == ExitCode.REQUEUE and ran == []


def test_a_run_stopped_before_its_first_step_resumes_bitwise(tmp_path, reference):
    # The allocation ends 1 s from now: the run stops at step 0, before its optimizer (Adam)
    # ever stepped. The checkpoint must restore an optimizer that has not stepped: a made-up
    # state with step 1 would give the resumed run's first step another bias correction.
    first, _ = train(tmp_path, tmp_path / "w.pt", end_time=time.time() + 1)
    assert first.returncode == ExitCode.REQUEUE, first.stderr
    stop = next(e for e in read_ledger(tmp_path / "ckpt" / "ledger.jsonl") if e["ev"] == "stop")
    assert stop["step"] == 0
    second, _ = train(tmp_path, tmp_path / "w.pt", step_time=0)
    assert second.returncode == 0, second.stderr
    assert_bitwise_equal(reference, torch.load(tmp_path / "w.pt", weights_only=True))
