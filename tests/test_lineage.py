"""The lineage a run continues: damaged checkpoints set aside, fresh starts that keep what came
before, and a start line that says what it continues (issue 28, items 1, 2 and 5).

In-process runs with real DCP checkpoints on disk (``exit_mode="raise"``), as in
test_run_identity.py. Every step adds 1 to the weights, so a run that trained ``n`` steps in all,
however many attempts it took, holds the weights of an uninterrupted run: a resume from the wrong step or
lineage shows in the tensors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import kempner_resilience as kr
from kempner_resilience.checkpoint import layout, retention
from kempner_resilience.checkpoint.identity import RUN_ID_ENV, OtherRunError
from kempner_resilience.checkpoint.info import LineageDamagedError
from kempner_resilience.checkpoint.quarantine import NOTE_NAME
from kempner_resilience.core.goodput import analyze_dir
from kempner_resilience.core.startup import StartupError
from kempner_resilience.core.runpaths import RunPaths


def trained_weight(steps: int) -> torch.Tensor:
    """The weights of an uninterrupted run of ``steps`` steps (bitwise: the same additions)."""
    torch.manual_seed(0)
    weight = nn.Linear(4, 2).weight.detach().clone()
    for _ in range(steps):
        weight.add_(1.0)
    return weight


def train(ck: Path, total: int, *, every: int = 10, keep_last: int = 3, resume: bool = True,
          lr: float = 0.1, run_id: str | None = None):
    """One attempt: resume (or not) from ``ck``, train to ``total`` saving every ``every``
    steps; returns the run, the steps it trained and its final weights."""
    cfg = kr.load_config(overrides=(f"checkpoint.dir={ck}", f"checkpoint.every_steps={every}",
                                    f"checkpoint.keep_last={keep_last}",
                                    f"checkpoint.resume={str(resume).lower()}"))
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    optim = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    trained = []
    with kr.ResilientRun(cfg, state={"model": model, "optim": optim}, exit_mode="raise",
                         run_id=run_id) as run:
        for step in run.steps(total):
            with torch.no_grad():
                model.weight.add_(1.0)
            trained.append(step)
    return run, trained, model.weight.detach().clone()


def steps_on_disk(ck: Path) -> list[int]:
    return [e.step for e in layout.scan(RunPaths(ck)) if e.committed]


def damage(step_dir: Path, how: str) -> None:
    """Cut rank 0's shard short, or flip one byte in its middle."""
    shard = step_dir / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    if how == "truncate":
        shard.write_bytes(bytes(data[: len(data) // 2]))
    else:
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))


@pytest.fixture(autouse=True)
def _no_run_id_from_env(monkeypatch):
    monkeypatch.delenv(RUN_ID_ENV, raising=False)


# ------------------------------------------------------------------ 1. damaged checkpoints

@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_damaged_newest_checkpoint_is_set_aside_and_never_costs_the_good_ones(tmp_path, how,
                                                                               caplog):
    ck = tmp_path / "ck"
    train(ck, 30)                                         # steps 10, 20, 30
    damage(ck / "step_000000030", how)
    # keep_last=1: resumes from 20, saves 25, then stops (as a kill -9 at step 26 would).
    second, trained, _ = train(ck, 26, every=5, keep_last=1)
    assert second.start_step == 20 and trained == list(range(20, 26))
    # Retention counted only intact checkpoints: 25 (its own newest) is kept, not the
    # damaged 30 in its place.
    assert steps_on_disk(ck) == [25]
    aside = [p for p in ck.iterdir() if p.name.startswith(".damaged-")]
    word = "checksum" if how == "flip" else "size"
    assert [p.name for p in aside] == [f".damaged-step_000000030-{word}"]
    assert "step_000000030" in (aside[0] / NOTE_NAME).read_text()
    assert any("set it aside" in r.getMessage() for r in caplog.records)
    third, trained, weight = train(ck, 28, every=5, keep_last=1)
    assert third.start_step == 25 and trained == [25, 26, 27]
    assert torch.equal(weight, trained_weight(28))


def torch_save_into(step_dir: Path) -> None:
    """A user's own ``dcp.save`` aimed at a committed step: torch's FileSystemWriter
    (``overwrite=True`` by default) replaces its shards and ``.metadata`` in place."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():       # torch's own "overwriting since overwrite=True"
        warnings.simplefilter("ignore")
        dcp.save({"model": nn.Linear(4, 2).state_dict()},
                 storage_writer=dcp.FileSystemWriter(str(step_dir)))


def overwrite_every_step(ck: Path) -> list[int]:
    """Every committed step of ``ck`` overwritten by torch's writer; the steps."""
    steps = steps_on_disk(ck)
    for step in steps:
        torch_save_into(ck / layout.dir_name(step))
    return steps


def set_aside_dirs(ck: Path) -> list[str]:
    return sorted(p.name for p in ck.iterdir() if p.name.startswith(".damaged-"))


def test_a_plain_torch_dcp_save_into_a_committed_step_is_set_aside_named_and_resume_falls_back(
        tmp_path, caplog):
    ck = tmp_path / "ck"
    train(ck, 30, every=5)                                # steps 20, 25, 30
    torch_save_into(ck / "step_000000030")
    again, trained, weight = train(ck, 30, every=5)
    assert again.start_step == 25 and trained == list(range(25, 30))
    assert torch.equal(weight, trained_weight(30))
    [aside] = [ck / name for name in set_aside_dirs(ck)]
    assert aside.name.startswith(".damaged-step_000000030-")
    said = [r.getMessage() for r in caplog.records if "set it aside" in r.getMessage()]
    assert len(said) == 1, said                           # one line: step, why, where
    assert "step 30 " in said[0] and str(aside) in said[0]
    assert "its shards no longer match their checksums" in said[0]
    assert "modified after its commit" in said[0] and "dcp.save" in said[0]


REFUSED = """
import sys
import torch, torch.nn as nn
import kempner_resilience as kr

cfg = kr.load_config(overrides=[f"checkpoint.dir={sys.argv[1]}", "checkpoint.every_steps=5"])
torch.manual_seed(0)
model = nn.Linear(4, 2)
with kr.ResilientRun(cfg, state={"model": model}) as run:
    for step in run.steps(40):
        print("trained", step, flush=True)
"""


def test_every_committed_step_overwritten_exits_78_naming_them_and_the_fix_and_frees_the_dir(
        tmp_path):
    import sys

    from helpers import env, run_script, write_script

    ck = tmp_path / "ck"
    train(ck, 30, every=5)
    assert overwrite_every_step(ck) == [20, 25, 30]
    proc = run_script([sys.executable, str(write_script(tmp_path, REFUSED)), str(ck)],
                          capture_output=True, text=True, env=env(), timeout=120)
    assert proc.returncode == 78, proc.stderr
    assert "Traceback" not in proc.stderr and "trained" not in proc.stdout
    assert set_aside_dirs(ck) == [f".damaged-step_0000000{s}-size" for s in (20, 25, 30)]
    refusal = proc.stderr[proc.stderr.index("kempner_resilience: "):]
    assert all(str(ck / name) in refusal for name in set_aside_dirs(ck)), refusal
    assert "checkpoint.resume: false" in refusal and "starting fresh" not in proc.stderr
    assert not RunPaths(ck).lease.exists(), "a run that did not start holds no lease"


def test_a_launch_after_every_checkpoint_was_set_aside_refuses_too_rather_than_start_fresh(
        tmp_path):
    ck = tmp_path / "ck"
    train(ck, 30, every=5)
    overwrite_every_step(ck)
    with pytest.raises(LineageDamagedError):
        train(ck, 30, every=5)                            # sets them aside, refuses
    aside = set_aside_dirs(ck)
    with pytest.raises(LineageDamagedError) as err:
        train(ck, 30, every=5)                            # nothing left to try: refuses
    assert isinstance(err.value, StartupError), "a script exits with 78 CONFIG"
    assert all(name in str(err.value) for name in aside) and len(aside) == 3
    assert "checkpoint.resume: false" in str(err.value)
    assert set_aside_dirs(ck) == aside and steps_on_disk(ck) == []
    assert not RunPaths(ck).lease.exists()


def test_a_new_lineage_started_on_purpose_after_everything_was_set_aside_starts_at_0_and_keeps_them(
        tmp_path):
    ck = tmp_path / "ck"
    old, _, _ = train(ck, 30, every=5)
    overwrite_every_step(ck)
    with pytest.raises(LineageDamagedError):
        train(ck, 30, every=5)
    aside = set_aside_dirs(ck)
    fresh, trained, _ = train(ck, 10, every=5, resume=False)       # the fix, followed
    assert fresh.start_step == 0 and trained == list(range(10)) and fresh.run_id != old.run_id
    assert set_aside_dirs(ck) == aside                              # kept for inspection
    assert old.run_id in json.loads((ck / "run.json").read_text())["earlier_runs"]
    nxt, trained, weight = train(ck, 12, every=5)                  # the new lineage goes on
    assert nxt.start_step == 10 and trained == [10, 11]
    assert torch.equal(weight, trained_weight(12))


# ------------------------------------------------------------------ 2. lineages

def test_a_fresh_start_keeps_its_own_saves_and_every_checkpoint_of_the_old_run(tmp_path):
    ck = tmp_path / "ck"
    old, _, _ = train(ck, 30, every=5)                    # steps 20, 25, 30 kept
    fresh, trained, _ = train(ck, 10, every=5, resume=False)
    assert trained == list(range(10)) and fresh.run_id != old.run_id
    by_run = {e.step: e.manifest["run_id"] for e in layout.scan(RunPaths(ck))}
    assert by_run == {5: fresh.run_id, 10: fresh.run_id,
                      20: old.run_id, 25: old.run_id, 30: old.run_id}
    recorded = json.loads((ck / "run.json").read_text())
    assert recorded["run_id"] == fresh.run_id and recorded["earlier_runs"] == [old.run_id]


def test_resume_continues_the_newest_lineage_not_the_highest_step(tmp_path):
    ck = tmp_path / "ck"
    old, _, _ = train(ck, 30, every=5)
    fresh, _, _ = train(ck, 10, every=5, resume=False)
    nxt, trained, weight = train(ck, 15, every=5)
    assert nxt.run_id == fresh.run_id and nxt.start_step == 10 and trained == [10, 11, 12, 13, 14]
    assert torch.equal(weight, trained_weight(15))
    # Both lineages still hold keep_last=3 each: 5, 10, 15 and the old run's 20, 25, 30.
    assert steps_on_disk(ck) == [5, 10, 15, 20, 25, 30]
    assert old.run_id in json.loads((ck / "run.json").read_text())["earlier_runs"]


def test_report_credits_the_fresh_runs_attempts_to_the_fresh_run(tmp_path):
    ck = tmp_path / "ck"
    old, _, _ = train(ck, 30, every=5)
    fresh, _, _ = train(ck, 10, every=5, resume=False)
    train(ck, 15, every=5)
    g = analyze_dir(ck)
    assert g.run_id == fresh.run_id and len(g.attempts) == 2
    assert [(a.start_step, a.last_step) for a in g.attempts] == [(0, 10), (10, 15)]
    assert list(g.other_runs) == [old.run_id]


def test_a_fresh_start_under_the_id_of_a_lineage_with_checkpoints_is_refused(tmp_path):
    ck = tmp_path / "ck"
    old, _, _ = train(ck, 20, every=10)
    with pytest.raises(OtherRunError) as err:
        train(ck, 10, every=10, resume=False, run_id=old.run_id)
    assert isinstance(err.value, StartupError), "a script exits with 78 CONFIG"
    assert old.run_id in str(err.value) and RUN_ID_ENV in str(err.value)
    assert steps_on_disk(ck) == [10, 20]


def test_a_second_fresh_start_keeps_both_earlier_lineages(tmp_path):
    ck = tmp_path / "ck"
    first, _, _ = train(ck, 20, every=10, keep_last=1)
    second, _, _ = train(ck, 10, every=5, keep_last=1, resume=False)
    third, _, _ = train(ck, 4, every=2, keep_last=1, resume=False)
    runs = {e.step: e.manifest["run_id"] for e in layout.scan(RunPaths(ck))}
    assert runs == {4: third.run_id, 10: second.run_id, 20: first.run_id}
    assert json.loads((ck / "run.json").read_text())["earlier_runs"] == sorted(
        [first.run_id, second.run_id])


def test_retention_of_a_resumed_lineage_removes_its_checkpoints_from_before_run_ids(tmp_path):
    """A checkpoint that records no run id (written before run ids existed) is the resumed
    lineage's own: its retention may delete it; a fresh start's never does."""
    ck = tmp_path / "ck"
    train(ck, 20, every=10, keep_last=5)
    legacy = ck / "step_000000010"
    manifest = json.loads((legacy / layout.MANIFEST_NAME).read_text())
    manifest["run_id"] = None
    (legacy / layout.MANIFEST_NAME).write_text(json.dumps(manifest))
    marker = json.loads((legacy / layout.MARKER_NAME).read_text())
    marker["run_id"] = None
    (legacy / layout.MARKER_NAME).write_text(json.dumps(marker))
    entries = layout.scan(RunPaths(ck))
    rid = json.loads((ck / "run.json").read_text())["run_id"]
    assert [e.step for e in retention.select_for_deletion(entries, 1, 0, run_id=rid)] == [10]
    assert retention.select_for_deletion(entries, 1, 0, run_id="new", earlier=[rid, None]) == []


# ------------------------------------------------------------------ 5. what a start continues

def test_the_start_line_names_the_run_its_step_and_the_optimizer_settings_it_restores(
        tmp_path, caplog):
    ck = tmp_path / "ck"
    first, _, _ = train(ck, 4, every=2, lr=0.1)
    caplog.clear()
    again, _, _ = train(ck, 6, every=2, lr=0.01)
    lines = [r.getMessage() for r in caplog.records if "resumed from" in r.getMessage()
             and r.name.endswith("begin")]
    assert len(lines) == 1, lines
    assert f"run {first.run_id} resumed from" in lines[0] and "(step 4" in lines[0]
    assert "optim.lr 0.1 (script: 0.01)" in lines[0]
    assert "momentum" not in lines[0], "a setting the script did not change is not named"


def test_a_run_that_completed_its_last_step_says_so_and_trains_nothing(tmp_path, caplog):
    ck = tmp_path / "ck"
    first, _, weight = train(ck, 4, every=2)
    assert json.loads((ck / "run.json").read_text())["completed_step"] == 4
    caplog.clear()
    again, trained, again_weight = train(ck, 4, every=2, lr=0.5)
    assert trained == [] and again.run_id == first.run_id
    assert torch.equal(again_weight, weight)
    said = [r.getMessage() for r in caplog.records if "is complete" in r.getMessage()]
    assert len(said) == 1 and first.run_id in said[0] and "checkpoint.resume: false" in said[0]
    assert steps_on_disk(ck) == [2, 4]


def test_a_larger_total_trains_longer_and_says_so(tmp_path, caplog):
    ck = tmp_path / "ck"
    first, _, _ = train(ck, 4, every=2)
    caplog.clear()
    longer, trained, weight = train(ck, 6, every=2)
    assert trained == [4, 5] and longer.run_id == first.run_id
    assert torch.equal(weight, trained_weight(6))
    assert any("training longer" in r.getMessage() and "run.steps(4)" in r.getMessage()
               for r in caplog.records)
    assert json.loads((ck / "run.json").read_text())["completed_step"] == 6


def test_a_damaged_checkpoint_set_aside_is_not_listed_as_a_checkpoint(tmp_path):
    ck = tmp_path / "ck"
    train(ck, 20)
    damage(ck / "step_000000020", "flip")
    train(ck, 20)                                          # resumes from 10, trains 10..19
    assert os.path.isdir(ck / ".damaged-step_000000020-checksum")
    assert all(not e.path.name.startswith(".") for e in layout.scan(RunPaths(ck)))


# ------------------------------------------------------------------ 1, on two real ranks

TWO_RANKS = """
import sys
import torch, torch.distributed as dist
import torch.nn as nn
import kempner_resilience as kr

ck, total, every, keep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
dist.init_process_group("gloo")
torch.manual_seed(0)
model = nn.Linear(4, 2)
cfg = kr.load_config(overrides=[f"checkpoint.dir={ck}", f"checkpoint.every_steps={every}",
                                f"checkpoint.keep_last={keep}", "watchdog.hang_timeout_s=120"])
with kr.ResilientRun(cfg, state={"model": model}) as run:
    for step in run.steps(total):
        with torch.no_grad():
            model.weight.add_(1.0)
    print("start", run.start_step, "weight", model.weight.sum().item(), flush=True)
dist.destroy_process_group()
"""


def _two_ranks(script: Path, *args: object) -> list[str]:
    """Both ranks of a gloo job running ``script``; each one's stdout (raises on a failure)."""
    import subprocess
    import sys

    from helpers import env, free_port, spawn_script

    port = str(free_port())
    procs = [spawn_script([sys.executable, str(script), *map(str, args)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=env(RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port,
                                      OMP_NUM_THREADS="1"))
             for r in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    for r, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} exit {p.returncode}:\n{out}\n{err}"
    return [out for out, _ in outs]


def test_two_ranks_set_a_damaged_checkpoint_aside_and_keep_the_good_ones(tmp_path):
    from helpers import write_script

    script = write_script(tmp_path, TWO_RANKS)
    ck = tmp_path / "ck"
    _two_ranks(script, ck, 30, 10, 3)                     # steps 10, 20, 30
    damage(ck / "step_000000030", "flip")                 # rank 0's shard
    outs = _two_ranks(script, ck, 26, 5, 1)               # resumes from 20 on both ranks
    assert all(o.startswith("start 20 ") for o in outs), outs
    assert steps_on_disk(ck) == [25]
    assert (ck / ".damaged-step_000000030-checksum").is_dir()
    outs = _two_ranks(script, ck, 28, 5, 1)
    expected = trained_weight(28).sum().item()
    assert all(o.split() == ["start", "25", "weight", str(expected)] for o in outs), outs
