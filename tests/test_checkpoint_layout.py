"""Layout rules: fresh directories, the manifest as the only commit, retention that never
deletes the newest, protected or foreign directories, and deletion that never looks committed."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from kempner_resilience.checkpoint import layout, retention
from kempner_resilience.core.runpaths import RunPaths


def _commit(root: Path, step: int) -> Path:
    path = layout.create_step_dir(RunPaths(root), step)
    (path / "__0_0.distcp").write_bytes(b"x")
    layout.write_manifest(path, {"format": layout.FORMAT, "step": step, "committed_at": step,
                                 "files": {"__0_0.distcp": {"size": 1, "crc32": 0x8CDC1683}}})
    return path


def test_a_step_directory_is_never_reused(tmp_path: Path) -> None:
    a = layout.create_step_dir(RunPaths(tmp_path), 10)
    b = layout.create_step_dir(RunPaths(tmp_path), 10)
    assert a.name == "step_000000010" and b.name == "step_000000010.1"


def test_only_a_manifest_makes_a_directory_committed(tmp_path: Path) -> None:
    partial = layout.create_step_dir(RunPaths(tmp_path), 5)
    (partial / ".metadata").write_bytes(b"x")          # DCP's own marker is not a commit
    done = _commit(tmp_path, 4)
    entries = {e.path: e.committed for e in layout.scan(RunPaths(tmp_path))}
    assert entries == {partial: False, done: True}


def test_newest_is_the_highest_step_then_the_latest_commit(tmp_path: Path) -> None:
    _commit(tmp_path, 7)
    again = _commit(tmp_path, 7)            # e.g. a re-save after falling back to an older one
    _commit(tmp_path, 3)
    assert layout.scan(RunPaths(tmp_path))[-1].path == again


def test_retention_keeps_last_n_and_keep_every_multiples(tmp_path: Path) -> None:
    for s in (10, 20, 30, 40, 50):
        _commit(tmp_path, s)
    victims = retention.select_for_deletion(layout.scan(RunPaths(tmp_path)), keep_last=2,
                                            keep_every=20)
    assert sorted(e.step for e in victims) == [10, 30]


def test_retention_never_deletes_newest_protected_or_foreign_dirs(tmp_path: Path) -> None:
    for s in (1, 2):
        _commit(tmp_path, s)
    writing = layout.create_step_dir(RunPaths(tmp_path), 1)    # partial, but being written
    abandoned = layout.create_step_dir(RunPaths(tmp_path), 2)  # partial, older than newest commit
    foreign = tmp_path / "step_000000000"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")              # not a file we write
    (tmp_path / "unrelated").mkdir()
    victims = {e.path for e in retention.select_for_deletion(layout.scan(RunPaths(tmp_path)),
                                                             keep_last=1, keep_every=0,
                                                             protect=[writing])}
    assert victims == {tmp_path / "step_000000001", abandoned}


def test_deleting_renames_to_trash_first(tmp_path: Path) -> None:
    path = _commit(tmp_path, 3)
    trash = tmp_path / ".trash-step_000000003-1-1"
    path.rename(trash)                                  # a crash right after the rename
    assert layout.scan(RunPaths(tmp_path)) == []        # nothing looks committed
    retention.clean_trash(RunPaths(tmp_path))
    assert not trash.exists()


SHARDS = 20
CALLS = SHARDS + 4          # the shards, .metadata, the marker, the manifest, the rmdir


def _many_files_commit(root: Path, step: int) -> Path:
    path = layout.create_step_dir(RunPaths(root), step)
    for i in range(SHARDS):
        (path / f"__{i}_0.distcp").write_bytes(b"x")
    (path / ".metadata").write_bytes(b"m")
    layout.write_manifest(path, {"format": layout.FORMAT, "step": step, "committed_at": step,
                                 "files": {}})
    return path


@pytest.mark.parametrize("killed_at", range(CALLS + 1))
def test_a_deletion_sigkilled_at_any_file_is_finished_by_the_next_retention(
        tmp_path: Path, killed_at: int) -> None:
    # A real process deletes a checkpoint of 23 files and is SIGKILLed right before its
    # ``killed_at``-th unlink or rmdir (CALLS: it finished). What is left must be finished by the
    # next run's retention: never shards left behind for good in a directory it refuses.
    path = _many_files_commit(tmp_path, 3)
    pid = os.fork()
    if pid == 0:
        calls = [0]

        def cut(real):
            def wrapper(*args, **kwargs):
                if calls[0] == killed_at:
                    os.kill(os.getpid(), signal.SIGKILL)
                calls[0] += 1
                return real(*args, **kwargs)
            return wrapper
        os.unlink, os.rmdir = cut(os.unlink), cut(os.rmdir)
        try:
            retention.remove_dir(path)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) == (killed_at < CALLS)
    skipped = []
    retention.clean_trash(RunPaths(tmp_path), on_skip=lambda p, why: skipped.append(why))
    assert skipped == [] and os.listdir(tmp_path) == []


def test_a_damaged_manifest_is_reported_and_left_alone_by_retention(tmp_path: Path) -> None:
    damaged = _commit(tmp_path, 1)
    (damaged / layout.MANIFEST_NAME).write_text("{not json")    # committed once, now unreadable
    _commit(tmp_path, 2)
    entry = next(e for e in layout.scan(RunPaths(tmp_path)) if e.path == damaged)
    assert entry.damaged and not entry.committed and "MANIFEST.json" in entry.problem
    assert retention.select_for_deletion(layout.scan(RunPaths(tmp_path)), keep_last=1,
                                         keep_every=0) == []
