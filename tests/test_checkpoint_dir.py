"""``checkpoint.dir`` is resolved once, when the config is loaded: ``~`` expanded, a relative path
made absolute against the loading process's working directory. Everything the run keeps there
(checkpoints, run.json, ledger.jsonl, the restart record) is under that one path, so the
no-progress guard reads the same restart record whatever directory an attempt starts in."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import kempner_resilience as kr
from helpers import env, run_script, write_script
from kempner_resilience.exitcodes import ExitCode

# Attempt 0 trains, asks to be requeued (SIGUSR1) during step 2, and is saved at step 3; a later
# attempt asks before its first step, so it commits nothing newer: no progress.
TRAIN = """
import os, signal, sys
import torch
import kempner_resilience as kr

cfg = kr.load_config(sys.argv[1])
model = torch.nn.Linear(4, 4)
signal_at = int(sys.argv[2])
with kr.ResilientRun(cfg, state={"model": model}) as run:
    if signal_at < 0:
        os.kill(os.getpid(), signal.SIGUSR1)
    for step in run.steps(100):
        if step == signal_at:
            os.kill(os.getpid(), signal.SIGUSR1)
        with torch.no_grad():
            model.weight.add_(1.0)
"""

CONFIG = """
checkpoint:
  dir: ~/somewhere
requeue:
  max_no_progress: 1
"""


def _attempt(tmp_path, home, restart: int, signal_at: int) -> subprocess.CompletedProcess:
    cwd = tmp_path / f"cwd{restart}"               # every attempt starts somewhere else
    cwd.mkdir()
    e = env(HOME=str(home), KEMPNER_RESTART_COUNT=str(restart))
    for key in [k for k in e if k.startswith("SLURM_")]:
        del e[key]
    return run_script([sys.executable, str(tmp_path / "script.py"),
                           str(tmp_path / "config.yaml"), str(signal_at)],
                          cwd=cwd, env=e, capture_output=True, text=True, timeout=120)


def test_a_home_relative_checkpoint_dir_holds_every_file_and_the_no_progress_guard_works(
        tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    write_script(tmp_path, TRAIN)
    (tmp_path / "config.yaml").write_text(CONFIG)

    first = _attempt(tmp_path, home, 0, 2)
    assert first.returncode == ExitCode.REQUEUE, first.stderr
    again = _attempt(tmp_path, home, 1, -1)
    assert again.returncode == ExitCode.NO_REQUEUE, again.stderr
    assert "no progress" in again.stderr

    root = home / "somewhere"
    assert [p.name for p in sorted(root.glob("step_*")) if (p / "MANIFEST.json").exists()] \
        == ["step_000000003"]
    assert json.loads((root / "run.json").read_text())["run_id"]
    restarts = json.loads((root / ".kempner_restarts.json").read_text())["restarts"]
    assert {k: v["step"] for k, v in restarts.items()} == {"0": 3, "1": 3}
    events = [json.loads(line)["ev"] for line in (root / "ledger.jsonl").open()]
    assert events.count("start") == 2
    # Nothing went to a literal "~" under a working directory.
    assert list(tmp_path.glob("cwd*/~")) == []


def test_a_loaded_config_says_the_resolved_path_when_written_back_or_pickled(tmp_path,
                                                                            monkeypatch):
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    home = kr.load_config(overrides=["checkpoint.dir=~/somewhere"])
    relative = kr.load_config(overrides=["checkpoint.dir=ckpt"])
    assert home.to_dict()["checkpoint"]["dir"] == str(tmp_path / "home" / "somewhere")
    assert relative.to_dict()["checkpoint"]["dir"] == str(tmp_path / "ckpt")
    # Unpickled in another directory (a submitit job): the path resolved where it was loaded.
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert pickle.loads(pickle.dumps(relative)).checkpoint.dir == str(tmp_path / "ckpt")
