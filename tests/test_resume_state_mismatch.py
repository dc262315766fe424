"""A resume whose live state differs from the checkpoint: refused with 78 naming the entries and
the fix, never silently dropping saved state; the opt-in partial resume pins the full checkpoint.

Every case is a real training script run twice in fresh processes: once as it was when the
checkpoint was written (once per module; each test resumes from a copy of its directory), once
as changed since (a layer removed, ``optim`` left out of ``state``, a scheduler added, the model
cast to bf16).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from helpers import env, free_port, run_script, start, write_script
from kempner_resilience.checkpoint import CheckpointManager
from kempner_resilience.checkpoint.info import StateMismatchError
from kempner_resilience.config import CheckpointConfig
from kempner_resilience.core.startup import StartupError
from kempner_resilience.exitcodes import ExitCode

# argv: CKPT VARIANT STEPS [RANK WORLD PORT] [--set key=value ...]
SCRIPT = """
import os, sys
import torch
import torch.distributed as dist
import kempner_resilience as kr
from torch import nn

ckpt, variant, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
rest = sys.argv[4:]
sets = [a for a in rest if "=" in a]
pos = [a for a in rest if "=" not in a]
if pos:
    rank, world, port = int(pos[0]), int(pos[1]), pos[2]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
torch.manual_seed(0)
layers = [nn.Linear(4, 4), nn.Linear(4, 2)]
if variant == "layer_removed":
    layers = layers[:1]
model = nn.Sequential(*layers)
if variant == "bf16":
    model = model.to(torch.bfloat16)
optim = torch.optim.Adam(model.parameters(), lr=1e-3)
state = {"model": model, "optim": optim}
if variant == "optim_left_out":
    state = {"model": model}
if variant == "scheduler_added":
    state["sched"] = torch.optim.lr_scheduler.StepLR(optim, 3)
cfg = kr.load_config(overrides=[f"checkpoint.dir={ckpt}", "checkpoint.every_steps=2",
                                "checkpoint.keep_last=1", "watchdog.hang_timeout_s=0", *sets])
with kr.ResilientRun(cfg, state=state) as run:
    for step in run.steps(steps):
        x = torch.randn(3, 4, dtype=next(model.parameters()).dtype)
        model(x).sum().backward()
        optim.step()
        optim.zero_grad()
