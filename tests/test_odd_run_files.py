"""Hostile or odd run files never block a resume or hang a verb: a ``MANIFEST.json`` that is a
FIFO, a link to /dev/zero or 200k nested ``[`` is a DAMAGED checkpoint, which ``ls`` and ``verify`` report at once and resume falls back past; a
``run.json`` that is a FIFO, or an ownership marker linked to /dev/zero, does not stop a start.

Real runs in their own processes on real files; every command has a timeout, so what once
blocked fails the test instead of hanging it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from helpers import env, run_script, write_script
from kempner_resilience.checkpoint import layout
from kempner_resilience.core.runpaths import RunPaths

TRAIN = """
import sys
import torch
import kempner_resilience as kr

cfg = kr.load_config(overrides=[f"checkpoint.dir={sys.argv[1]}", "checkpoint.every_steps=5",
                                "checkpoint.keep_last=100"])
model = torch.nn.Linear(4, 4)
with kr.ResilientRun(cfg, state={"model": model}) as run:
    for step in run.steps(int(sys.argv[2])):
        with torch.no_grad():
            model.weight.add_(1.0)
print("finished", flush=True)
"""


def _fifo(p):
    p.unlink()
    os.mkfifo(p)


def _dev_zero(p):
    p.unlink()
    os.symlink("/dev/zero", p)


def _nested(p):
    p.write_bytes(b"[" * 200_000)


ODD = {"fifo": _fifo, "link_to_dev_zero": _dev_zero, "200k_nested_brackets": _nested}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A checkpoint directory holding steps 5 and 10, and the script that wrote it."""
    work = tmp_path_factory.mktemp("trained")
    script = write_script(work, TRAIN)
    proc = _train(script, work / "ckpt", 10)
    assert proc.returncode == 0, proc.stderr
    assert [e.step for e in layout.scan(RunPaths(work / "ckpt")) if e.committed] == [5, 10]
    return script, work / "ckpt"


def _train(script, ckpt, steps) -> subprocess.CompletedProcess:
    return run_script([sys.executable, str(script), str(ckpt), str(steps)],
                          capture_output=True, text=True, env=env(), timeout=120)


def _cli(*args) -> subprocess.CompletedProcess:
    return run_script([sys.executable, "-m", "kempner_resilience.cli", *args],
                          capture_output=True, text=True, env=env(), timeout=60)


def _copy_with_odd_manifest(trained, tmp_path, kind):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained[1], ckpt, symlinks=True)
    ODD[kind](ckpt / layout.dir_name(10) / layout.MANIFEST_NAME)
    return ckpt


@pytest.mark.parametrize("kind", ODD)
def test_ls_and_verify_report_an_odd_manifest_as_damaged_without_blocking(trained, tmp_path,
                                                                           kind):
    ckpt = _copy_with_odd_manifest(trained, tmp_path, kind)
    ls = _cli("ls", str(ckpt))
    assert ls.returncode == 1, ls.stdout + ls.stderr
    assert "Traceback" not in ls.stderr
    row = next(line for line in ls.stdout.splitlines() if layout.dir_name(10) in line)
    assert "DAMAGED" in row
    verify = _cli("verify", str(ckpt))
    assert verify.returncode == 1, verify.stdout + verify.stderr
    assert "Traceback" not in verify.stderr
    assert f"DAMAGED  {ckpt / layout.dir_name(10)}" in verify.stdout
    assert f"OK       {ckpt / layout.dir_name(5)}" in verify.stdout


@pytest.mark.parametrize("kind", ODD)
def test_resume_falls_back_past_an_odd_manifest_to_the_previous_checkpoint(trained, tmp_path,
                                                                            kind):
    ckpt = _copy_with_odd_manifest(trained, tmp_path, kind)
    proc = _train(trained[0], ckpt, 15)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert f"resumed from {ckpt / layout.dir_name(5)} (step 5" in proc.stderr
    assert 15 in [e.step for e in layout.scan(RunPaths(ckpt)) if e.committed]


def test_a_run_json_fifo_and_a_marker_linked_to_dev_zero_do_not_stop_a_start(trained,
                                                                            tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(trained[1], ckpt, symlinks=True)
    _fifo(ckpt / "run.json")
    _dev_zero(ckpt / layout.dir_name(10) / layout.MARKER_NAME)
    proc = _train(trained[0], ckpt, 15)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "run.json was damaged" in proc.stderr          # rewritten, whole, as a regular file
    assert (ckpt / "run.json").is_file() and not (ckpt / "run.json").is_fifo()
    assert f"resumed from {ckpt / layout.dir_name(5)} (step 5" in proc.stderr
