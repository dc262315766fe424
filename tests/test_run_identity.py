"""One run identity across requeues, and a refusal to resume another run's checkpoints.

In-process runs with real DCP checkpoints on disk (``exit_mode="raise"``).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch.nn as nn

import kempner_resilience as kr
from kempner_resilience.identity import RUN_ID_ENV, OtherRunError
from kempner_resilience.startup import StartupError


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
