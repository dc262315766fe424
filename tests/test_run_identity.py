"""One run identity across requeues, and a refusal to resume another run's checkpoints.

In-process runs with real DCP checkpoints on disk (``exit_mode="raise"``).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch.nn as nn

import kempner_resilience as kr
from kempner_resilience.checkpoint.identity import RUN_ID_ENV, OtherRunError
from kempner_resilience.core.startup import StartupError
from kempner_resilience.core.runpaths import RunPaths


def train(ckpt_dir, steps=3, *, run_id=None, allow_other=False):
    """One attempt: resume from ckpt_dir if it can, run to ``steps``, save; returns the run."""
    cfg = kr.load_config(overrides=(f"checkpoint.dir={ckpt_dir}",
                                    f"checkpoint.allow_other_run={str(allow_other).lower()}"))
    with kr.ResilientRun(cfg, state={"model": nn.Linear(4, 2)}, exit_mode="raise",
                         run_id=run_id) as run:
        for _ in run.steps(steps):
            pass
        run.save()
    return run


@pytest.fixture(autouse=True)
def _no_run_id_from_env(monkeypatch):
    monkeypatch.delenv(RUN_ID_ENV, raising=False)


def test_later_attempts_keep_the_run_id_the_first_one_created(tmp_path):
    first = train(tmp_path / "ck", 2)
    second = train(tmp_path / "ck", 4)
    assert first.run_id and second.run_id == first.run_id
    assert second.start_step == 2
    assert json.loads((tmp_path / "ck" / "run.json").read_text())["run_id"] == first.run_id


def test_resume_refuses_checkpoints_of_another_run_naming_both(tmp_path):
    mine = train(tmp_path / "mine", 2)
    theirs = train(tmp_path / "theirs", 3)
    # Someone copies another run's (newer) checkpoint into this run's directory.
    shutil.copytree(tmp_path / "theirs" / "step_000000003", tmp_path / "mine" / "step_000000003")
    with pytest.raises(OtherRunError) as err:
        train(tmp_path / "mine", 5)
    msg = str(err.value)
    assert mine.run_id in msg and theirs.run_id in msg
    assert "checkpoint.allow_other_run" in msg
    assert isinstance(err.value, StartupError), "a script exits with 78 CONFIG"


def test_allow_other_run_resumes_from_the_other_runs_checkpoint(tmp_path):
    mine = train(tmp_path / "mine", 2)
    train(tmp_path / "theirs", 3)
    shutil.copytree(tmp_path / "theirs" / "step_000000003", tmp_path / "mine" / "step_000000003")
    run = train(tmp_path / "mine", 5, allow_other=True)
    assert run.start_step == 3 and run.run_id == mine.run_id


def test_an_explicit_run_id_other_than_the_directorys_is_refused(tmp_path):
    mine = train(tmp_path / "ck", 2)
    with pytest.raises(OtherRunError) as err:
        train(tmp_path / "ck", 4, run_id="someone-else")
    assert mine.run_id in str(err.value) and "someone-else" in str(err.value)


def test_an_explicit_run_id_names_a_new_directory(tmp_path):
    run = train(tmp_path / "ck", 2, run_id="wandb-abc123")
    assert run.run_id == "wandb-abc123"
    manifest = json.loads((tmp_path / "ck" / "step_000000002" / "MANIFEST.json").read_text())
    assert manifest["run_id"] == "wandb-abc123" and manifest["kempner_resilience"]


def _demo(ckpt_dir, steps):
    """One attempt of the demo job in its own process: checkpoints every 2 steps, keeps 2."""
    from helpers import env, run_script
    from kempner_resilience.demo.launcher import train_command

    cmd = train_command(steps, step_time=0.0, out=ckpt_dir.parent / "w.pt",
                        overrides=[f"checkpoint.dir={ckpt_dir}", "checkpoint.every_steps=2",
                                   "checkpoint.keep_last=2"])
    return run_script(cmd, capture_output=True, text=True, timeout=300, env=env())


def test_a_truncated_run_json_is_repaired_and_the_run_resumes_under_its_old_id(tmp_path):
    from kempner_resilience.checkpoint import layout
    from kempner_resilience.core.ledger import read_ledger

    ck = tmp_path / "ck"
    first = _demo(ck, 6)
    assert first.returncode == 0, first.stderr
    run_id = json.loads((ck / "run.json").read_text())["run_id"]
    for steps in (10, 14):             # two more attempts, each finding run.json cut short
        (ck / "run.json").write_bytes((ck / "run.json").read_bytes()[:20])
        proc = _demo(ck, steps)
        assert proc.returncode == 0, proc.stderr
        warning = [ln for ln in proc.stderr.splitlines() if "repaired" in ln]
        assert len(warning) == 1 and "WARNING" in warning[0] and str(ck / "run.json") in \
            warning[0] and run_id in warning[0]
        assert json.loads((ck / "run.json").read_text())["run_id"] == run_id
        # Retention still knows every checkpoint as this run's: keep_last=2 holds.
        entries = layout.scan(RunPaths(ck))
        assert [e.step for e in entries] == [steps - 2, steps]
        assert {e.manifest["run_id"] for e in entries} == {run_id}
    starts = [e for e in read_ledger(ck / "ledger.jsonl") if e["ev"] in ("start", "resume")]
    assert {e["run_id"] for e in starts} == {run_id}
    assert [e["step"] for e in starts if e["ev"] == "resume"] == [6, 10]


@pytest.mark.parametrize("damage", [b"", b"{\"run_id\": ", b"[1, 2]", b"{\"run_id\": 17}",
                                    b"{\"run_id\": [\"a\"]}", b"\xff\xfe"])
def test_a_damaged_run_json_takes_the_run_id_of_the_newest_checkpoint(tmp_path, damage,
                                                                        caplog):
    first = train(tmp_path / "ck", 2)
    (tmp_path / "ck" / "run.json").write_bytes(damage)
    second = train(tmp_path / "ck", 4)
    assert second.run_id == first.run_id and second.start_step == 2
    assert json.loads((tmp_path / "ck" / "run.json").read_text())["run_id"] == first.run_id
    assert any("run.json was damaged" in r.getMessage() for r in caplog.records)


def test_a_damaged_run_json_without_checkpoints_gets_a_new_id(tmp_path):
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "run.json").write_text("{")
    run = train(tmp_path / "ck", 2)
    assert run.run_id and json.loads((tmp_path / "ck" / "run.json").read_text())["run_id"] == \
        run.run_id
