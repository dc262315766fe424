"""An in-job restart in the ledger and the report: its own attempt, its recovery split.

Real processes: the demo trainer killed with SIGKILL at step 12 (its last periodic save was step
10), then the glue's part as the relaunch glue does it (the ``restart`` event, the relaunch said in
the supervisor channel it gives the ranks), then the trainer started again in "the same job"
(SLURM_JOB_START_TIME is the first launch's, as it is for every step of a job).
"""

from __future__ import annotations

import json
import subprocess
import time

import numpy as np
import pytest

from helpers import env, free_port, require
from kempner_resilience.cli import main as cli_main
from kempner_resilience.demo.launcher import LocalLauncher, train_command
from kempner_resilience.core.goodput import PARTS, RECOVERY, analyze_dir
from kempner_resilience.core.ledger import read_ledger
from kempner_resilience.slurm.restart_event import record_restart
from kempner_resilience.supervise.channel import Channel

STEPS = 20


@pytest.fixture(scope="module")
def relaunched(tmp_path_factory):
    work = tmp_path_factory.mktemp("relaunch")
    cmd = train_command(STEPS, step_time=0.03, out=work / "w.pt",
                        overrides=[f"checkpoint.dir={work / 'ckpt'}", "checkpoint.every_steps=5",
                                   "watchdog.hang_timeout_s=120"])
    job_start = time.time()
    first = LocalLauncher(cmd, ranks=1, workdir=work, interrupts={12: "SIGKILL"},
                          max_launches=1, env={"SLURM_JOB_START_TIME": str(int(job_start))}
                          ).run()
    failed = time.time()
    assert first[-1].exit_code != 0
    time.sleep(0.2)                     # the glue's detection, as it would take some
    record_restart(work / "ckpt", relaunch=1, reason="rank 0 on nodeA died",
                   bad_nodes=["nodeA"], spare="nodeC", step=10, failure_t=failed,
                   detect_s=0.2, rescue_s=0.0, relaunch_s=0.1)
    launched = time.time()
    channel = Channel.for_job("relaunch", {}, cwd=work)
    channel.begin_launch(0)                   # the job's restart count (SLURM's, here 0) ...
    channel.begin_relaunch(1, launched)       # ... and its relaunch in place, before the step
    second = subprocess.run(cmd, env=env(SLURM_JOB_START_TIME=str(int(job_start)), RANK="0",
                                         WORLD_SIZE="1", LOCAL_RANK="0",
                                         MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                                         **channel.env()),
                            capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr[-3000:]
    return work, launched


def test_an_in_job_restart_is_an_attempt_of_its_own_held_not_queued(relaunched):
    work, launched = relaunched
    g = analyze_dir(work / "ckpt")
    assert len(g.attempts) == 2
    first, again = g.attempts
    assert (first.relaunch, again.relaunch) == (0, 1)
    assert again.restart["spare"] == "nodeC" and again.restart["bad_nodes"] == "nodeA"
    # It began at the relaunch, not at the job's start (which SLURM keeps for every step).
    assert again.t0 >= launched - 0.01
    # The gap between them is allocated time (the nodes were held), not queue.
    assert first.queue_after_s is None and first.in_job_after_s is not None
    assert g.parts["queue"] == 0 and g.parts["in_job"] == first.in_job_after_s
    assert abs(sum(g.parts[p] for p in (*PARTS, "in_job")) - g.allocated_s) < 1e-6
    assert again.start_step == 10 and sum(a.kept_steps for a in g.attempts) == STEPS


def test_the_recovery_splits_into_detection_rescue_relaunch_startup_and_load(relaunched):
    work, _ = relaunched
    again = analyze_dir(work / "ckpt").attempts[1]
    rec = again.recovery
    assert list(rec) == list(RECOVERY)
    assert (rec["detection"], rec["rescue"], rec["relaunch"]) == (0.2, 0.0, 0.1)
    assert rec["startup"] > 0 and rec["load"] > 0       # the new processes' own, measured


def test_every_event_of_the_relaunched_attempt_carries_its_relaunch_count(relaunched):
    work, _ = relaunched
    events = read_ledger(work / "ckpt" / "ledger.jsonl")
    i = next(k for k, e in enumerate(events) if e["ev"] == "restart")
    assert all(e.get("relaunch") == 1 for e in events[i:])
    assert not any(e.get("relaunch") for e in events[:i])


def test_report_shows_the_in_job_restart_and_its_recovery(relaunched, capsys):
    work, _ = relaunched
    assert cli_main(["report", str(work / "ckpt")]) == 0
    out = capsys.readouterr().out
    assert "in-job restarts (same job, no requeue)" in out
    assert "0+1: rank 0 on nodeA died; kept out: nodeA; spare: nodeC; resumed at step 10" in out
    assert "detection 0.2s + rescue 0.0s + relaunch 0.1s + start-up" in out
    assert "relaunch gaps (in the job)" in out and "goodput" in out
    assert cli_main(["report", "--json", str(work / "ckpt")]) == 0
    data = json.loads(capsys.readouterr().out)
    assert list(data["attempts"][1]["recovery"]) == list(RECOVERY)


def test_report_plot_draws_the_relaunch_of_an_in_job_restart(relaunched, tmp_path, capsys):
    require("matplotlib")
    from matplotlib.image import imread

    work, _ = relaunched
    png = tmp_path / "timeline.png"
    assert cli_main(["report", str(work / "ckpt"), "--plot", str(png)]) == 0
    pixels = imread(png)[..., :3]
    relaunch = np.array([0x76, 0xB7, 0xB2]) / 255           # the relaunch's colour
    assert (np.abs(pixels - relaunch).max(axis=-1) < 0.01).sum() > 20


def test_a_relaunched_step_starts_its_attempt_at_its_own_start_not_the_jobs():
    from kempner_resilience.core.ledger import attempt_start, process_start_time

    job_start = time.time() - 3600      # SLURM keeps the job's start for every step
    slurm = {"SLURM_JOB_START_TIME": str(job_start)}
    own = process_start_time()
    assert attempt_start(slurm) == job_start
    assert abs(attempt_start(slurm, relaunch=2) - own) < 1.0
    launched = own - 1.5                # the glue launched it just before the process began
    assert attempt_start(slurm, relaunch=2, relaunch_t=launched) == launched


def test_a_restart_event_naming_its_bad_nodes_as_a_list_is_read_and_reported(tmp_path, capsys):
    from kempner_resilience.core.ledger import Ledger

    led = Ledger(tmp_path / "ledger.jsonl", run_id="r")
    led.event("start", t0=time.time() - 10)
    led.event("restart", reason="rank 2 hung", bad_nodes=["n2", "n5"], spare="n9")
    led.event("start", t0=time.time())
    led.close()
    assert [e["ev"] for e in read_ledger(tmp_path / "ledger.jsonl")] == \
        ["start", "restart", "start"]
    assert cli_main(["report", str(tmp_path)]) == 0
    assert "rank 2 hung; kept out: n2,n5; spare: n9" in capsys.readouterr().out


def test_report_says_when_the_relaunch_resumed_from_the_survivors_rescue(relaunched, tmp_path,
                                                                          capsys):
    work, _ = relaunched
    events = read_ledger(work / "ckpt" / "ledger.jsonl")
    i = next(k for k, e in enumerate(events) if e["ev"] == "restart")
    # The same run, had a survivor's rescue committed step 10 just before the relaunch.
    rescue = {**events[i - 1], "ev": "rescue", "step": 10, "committed": True, "seconds": 0.5}
    for key in ("code", "ending", "signal", "relaunch"):
        rescue.pop(key, None)
    ledger = tmp_path / "ledger.jsonl"
    ledger.write_text("".join(json.dumps(e) + "\n" for e in [*events[:i], rescue, *events[i:]]))
    assert cli_main(["report", str(ledger)]) == 0
    assert "resumed at step 10 (the survivors' rescue)" in capsys.readouterr().out
    assert cli_main(["report", str(work / "ckpt")]) == 0
    assert "resumed at step 10\n" in capsys.readouterr().out     # the periodic save's
