"""State saved by other processes (a Ray worker group's actors): their files go into a
subdirectory of the step directory and into the one manifest the driver commits.

In one process, with real DCP files: the "group" here saves and loads through the same part
save its actors use (``checkpoint/partsave.py``), so what is checked is the driver's side (the
commit, resume, verify, retention) with the actors' real file tables.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kempner_resilience.checkpoint import MANIFEST_NAME, CheckpointError, CheckpointManager
from kempner_resilience.checkpoint import layout
from kempner_resilience.checkpoint.partsave import load_part, save_part
from kempner_resilience.checkpoint.state import TrainState
from kempner_resilience.config import CheckpointConfig


class Counters:
    """The driver's own state: a step counter."""

    def __init__(self) -> None:
        self.seen = 0

    def state_dict(self) -> dict:
        return {"seen": self.seen}

    def load_state_dict(self, sd: dict) -> None:
        self.seen = sd["seen"]


class Group:
    """A worker group's part, saved here by the part save its actors run."""

    def __init__(self, fail: bool = False) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 3)
        self.optim = torch.optim.Adam(self.model.parameters(), lr=0.1)
        self.state = TrainState({"model": self.model, "optim": self.optim})
        self.fail = fail

    def train(self) -> None:
        self.optim.zero_grad()
        self.model(torch.ones(2, 4)).pow(2).sum().backward()
        self.optim.step()

    def save_into(self, directory: Path, step: int) -> dict:
        if self.fail:
            raise RuntimeError("rank 1 could not write its shard")
        return save_part(self.state, directory, step, 0)

    def load_from(self, directory: Path, manifest: dict) -> None:
        load_part(self.state, directory, manifest, 0, 1)


def _manager(tmp_path: Path, group: Group, counters: Counters, **kw) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(dir=str(tmp_path / "ckpt"), **kw),
                             {"counters": counters, "policy": group})


def test_a_groups_files_are_committed_in_its_subdirectory_under_the_one_manifest(
        tmp_path: Path) -> None:
    group, counters = Group(), Counters()
    group.train()
    info = _manager(tmp_path, group, counters).save(1)
    files = json.loads((info.path / MANIFEST_NAME).read_text())["files"]
    assert {"policy/.metadata", "policy/__0_0.distcp", ".metadata", "__0_0.distcp"} <= set(files)
    assert (info.path / "policy" / "__0_0.distcp").stat().st_size == \
        files["policy/__0_0.distcp"]["size"]
    layout.verify_entry(layout.scan_one(info.path))       # every byte against its checksum


def test_resume_loads_the_groups_state_and_the_drivers_bitwise(tmp_path: Path) -> None:
    group, counters = Group(), Counters()
    group.train()
    counters.seen = 7
    _manager(tmp_path, group, counters).save(1)
    weights = {k: v.clone() for k, v in group.model.state_dict().items()}
    moments = group.optim.state_dict()["state"][0]["exp_avg"].clone()
    fresh, fresh_counters = Group(), Counters()
    info = _manager(tmp_path, fresh, fresh_counters).resume()
    assert info is not None and info.step == 1
    assert fresh_counters.seen == 7
    assert all(torch.equal(weights[k], v) for k, v in fresh.model.state_dict().items())
    assert torch.equal(fresh.optim.state_dict()["state"][0]["exp_avg"], moments)


def test_a_damaged_byte_in_a_groups_file_makes_resume_take_the_previous_checkpoint(
        tmp_path: Path) -> None:
    group, counters = Group(), Counters()
    mgr = _manager(tmp_path, group, counters)
    mgr.save(1)
    group.train()
    newest = mgr.save(2)
    shard = newest.path / "policy" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[-20] ^= 0xFF
    shard.write_bytes(bytes(data))
    info = _manager(tmp_path, Group(), Counters()).resume()
    assert info is not None and info.step == 1


def test_a_group_that_fails_its_save_commits_nothing_and_the_last_checkpoint_stays(
        tmp_path: Path) -> None:
    group, counters = Group(), Counters()
    mgr = _manager(tmp_path, group, counters)
    first = mgr.save(1)
    group.fail = True
    with pytest.raises(CheckpointError, match="could not write its shard"):
        mgr.save(2)
    assert [e.step for e in layout.scan(mgr.paths)] == [1]      # no partial directory left
    assert mgr.latest() == first


def test_retention_deletes_old_checkpoints_with_their_groups_subdirectories(
        tmp_path: Path) -> None:
    group, counters = Group(), Counters()
    mgr = _manager(tmp_path, group, counters, keep_last=1)
    for step in (1, 2, 3):
        group.train()
        mgr.save(step)
    mgr.close()
    assert [e.step for e in layout.scan(mgr.paths)] == [3]


def test_a_checkpoint_without_the_groups_part_is_not_resumed_with_a_fresh_group(
        tmp_path: Path) -> None:
    counters = Counters()
    CheckpointManager(CheckpointConfig(dir=str(tmp_path / "ckpt")), {"counters": counters}) \
        .save(1)
    with pytest.raises(CheckpointError, match="holds no state of 'policy'"):
        _manager(tmp_path, Group(), Counters()).resume()
