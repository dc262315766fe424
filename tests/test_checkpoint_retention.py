"""Retention deletes only what this package wrote for this run, in a real training process.

One run under ResilientRun (every_steps=1, keep_last=1, six saves, so retention runs six times)
starts in a checkpoint directory where someone planted: another user's checkpoint, a step
directory with neither our marker nor a manifest, a symlinked step directory pointing at one of
our checkpoints elsewhere, a user's notes.txt and mydata/, another user's .trash-* directory.
It also holds one of our own checkpoints written before the ownership marker existed (the run
starts fresh, so it is the earlier lineage's and stays), and one of our own interrupted
deletions (.trash-*), which must go.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from helpers import env, run_script, write_script
from kempner_resilience.checkpoint import MANIFEST_NAME, CheckpointManager, layout
from kempner_resilience.config import CheckpointConfig

FOREIGN_UID = 4242

RUN = """
import kempner_resilience as kr
import sys
import torch
from kempner_resilience.core.log import configure

configure()
model = torch.nn.Linear(8, 8)
cfg = kr.load_config(overrides=[f"checkpoint.dir={sys.argv[1]}", "checkpoint.every_steps=1",
                                "checkpoint.keep_last=1", "checkpoint.resume=false",
                                "watchdog.hang_timeout_s=120"])
with kr.ResilientRun(cfg, state={"model": model}) as run:
    for step in run.steps(6):
        with torch.no_grad():
            model.weight.add_(1.0)
