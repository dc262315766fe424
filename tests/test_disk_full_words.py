"""What a full filesystem is called: out of inodes is not "the disk is full", and a full disk's
message says that ``keep_last`` needs room for one checkpoint more than it keeps.

Real files on small tmpfs mounts (we run as root; skipped where mounting is not permitted).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from checkpoint_helpers import toy
from helpers import fill_disk
from kempner_resilience.checkpoint import CheckpointError, CheckpointManager
from kempner_resilience.config import CheckpointConfig




def _use_up_inodes(root: Path) -> int:
    """Create empty files until the filesystem has no inode left; returns how many."""
    n = 0
    (root / "many").mkdir()
    while True:
        try:
            (root / "many" / str(n)).touch()
        except OSError:
            return n
        n += 1


def test_a_save_that_runs_out_of_inodes_says_inodes_not_that_the_disk_is_full(mount_tmpfs):
    root = mount_tmpfs("inodes", "size=64m,nr_inodes=64")
    state = toy.build(0)
    mgr = CheckpointManager(CheckpointConfig(dir=str(root / "ckpt"), keep_last=2), state)
    mgr.check_dir()
    first = mgr.save(1)
    assert _use_up_inodes(root) > 0
    st = os.statvfs(root)
    assert st.f_favail == 0 and st.f_bavail > st.f_blocks // 2, "bytes free, inodes not"
    toy.train_step(state)
    with pytest.raises(CheckpointError) as exc:
        mgr.save(2)
    msg = str(exc.value)
    assert "has no free inodes" in msg and "df -i" in msg, msg
    assert "is full" not in msg and "Free space there" not in msg, msg
    assert str(first.path) in msg and "intact" in msg
    with pytest.raises(CheckpointError, match="has no free inodes"):
        mgr.check_dir()
    mgr.close()


def test_a_full_disk_says_keep_last_needs_room_for_one_checkpoint_more(mount_tmpfs):
    root = mount_tmpfs("small", "size=2m")
    state = toy.build(0)
    mgr = CheckpointManager(CheckpointConfig(dir=str(root / "ckpt"), keep_last=3), state)
    mgr.check_dir()
    mgr.save(1)
    fill_disk(root)                                  # leave less than one save
    toy.train_step(state)
    with pytest.raises(CheckpointError) as exc:
        mgr.save(2)
    msg = str(exc.value)
    assert "is full" in msg and "no free inodes" not in msg, msg
    assert "checkpoint.keep_last: 3 needs room for 4 checkpoints" in msg, msg
    mgr.close()
