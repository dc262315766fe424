"""The ranks tell their supervisor which run it supervises (``supervise/channel.py``).

A real training script that sets ``checkpoint.dir`` in code, as the README shows, runs under a
channel the way ``kempner-resilience srun`` starts its ranks; what is asserted is what the
supervisor then knows: the directory, the run id, the committed step and the exit code.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import env, run_script, write_script
from kempner_resilience.supervise.channel import CHANNEL_ENV, Channel, RunReport

SCRIPT = """
import sys, torch
import kempner_resilience as kr

cfg = kr.load_config(overrides=[f"checkpoint.dir={sys.argv[1]}", "checkpoint.every_steps=2",
                                "requeue.max_no_progress=5"])
model = torch.nn.Linear(2, 2)
with kr.ResilientRun(cfg, state={"model": model}) as run:
    for step in run.steps(int(sys.argv[2])):
        pass
"""


def _train(tmp_path: Path, steps: int, channel: Channel | None) -> subprocess.CompletedProcess:
    script = write_script(tmp_path, SCRIPT)
    extra = channel.env() if channel is not None else {}
    e = env(**extra)
    if channel is None:
        e.pop(CHANNEL_ENV, None)
    return run_script([sys.executable, str(script), "ckpts", str(steps)], cwd=tmp_path,
                          env=e, capture_output=True, text=True, timeout=120)


def test_rank_0_tells_the_supervisor_the_directory_the_script_set_in_code(tmp_path):
    channel = Channel.for_job("41", {}, cwd=tmp_path)
    res = _train(tmp_path, 5, channel)
    assert res.returncode == 0, res.stderr[-3000:]
    report = channel.read()
    run_json = json.loads((tmp_path / "ckpts" / "run.json").read_text())
    assert report is not None
    assert report.run_dir == str((tmp_path / "ckpts").resolve())
    assert report.run_id == run_json["run_id"]
    assert report.committed == 4          # the last periodic save of 5 steps, every 2
    assert report.code == 0
    assert report.requeue["max_no_progress"] == 5


def test_without_a_supervisor_no_channel_is_written(tmp_path):
    res = _train(tmp_path, 3, None)
    assert res.returncode == 0, res.stderr[-3000:]
    assert not (tmp_path / ".kempner-resilience").exists()


def test_the_channel_of_a_job_lives_in_the_directory_it_was_submitted_from(tmp_path):
    channel = Channel.for_job("7", {"SLURM_SUBMIT_DIR": str(tmp_path)}, cwd="/")
    assert channel.root == (tmp_path / ".kempner-resilience" / "job-7").resolve()
    assert channel.root.is_dir()
    assert Channel.from_env(channel.env()) == channel
    channel.remove()
    assert not (tmp_path / ".kempner-resilience").exists()


def test_two_jobs_from_one_directory_get_two_channels(tmp_path):
    a = Channel.for_job("7", {}, cwd=tmp_path)
    b = Channel.for_job("8", {}, cwd=tmp_path)
    a.record_train_nodes(2)
    assert a.root != b.root and b.train_nodes() is None and a.train_nodes() == 2


def test_an_unreadable_report_leaves_the_run_unknown_and_says_so(tmp_path, caplog):
    channel = Channel.for_job("7", {}, cwd=tmp_path)
    (channel.root / "run.json").write_text('{"run_dir": 3}')
    assert channel.read() is None
    assert "unreadable" in caplog.text


def test_a_report_without_a_committed_step_reads_back_as_written(tmp_path):
    channel = Channel.for_job("7", {}, cwd=tmp_path)
    channel.report(RunReport("/x", "r1", None, None, {"enabled": True}, "h", 1, 2.0))
    assert channel.read() == RunReport("/x", "r1", None, None, {"enabled": True}, "h", 1, 2.0)


def test_the_step_loop_follows_the_directory_rank_0_reported_not_its_own_config(tmp_path,
                                                                                   monkeypatch):
    from kempner_resilience.config import load_config
    from kempner_resilience.supervise.srun.relaunch import Relauncher

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KEMPNER_RESILIENCE_CONFIG", raising=False)
    loop = Relauncher(["true"], 1, load_config(None, [f"checkpoint.dir={tmp_path / 'given'}"]),
                      environ={"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n[1-3]"})
    assert loop.run_paths.root == tmp_path / "given"   # nothing said yet: --config/--set's
    loop.channel.report(RunReport(str(tmp_path / "mine"), "r", 10, None,
                                  {"max_no_progress": 7}))
    assert loop.run_paths.root == tmp_path / "mine"
    assert loop.requeue_config().max_no_progress == 7
    env_ = loop.step_env(["n1", "n2"], 0)
    assert Channel.from_env(env_) == loop.channel


def test_a_jobs_first_attempt_never_reads_what_an_earlier_job_with_its_id_left(tmp_path,
                                                                            monkeypatch):
    # SLURM numbers jobs from its first id again after a reset; a cancelled job 9 left its
    # channel behind. The new job 9 must not take that run's bad nodes and commits for its own;
    # its own requeue (restart 1) must find what its first attempt said.
    from kempner_resilience.config import load_config
    from kempner_resilience.supervise.srun.relaunch import Relauncher

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KEMPNER_RESILIENCE_CONFIG", raising=False)
    cfg = load_config(None, [f"checkpoint.dir={tmp_path / 'given'}"])
    job = {"SLURM_JOB_ID": "9", "SLURM_JOB_NODELIST": "n[1-3]"}
    Channel.for_job("9", {}, cwd=tmp_path).report(RunReport(str(tmp_path / "old"), "r0", 24))
    first = Relauncher(["true"], 1, cfg, environ=job)
    assert first.channel.read() is None
    assert first.run_paths.root == tmp_path / "given"
    first.channel.report(RunReport(str(tmp_path / "mine"), "r1", 10))
    again = Relauncher(["true"], 1, cfg, environ={**job, "SLURM_RESTART_COUNT": "1"})
    assert again.run_paths.root == tmp_path / "mine"


def test_a_finish_said_in_an_earlier_launch_does_not_end_the_next_one(tmp_path):
    from kempner_resilience.supervise.srun.step import FinishWatch

    channel = Channel.for_job("7", {}, cwd=tmp_path)
    channel.report(RunReport("/x", "r", 4, 0, {}, "h", 1, 1.0))
    watch = FinishWatch(channel, 0.0)
    assert not watch.over()
    channel.report(RunReport("/x", "r", 4, None, {}, "h", 2, 2.0))   # the new rank 0 started
    watch.next = 0.0
    assert not watch.over()
    channel.report(RunReport("/x", "r", 6, 0, {}, "h", 2, 3.0))      # and finished
    watch.next = 0.0
    assert watch.over()


def test_removing_a_channel_outside_a_jobs_directory_leaves_its_parent_alone(tmp_path):
    parent = tmp_path / "empty-after"
    channel = Channel(parent / "ch")
    channel.root.mkdir(parents=True)
    channel.remove()
    assert not channel.root.exists() and parent.is_dir()


def _attempts(tmp_path: Path) -> set[int]:
    from kempner_resilience.core.ledger import read_ledger
    from kempner_resilience.core.runpaths import RunPaths

    return {int(e["attempt"]) for e in read_ledger(RunPaths(tmp_path / "ckpts").ledger)
            if "attempt" in e}


def test_the_supervisor_tells_the_ranks_their_restart_count_through_the_channel(tmp_path):
    # The run's ledger (and its restart budget) count the attempt from what the channel says,
    # not from a variable of the environment.
    channel = Channel.for_job("43", {}, cwd=tmp_path)
    channel.begin_launch(3)
    res = _train(tmp_path, 3, channel)
    assert res.returncode == 0, res.stderr[-3000:]
    assert _attempts(tmp_path) == {3}
    assert "deprecated" not in res.stderr


def test_a_restart_count_set_by_hand_in_the_old_variable_is_read_with_a_deprecation_warning(
        tmp_path):
    script = write_script(tmp_path, SCRIPT)
    e = env(KEMPNER_RESTART_COUNT="2")
    e.pop(CHANNEL_ENV, None)
    res = run_script([sys.executable, str(script), "ckpts", "3"], cwd=tmp_path, env=e,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    assert _attempts(tmp_path) == {2}
    assert "KEMPNER_RESTART_COUNT=2 read as this run's restart count: deprecated" in res.stderr


def _start_events(tmp_path: Path) -> list[dict]:
    from kempner_resilience.core.ledger import read_ledger
    from kempner_resilience.core.runpaths import RunPaths

    return [e for e in read_ledger(RunPaths(tmp_path / "ckpts").ledger) if e["ev"] == "start"]


def test_the_supervisor_tells_the_ranks_their_relaunch_in_place_through_the_channel(tmp_path):
    # A relaunch in place is an attempt of its own, from its launch: said in the channel.
    channel = Channel.for_job("44", {}, cwd=tmp_path)
    launched = time.time() - 30
    channel.begin_relaunch(2, launched)
    res = _train(tmp_path, 3, channel)
    assert res.returncode == 0, res.stderr[-3000:]
    [start] = _start_events(tmp_path)
    assert start["relaunch"] == 2 and start["t0"] == pytest.approx(launched, abs=1e-3)
    assert "deprecated" not in res.stderr


def test_a_relaunch_set_by_hand_in_the_old_variables_is_honoured_with_one_deprecation_warning(
        tmp_path):
    # A user's own relaunch glue (docs/goodput.md documented these two) keeps working.
    launched = time.time() - 30
    script = write_script(tmp_path, SCRIPT)
    e = env(KEMPNER_RESILIENCE_IN_JOB_RESTART="2",
            KEMPNER_RESILIENCE_RELAUNCH_START=repr(launched))
    e.pop(CHANNEL_ENV, None)
    res = run_script([sys.executable, str(script), "ckpts", "3"], cwd=tmp_path, env=e,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-3000:]
    [start] = _start_events(tmp_path)
    assert start["relaunch"] == 2 and start["t0"] == pytest.approx(launched, abs=1e-3)
    assert res.stderr.count("KEMPNER_RESILIENCE_IN_JOB_RESTART=2 read: deprecated") == 1


def test_a_torchrun_rendezvous_set_by_hand_in_the_old_variable_is_offered_with_one_warning(
        tmp_path):
    offer = {"endpoint": "h:29400", "run_id": "r", "restarts_left": 2, "stale_s": 6.0}
    code = ("from kempner_resilience.core.log import configure\n"
            "from kempner_resilience.supervise.rank import offered_relaunch\n"
            "configure('INFO')\n"
            "print(offered_relaunch())\n"
            "print(offered_relaunch())\n")
    e = env(KEMPNER_RESILIENCE_RELAUNCH=json.dumps(offer))
    e.pop(CHANNEL_ENV, None)
    res = run_script([sys.executable, "-c", code], env=e, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr[-3000:]
    said = "Relaunch(endpoint='h:29400', run_id='r', restarts_left=2, stale_s=6.0)"
    assert res.stdout.splitlines() == [said, said]
    assert res.stderr.count("KEMPNER_RESILIENCE_RELAUNCH=") == 1
    assert "deprecated" in res.stderr


_PROBE = ("import sys\n"
          "from kempner_resilience.supervise.channel import launch_name, relaunched\n"
          "with open(sys.argv[1], 'a') as f:\n"
          "    f.write(f'{launch_name()} {relaunched().t}\\n')\n")


def test_the_step_loop_tells_each_step_which_relaunch_it_is_through_the_channel(tmp_path):
    # srun stands in as a script that runs the command on this machine: what a step's task
    # learns is what the loop said in the channel before it launched the step.
    from kempner_resilience.config import load_config
    from kempner_resilience.supervise.srun.relaunch import Relauncher

    srun = tmp_path / "srun"
    srun.write_text('#!/bin/bash\nwhile [[ "$1" == -* ]]; do shift; done\nexec "$@"\n')
    srun.chmod(0o755)
    out = tmp_path / "launches"
    e = env(SLURM_JOB_ID="9", SLURM_JOB_NODELIST="n[1-3]", SLURM_RESTART_COUNT="1",
            SLURM_SUBMIT_DIR=str(tmp_path))
    e.pop(CHANNEL_ENV, None)
    loop = Relauncher([sys.executable, "-c", _PROBE, str(out)], 1,
                      load_config(None, [f"checkpoint.dir={tmp_path / 'run'}"]), environ=e,
                      srun=(str(srun),))
    before = time.time()
    assert loop.run_step(["n1", "n2"], 0).code == 0
    assert loop.run_step(["n1", "n3"], 1).code == 0
    said = [line.split() for line in out.read_text().splitlines()]
    assert [launch for launch, _ in said] == ["1.0", "1.1"]
    assert before <= float(said[1][1]) <= time.time()


_REPORTER = ("import sys\n"
             "from kempner_resilience.supervise.channel import Channel, launch_name, report_now\n"
             "report_now(Channel.from_env(), sys.argv[1], run_id='r', committed=3, code=0,\n"
             "           requeue={})\n"
             "print(launch_name())\n")


def test_a_read_only_submit_directory_moves_the_channel_to_this_node_and_the_ranks_follow(
        tmp_path, mount_tmpfs, caplog):
    # `kempner-resilience srun` submitted from a read-only directory: the step loop starts, its
    # channel in a job-scoped directory of this node, and a step's task reports to it there.
    from kempner_resilience.config import load_config
    from kempner_resilience.supervise.srun.relaunch import Relauncher

    submit = mount_tmpfs("submit", "size=1m,ro")
    local = tmp_path / "node-tmp"
    local.mkdir()
    srun = tmp_path / "srun"
    srun.write_text('#!/bin/bash\nwhile [[ "$1" == -* ]]; do shift; done\nexec "$@"\n')
    srun.chmod(0o755)
    e = env(SLURM_JOB_ID="9", SLURM_JOB_NODELIST="n[1-3]", SLURM_SUBMIT_DIR=str(submit),
            TMPDIR=str(local))
    e.pop(CHANNEL_ENV, None)
    loop = Relauncher([sys.executable, "-c", _REPORTER, str(tmp_path / "run")], 1,
                      load_config(None, [f"checkpoint.dir={tmp_path / 'run'}"]), environ=e,
                      srun=(str(srun),))
    assert loop.channel.root.is_relative_to(local)
    assert f"{submit / '.kempner-resilience' / 'job-9'} cannot hold the supervisor's channel" \
        in caplog.text and str(loop.channel.root) in caplog.text
    assert loop.run_step(["n1", "n2"], 0).code == 0
    report = loop.channel.read()
    assert report is not None and report.committed == 3 and report.code == 0
    assert loop.run_paths.root == (tmp_path / "run").resolve()
    assert list(submit.iterdir()) == []
    loop.channel.remove()
    assert list(local.iterdir()) == []