print("finished", flush=True)
"""


def _our_checkpoints(where: Path, steps: list[int]) -> dict[int, Path]:
    """Real checkpoints written by this package (in this process), one per step."""
    model = torch.nn.Linear(8, 8)
    mgr = CheckpointManager(CheckpointConfig(dir=str(where), keep_last=100), {"model": model})
    out = {s: mgr.save(s).path for s in steps}
    mgr.close()
    return out


def _make_legacy(path: Path) -> None:
    """What a save made before the ownership marker existed: no marker, not in the manifest."""
    (path / layout.MARKER_NAME).unlink()
    man = json.loads((path / MANIFEST_NAME).read_text())
    del man["files"][layout.MARKER_NAME]
    (path / MANIFEST_NAME).write_text(json.dumps(man))


def _chown_tree(path: Path, uid: int) -> None:
    os.chown(path, uid, uid)
    for p in path.rglob("*"):
        os.chown(p, uid, uid, follow_symlinks=False)


def _fingerprint(path: Path) -> dict[str, tuple[str, int]]:
    """Every file under ``path`` (not following links): content hash and owner."""
    out = {}
    for p in sorted(path.rglob("*")):
        if p.is_file() and not p.is_symlink():
            out[str(p.relative_to(path))] = (hashlib.sha256(p.read_bytes()).hexdigest(),
                                             p.stat().st_uid)
    return out


@pytest.fixture(scope="module")
def planted_run(tmp_path_factory):
    if os.geteuid() != 0:
        pytest.skip("planting another user's files needs root (chown)")
    base = tmp_path_factory.mktemp("retention")
    ckpt, elsewhere, scratch = base / "ckpt", base / "elsewhere", base / "scratch"
    ckpt.mkdir()
    made = _our_checkpoints(scratch, [0, 1, 5, 7])
    linked = _our_checkpoints(elsewhere, [3])[3]

    foreign = ckpt / "step_000000001"                 # another user's (complete) checkpoint
    shutil.move(made[1], foreign)
    _chown_tree(foreign, FOREIGN_UID)
    unmarked = ckpt / "step_000000002"                # no marker, no manifest: not ours to judge
    unmarked.mkdir()
    (unmarked / "__0_0.distcp").write_bytes(b"somebody's bytes")
    symlink = ckpt / "step_000000003"                 # a link to one of our checkpoints
    symlink.symlink_to(linked, target_is_directory=True)
    (ckpt / "notes.txt").write_text("my notes")
    (ckpt / "mydata").mkdir()
    (ckpt / "mydata" / "data.bin").write_bytes(b"\1" * 100)
    foreign_trash = ckpt / ".trash-step_000000005-1-1"
    shutil.move(made[5], foreign_trash)
    _chown_tree(foreign_trash, FOREIGN_UID)
    legacy = ckpt / "step_000000000"                  # ours, from before the marker existed
    shutil.move(made[0], legacy)
    _make_legacy(legacy)
    shutil.move(made[7], ckpt / ".trash-step_000000007-1-2")   # our own interrupted deletion

    before = {name: _fingerprint(ckpt / name) for name in
              ("step_000000001", "step_000000002", "mydata", foreign_trash.name)}
    before["elsewhere"] = _fingerprint(elsewhere)
    script = write_script(base, RUN)
    proc = run_script([sys.executable, str(script), str(ckpt)], capture_output=True,
                          text=True, env=env(), timeout=120)
    assert proc.returncode == 0 and "finished" in proc.stdout, proc.stderr
    return {"ckpt": ckpt, "elsewhere": elsewhere, "linked": linked, "before": before,
            "stderr": proc.stderr}


def test_another_users_checkpoint_survives_retention_untouched(planted_run):
    ckpt = planted_run["ckpt"]
    assert _fingerprint(ckpt / "step_000000001") == planted_run["before"]["step_000000001"]
    assert (ckpt / "step_000000001").stat().st_uid == FOREIGN_UID


def test_a_step_directory_without_our_marker_or_a_manifest_survives_retention(planted_run):
    ckpt = planted_run["ckpt"]
    assert _fingerprint(ckpt / "step_000000002") == planted_run["before"]["step_000000002"]


def test_a_symlinked_step_directory_and_its_target_survive_retention(planted_run):
    link = planted_run["ckpt"] / "step_000000003"
    assert link.is_symlink() and Path(os.readlink(link)) == planted_run["linked"]
    assert _fingerprint(planted_run["elsewhere"]) == planted_run["before"]["elsewhere"]
    assert (planted_run["linked"] / MANIFEST_NAME).is_file()


def test_retention_removes_only_our_old_checkpoints_and_trash_including_pre_marker_ones(
        planted_run):
    ckpt = planted_run["ckpt"]
    # Ours (the six saves, our .trash-*) are gone but the newest; everything we did not write
    # is still there. The pre-marker step 0 stays: the run starts fresh (checkpoint.resume:
    # false), so step 0 belongs to the lineage it leaves behind, which its retention never
    # deletes (a resumed lineage's retention removes such checkpoints: test_lineage.py).
    assert sorted(os.listdir(ckpt)) == sorted([
        "step_000000006", "step_000000000", "step_000000001", "step_000000002",
        "step_000000003", "notes.txt",
        "run.json", "ledger.jsonl",   # the run's identity and ledger (identity.py, ledger.py)
        "mydata", ".trash-step_000000005-1-1"])
    assert (ckpt / "notes.txt").read_text() == "my notes"
    assert _fingerprint(ckpt / "mydata") == planted_run["before"]["mydata"]
    assert (ckpt / "step_000000006" / MANIFEST_NAME).is_file()


def test_trash_cleanup_leaves_another_users_trash_alone(planted_run):
    trash = planted_run["ckpt"] / ".trash-step_000000005-1-1"
    assert _fingerprint(trash) == planted_run["before"][trash.name]


def test_retention_says_once_per_directory_what_it_leaves_alone_and_why(planted_run):
    ckpt, err = planted_run["ckpt"], planted_run["stderr"]
    expected = {
        "step_000000001": f"owned by uid {FOREIGN_UID}",
        "step_000000002": "no OWNER.json and no MANIFEST.json",
        "step_000000003": "symbolic link",
        ".trash-step_000000005-1-1": f"owned by uid {FOREIGN_UID}",
    }
    for name, why in expected.items():
        lines = [ln for ln in err.splitlines() if f"leaving {ckpt / name} alone" in ln]
        assert len(lines) == 1, (name, lines)         # six retention passes, one line
        assert why in lines[0] and "WARNING" in lines[0]
    assert "Traceback" not in err


def test_a_checkpoint_written_before_the_owner_marker_still_resumes(tmp_path):
    path = _our_checkpoints(tmp_path, [4])[4]
    _make_legacy(path)
    model = torch.nn.Linear(8, 8)
    info = CheckpointManager(CheckpointConfig(dir=str(tmp_path)), {"model": model}).resume()
    assert info is not None and info.step == 4 and info.path == path


def test_each_step_directory_carries_our_marker_listed_in_its_manifest(tmp_path):
    path = _our_checkpoints(tmp_path, [2])[2]
    marker = json.loads((path / layout.MARKER_NAME).read_text())
    assert marker["format"] == layout.MARKER_FORMAT and marker["uid"] == os.geteuid()
    assert marker["pid"] == os.getpid() and marker["step"] == 2 and "run_id" in marker
    listed = json.loads((path / MANIFEST_NAME).read_text())["files"][layout.MARKER_NAME]
    assert listed["size"] == (path / layout.MARKER_NAME).stat().st_size
    assert listed["crc32"] == layout.file_crc(path / layout.MARKER_NAME)