print("finished at step", run.step, flush=True)
"""


def _run(tmp_path: Path, variant: str, steps: int, *sets: str) -> subprocess.CompletedProcess:
    script = write_script(tmp_path, SCRIPT, "train.py")
    return run_script([sys.executable, str(script), str(tmp_path / "ckpt"), variant,
                           str(steps), *sets], capture_output=True, text=True, timeout=180,
                          env=env())


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> Path:
    """The checkpoint directory the original script leaves after 4 steps (its checkpoint of
    step 4, run identity, ledger), written once: each test changes the script on a copy."""
    work = tmp_path_factory.mktemp("original")
    first = _run(work, "original", 4)
    assert first.returncode == 0, first.stderr
    return work / "ckpt"


def _checkpoint_of_the_original_script(tmp_path: Path, original: Path) -> Path:
    """``original`` copied to ``tmp_path/ckpt`` (where ``_run`` trains); its step-4 checkpoint."""
    shutil.copytree(original, tmp_path / "ckpt", symlinks=True)
    return tmp_path / "ckpt" / "step_000000004"


def _assert_refused(proc: subprocess.CompletedProcess, words: list[str]) -> None:
    assert proc.returncode == ExitCode.CONFIG, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "finished at step" not in proc.stdout
    for w in words:
        assert w in proc.stderr, (w, proc.stderr)


def test_a_layer_removed_since_the_checkpoint_exits_78_on_every_rank_naming_its_keys(tmp_path,
                                                                                   original):
    ckpt = _checkpoint_of_the_original_script(tmp_path, original)
    script, port = write_script(tmp_path, SCRIPT, "train.py"), str(free_port())
    procs = [start(script, str(tmp_path / "ckpt"), "layer_removed", "8", str(r), "2", port)
             for r in (0, 1)]
    results = [p.communicate(timeout=180) for p in procs]
    for p, (out, err) in zip(procs, results):
        _assert_refused(subprocess.CompletedProcess(p.args, p.returncode, out, err),
                        [f"refusing to resume from {ckpt}", "model.1.weight", "model.1.bias",
                         "optim.state.1.weight.exp_avg", "a layer removed",
                         "checkpoint.allow_partial_resume: true"])
    assert sorted(p.name for p in ckpt.parent.glob("step_*")) == [ckpt.name], \
        "the checkpoint is untouched and nothing newer was written"


def test_optim_left_out_of_state_exits_78_naming_it(tmp_path, original):
    ckpt = _checkpoint_of_the_original_script(tmp_path, original)
    proc = _run(tmp_path, "optim_left_out", 8)
    _assert_refused(proc, [f"refusing to resume from {ckpt}", "optim (",
                           "state['optim'] is not in the state", "allow_partial_resume"])


def test_an_lr_scheduler_added_since_the_checkpoint_is_named_as_the_cause(tmp_path, original):
    _checkpoint_of_the_original_script(tmp_path, original)
    proc = _run(tmp_path, "scheduler_added", 8)
    _assert_refused(proc, ["optim.param_groups.0.initial_lr",
                           "an LR scheduler was attached to the optimizer since the checkpoint"])
    assert "Missing key" not in proc.stderr
    assert "falling back" not in proc.stderr, "an older checkpoint lacks it too: no fall-back"


def test_a_partial_resume_loads_what_both_have_and_retention_keeps_the_full_checkpoint(
        tmp_path, original):
    ckpt = _checkpoint_of_the_original_script(tmp_path, original)
    # keep_last=1 and saves at steps 6, 8, 10: without the pin, step 4 goes at step 6's commit.
    proc = _run(tmp_path, "layer_removed", 10, "checkpoint.allow_partial_resume=true")
    assert proc.returncode == 0, proc.stderr
    assert "finished at step 10" in proc.stdout
    assert f"partial resume from {ckpt}" in proc.stderr and "model.1.weight" in proc.stderr
    assert f"resumed from {ckpt} (step 4" in proc.stderr
    steps = sorted(p.name for p in ckpt.parent.glob("step_*"))
    assert steps == [ckpt.name, "step_000000010"], steps
    pins = json.loads((ckpt.parent / "pinned.json").read_text())["pinned"]
    assert [p["dir"] for p in pins] == [ckpt.name]
    # The full checkpoint still resumes the original script exactly where it was.
    (ckpt.parent / "step_000000010").rename(ckpt.parent / "moved_away")
    again = _run(tmp_path, "original", 6)
    assert again.returncode == 0, again.stderr
    assert f"resumed from {ckpt} (step 4" in again.stderr


def test_an_fp32_checkpoint_resumed_into_a_bf16_model_warns_in_one_line(tmp_path, original):
    ckpt = _checkpoint_of_the_original_script(tmp_path, original)
    proc = _run(tmp_path, "bf16", 6)
    assert proc.returncode == 0, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if "dtype" in ln]
    assert len(lines) == 1, proc.stderr
    assert str(ckpt) in lines[0] and "float32" in lines[0] and "bfloat16" in lines[0]
    assert "finished at step 6" in proc.stdout


def test_a_layer_frozen_since_the_checkpoint_is_refused_naming_the_frozen_layer(tmp_path):
    # In-process (CheckpointManager), on real files: a frozen layer gets no optimizer state,
    # so its saved Adam moments would be left behind.
    def build(freeze: bool) -> dict:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        if freeze:
            model[0].requires_grad_(False)
        return {"model": model, "optim": torch.optim.Adam(model.parameters())}

    state = build(False)
    state["model"](torch.randn(3, 4)).sum().backward()
    state["optim"].step()
    with CheckpointManager(CheckpointConfig(dir=str(tmp_path)), state) as mgr:
        mgr.save(1)
    with CheckpointManager(CheckpointConfig(dir=str(tmp_path)), build(True)) as mgr:
        with pytest.raises(StateMismatchError) as e:
            mgr.resume()
    assert isinstance(e.value, StartupError), "a script exits with 78 CONFIG"
    assert "optim.state.0.weight.exp_avg" in str(e.value)
    assert "frozen since the checkpoint" in str(e.value)


def test_an_unreadable_pin_file_stops_retention_instead_of_unpinning(tmp_path):
    # pinned.json damaged (a half-edited file): retention cannot know what is pinned, so it
    # deletes nothing rather than the one full copy a partial resume left.
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    state = {"model": model, "optim": torch.optim.Adam(model.parameters())}
    (tmp_path / "pinned.json").write_text('{"pinned": [{"dir": "step_0000')
    with CheckpointManager(CheckpointConfig(dir=str(tmp_path), keep_last=1), state) as mgr:
        for step in (1, 2, 3):
            mgr.save(step)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == [
        "step_000000001", "step_000000002", "step_000000003"]
