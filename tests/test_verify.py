"""`kempner-resilience verify` and `ls` see every damage resume sees: each kind of damage that
makes resume reject a checkpoint makes `verify` exit 1 and `ls` say DAMAGED, and both find the
checkpoint directories below a work directory."""

from __future__ import annotations

import contextlib
import io
import json
import pickle
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Callable

import pytest

from checkpoint_helpers import toy
from kempner_resilience.checkpoint import MANIFEST_NAME, CheckpointManager
from kempner_resilience.checkpoint.crc import crc32_combine
from kempner_resilience.checkpoint.layout import file_crc
from kempner_resilience.cli import main as cli_main
from kempner_resilience.config import CheckpointConfig
from helpers import run_script

CLI = str(Path(sys.executable).parent / "kempner-resilience")


def run(*args: str) -> subprocess.CompletedProcess:
    """The CLI's ``main`` in this process, its output captured: the damage tests call it five
    times each, and a process each would start torch sixty times for the same code. The
    console script itself runs as a process in the last two tests of this module."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(list(args))
    return subprocess.CompletedProcess(["kempner-resilience", *args], code, out.getvalue(),
                                       err.getvalue())


def run_process(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120)


def _two_checkpoints(root: Path) -> None:
    state = toy.build(0)
    mgr = CheckpointManager(CheckpointConfig(dir=str(root), keep_last=5), state)
    for step in (1, 2):
        toy.train_step(state)
        mgr.save(step)
    mgr.close()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pristine")
    _two_checkpoints(root)
    return root


@pytest.fixture
def ckpts(pristine: Path, tmp_path: Path) -> Path:
    """A fresh copy of two good checkpoints (steps 1 and 2) to damage."""
    root = tmp_path / "ckpt"
    shutil.copytree(pristine, root)
    return root


# --- damage, each as a user's disk or a careless hand might do it -----------------------------

def _manifest(step: Path) -> dict:
    return json.loads((step / MANIFEST_NAME).read_text())


def _write_manifest(step: Path, man: dict) -> None:
    (step / MANIFEST_NAME).write_text(json.dumps(man))


def _shard(step: Path) -> Path:
    return max(step.glob("*.distcp"), key=lambda p: p.stat().st_size)


def garbage_manifest(step: Path) -> None:
    (step / MANIFEST_NAME).write_bytes(b"\x00\xffnot a manifest\n")


def truncated_manifest(step: Path) -> None:
    raw = (step / MANIFEST_NAME).read_bytes()
    (step / MANIFEST_NAME).write_bytes(raw[: len(raw) // 2])


def wrong_record_crc(step: Path) -> None:
    man = _manifest(step)
    man["files"][_shard(step).name]["records"][3][2] ^= 0x1
    _write_manifest(step, man)


def wrong_record_crc_with_matching_file_crc(step: Path) -> None:
    """A record CRC changed and the file CRC recomputed to agree: only the data tells."""
    man = _manifest(step)
    meta = man["files"][_shard(step).name]
    meta["records"][3][2] ^= 0x1
    crc = 0
    for offset, length, rcrc, *_ in meta["records"]:
        crc = crc32_combine(crc, rcrc, length)
    meta["crc32"] = crc
    _write_manifest(step, man)


def wrong_file_crc(step: Path) -> None:
    man = _manifest(step)
    man["files"][_shard(step).name]["crc32"] ^= 0x1
    _write_manifest(step, man)


def wrong_step_in_manifest(step: Path) -> None:
    man = _manifest(step)
    man["step"] = 7
    _write_manifest(step, man)


def manifest_is_a_directory(step: Path) -> None:
    (step / MANIFEST_NAME).unlink()
    (step / MANIFEST_NAME).mkdir()


def flipped_byte_in_shard(step: Path) -> None:
    shard = _shard(step)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))


def truncated_shard(step: Path) -> None:
    shard = _shard(step)
    shard.write_bytes(shard.read_bytes()[:-1])


def missing_shard(step: Path) -> None:
    _shard(step).unlink()


def corrupted_metadata(step: Path) -> None:
    meta = step / ".metadata"
    data = bytearray(meta.read_bytes())
    data[len(data) // 2] ^= 0xFF
    meta.write_bytes(bytes(data))


def metadata_disagreeing_with_the_records(step: Path) -> None:
    """A .metadata that parses and matches its manifest CRC, but names a record length the
    manifest does not have: the load would read the wrong bytes."""
    md = pickle.loads((step / ".metadata").read_bytes())
    index, info = next(iter(md.storage_data.items()))
    md.storage_data[index] = replace(info, length=info.length - 1)
    (step / ".metadata").write_bytes(pickle.dumps(md))
    man = _manifest(step)
    man["files"][".metadata"] = {**man["files"][".metadata"],
                                 "size": (step / ".metadata").stat().st_size,
                                 "crc32": file_crc(step / ".metadata")}
    _write_manifest(step, man)


# (damage, whether `ls` without --checksums sees it: it reads no tensor data)
DAMAGE: list[tuple[Callable[[Path], None], bool]] = [
    (garbage_manifest, True), (truncated_manifest, True), (wrong_record_crc, True),
    (wrong_record_crc_with_matching_file_crc, False), (wrong_file_crc, True),
    (wrong_step_in_manifest, True), (manifest_is_a_directory, True),
    (flipped_byte_in_shard, False), (truncated_shard, True), (missing_shard, True),
    (corrupted_metadata, True), (metadata_disagreeing_with_the_records, False),
]


@pytest.mark.parametrize("damage,cheap", DAMAGE, ids=[d.__name__ for d, _ in DAMAGE])
def test_damage_resume_rejects_makes_verify_exit_1_and_ls_say_damaged(ckpts, damage, cheap):
    bad = ckpts / "step_000000002"
    damage(bad)

    for target in (ckpts, bad):                               # verify rejects it ...
        proc = run("verify", str(target))
        assert proc.returncode == 1, proc.stdout + proc.stderr
        assert f"DAMAGED  {bad}:" in proc.stdout
        assert "Traceback" not in proc.stderr
    assert f"OK       {ckpts / 'step_000000001'}" in run("verify", str(ckpts)).stdout

    listing = run("ls", "--checksums", str(ckpts))
    assert listing.returncode == 1
    row = next(ln for ln in listing.stdout.splitlines() if ln.endswith("step_000000002"))
    assert "DAMAGED" in row and "yes" in row                  # committed once, now damaged
    if cheap:
        listing = run("ls", str(ckpts))
        assert listing.returncode == 1
        row = next(ln for ln in listing.stdout.splitlines() if ln.endswith("step_000000002"))
        assert "DAMAGED" in row
        assert any(ln.strip().startswith("step_000000002:") for ln in listing.stdout.splitlines())

    info = CheckpointManager(CheckpointConfig(dir=str(ckpts), keep_last=5),
                             toy.build(0)).resume()
    assert info.step == 1                                     # ... and so does resume,
    # which sets aside what it proved damaged (test_lineage.py) and leaves the rest in place.
    assert bad.is_dir() or [p.name for p in ckpts.glob(".damaged-step_000000002-*")]


@pytest.fixture
def work_dir(pristine: Path, tmp_path: Path) -> Path:
    """A demo-like work directory: checkpoints two levels below, in two runs."""
    work = tmp_path / "demo-workdir"
    for run_name in ("reference", "resilient"):
        shutil.copytree(pristine, work / run_name / "checkpoints")
    (work / "resilient" / "log.txt").write_text("not a checkpoint\n")
    return work


def test_verify_and_ls_of_a_work_directory_find_the_checkpoint_directories_below(work_dir):
    proc = run("verify", str(work_dir))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for run_name in ("reference", "resilient"):
        root = work_dir / run_name / "checkpoints"
        assert f"{root}:" in proc.stdout
        assert f"OK       {root / 'step_000000002'}" in proc.stdout
    listing = run("ls", str(work_dir))
    assert listing.returncode == 0
    assert f"{work_dir / 'resilient' / 'checkpoints'}:" in listing.stdout
    assert listing.stdout.count("sizes ok ") == 4      # the rows, not the closing note


def test_verify_of_a_work_directory_fails_on_damage_below_it(work_dir):
    garbage_manifest(work_dir / "resilient" / "checkpoints" / "step_000000002")
    proc = run("verify", str(work_dir))
    assert proc.returncode == 1
    assert "DAMAGED" in proc.stdout and "unreadable manifest" in proc.stdout
    assert run("ls", str(work_dir)).returncode == 1


def test_a_directory_without_checkpoints_says_how_far_it_looked(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    listing = run_process("ls", str(tmp_path))
    assert listing.returncode == 0
    assert "no checkpoints" in listing.stdout and "3 levels below" in listing.stdout
    proc = run_process("verify", str(tmp_path))
    assert proc.returncode == 1
    assert "no checkpoints" in proc.stderr and "Traceback" not in proc.stderr


def test_ls_says_that_sizes_ok_did_not_read_the_data_and_checksums_find_a_flipped_bit(tmp_path):
    import torch

    from kempner_resilience.checkpoint import CheckpointManager
    from kempner_resilience.config import CheckpointConfig

    model = torch.nn.Linear(64, 64)
    info = CheckpointManager(CheckpointConfig(dir=str(tmp_path)), {"model": model}).save(1)
    data = max(info.path.glob("*.distcp"), key=lambda p: p.stat().st_size)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01                     # one bit, same size
    data.write_bytes(bytes(raw))

    def ls(*extra: str) -> subprocess.CompletedProcess:
        return run_script([sys.executable, "-m", "kempner_resilience.cli", "ls",
                               str(tmp_path), *extra], capture_output=True, text=True,
                              timeout=120)
    quick = ls()
    assert quick.returncode == 0 and "sizes ok" in quick.stdout
    assert "the data was not read" in quick.stdout and "--checksums" in quick.stdout
    full = ls("--checksums")
    assert full.returncode == 1 and "DAMAGED" in full.stdout
