"""A user can tell a resume from a fresh start: rank 0 writes one line at start, visible at
Python's default log level (the script configures no logging), naming where it resumed from."""

from __future__ import annotations

import subprocess
import sys

from helpers import env, run_script, write_script

# A user's script that never touches `logging`: Python then shows WARNING and above only.
TRAIN = """
import sys
import torch
import kempner_resilience as kr

cfg = kr.load_config(overrides=[f"checkpoint.dir={sys.argv[1]}", "checkpoint.every_steps=2"])
model = torch.nn.Linear(4, 4)
with kr.ResilientRun(cfg, state={"model": model}) as run:
    for step in run.steps(int(sys.argv[2])):
        with torch.no_grad():
            model.weight.add_(1.0)
"""


def _run(tmp_path, steps: int) -> subprocess.CompletedProcess:
    script = write_script(tmp_path, TRAIN)
    proc = run_script([sys.executable, str(script), str(tmp_path / "ckpt"), str(steps)],
                          capture_output=True, text=True, env=env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc


def test_a_fresh_start_says_so_on_stderr_without_any_logging_setup(tmp_path):
    proc = _run(tmp_path, 3)
    lines = [l for l in proc.stderr.splitlines() if "starting fresh" in l]
    assert len(lines) == 1, proc.stderr
    assert "no committed checkpoint in" in lines[0] and "[rank 0]" in lines[0]


def test_a_resume_names_its_checkpoint_and_step_on_stderr_without_any_logging_setup(tmp_path):
    _run(tmp_path, 5)                               # commits step 4
    proc = _run(tmp_path, 7)
    lines = [l for l in proc.stderr.splitlines() if "resumed from" in l]
    assert len(lines) == 1, proc.stderr
    assert "step_000000004" in lines[0] and "(step 4" in lines[0]
    assert "starting fresh" not in proc.stderr
