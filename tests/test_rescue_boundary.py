"""The step boundary in one process: what the rescue writes in the middle of a step is exactly
the checkpoint of the boundary before it, and an optimizer step since the boundary forbids it."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from checkpoint_helpers import toy
from helpers import assert_bitwise_equal
from kempner_resilience.checkpoint import CheckpointManager, layout
from kempner_resilience.checkpoint.state import TrainState
from kempner_resilience.config import CheckpointConfig
from kempner_resilience.rescue.boundary import Boundary
from kempner_resilience.rescue.save import write_rescue
from kempner_resilience.core.runpaths import RunPaths


def _build() -> dict:
    """toy's state (dropout, Adam, scheduler, data, python/numpy noise) with BatchNorm, whose
    running statistics change in every forward pass."""
    state = toy.build(0)
    torch.manual_seed(0)
    state["model"] = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(),
                                   nn.Dropout(0.3), nn.Linear(32, 4))
    state["optim"] = torch.optim.Adam(state["model"].parameters(), lr=1e-2)
    state["sched"] = torch.optim.lr_scheduler.StepLR(state["optim"], step_size=3, gamma=0.5)
    toy.seed_all(0)
    return state


def _resumed(path: Path) -> dict:
    fresh = _build()
    info = CheckpointManager(CheckpointConfig(dir=str(path)), fresh).resume()
    assert info is not None and info.step == 3
    return toy.snapshot(fresh)


def test_a_rescue_written_inside_a_step_resumes_exactly_like_a_checkpoint_of_its_boundary(
        tmp_path: Path) -> None:
    straight = _build()
    for _ in range(3):
        toy.train_step(straight)
    CheckpointManager(CheckpointConfig(dir=str(tmp_path / "saved")), straight).save(3)

    state = _build()
    for _ in range(3):
        toy.train_step(state)
    boundary = Boundary(TrainState(state))
    boundary.attach()
    boundary.mark(3)
    # Step 4 fails in the gradient all-reduce: the forward pass already drew dropout masks,
    # moved the data and the BatchNorm statistics; no optimizer step ran.
    x, y = state["data"].next()
    ((state["model"](x) - y) ** 2).mean().backward()
    assert boundary.why_inconsistent() is None
    [snap, *_] = boundary.snapshots()
    info = write_rescue(boundary.state, boundary, {0: snap.payload}, 3,
                        paths=RunPaths(tmp_path / "rescued"), run_id=None, io_threads=2,
                        world_size=1,
                        extra={"rescue": {"reason": "test"}})
    assert info.reason == "rescue" and info.step == 3
    layout.verify_entry(layout.scan_one(info.path))

    assert_bitwise_equal(_resumed(tmp_path / "saved"), _resumed(tmp_path / "rescued"))


def test_once_an_optimizer_step_began_the_boundary_cannot_be_written_until_the_next_one() -> None:
    state = _build()
    boundary = Boundary(TrainState(state))
    boundary.attach()
    assert boundary.why_inconsistent() == "no step boundary was reached yet"
    boundary.mark(0)
    assert boundary.why_inconsistent() is None
    toy.train_step(state)                   # forward, backward, optimizer.step()
    assert "optimizer step already ran" in boundary.why_inconsistent()
    boundary.mark(1)
    assert boundary.why_inconsistent() is None
    boundary.detach()
    toy.train_step(state)                   # unhooked: no longer watched
    assert boundary.why_inconsistent() is None


def test_the_snapshot_holds_numpys_exact_state_also_when_only_a_cached_gaussian_was_used() -> None:
    import numpy as np

    from kempner_resilience.rescue.boundary import decode, encode

    def snapped() -> tuple:
        return decode(encode(0, {}))["rng"]["numpy"]

    def same(a: tuple, b: tuple) -> bool:
        return a[0] == b[0] and (a[1] == b[1]).all() and a[2:] == b[2:]

    np.random.seed(7)
    assert same(snapped(), np.random.get_state())
    assert same(snapped(), np.random.get_state())       # untouched: the cheap path
    np.random.standard_normal()                         # draws a pair, caches the second
    assert np.random.get_state()[3] == 1 and same(snapped(), np.random.get_state())
    np.random.standard_normal()                         # uses the cached one: words unchanged
    assert np.random.get_state()[3] == 0 and same(snapped(), np.random.get_state())
    np.random.rand(5)
    assert same(snapped(), np.random.get_state())
    np.random.seed(7)
    assert same(snapped(), np.random.get_state())


def test_the_snapshot_holds_pythons_exact_rng_state_after_draws_a_cached_gaussian_and_a_seed(
) -> None:
    import random

    from kempner_resilience.rescue.boundary import decode, encode

    def snapped() -> tuple:
        return decode(encode(0, {}))["rng"]["python"]

    random.seed(11)
    assert snapped() == random.getstate()
    random.random()
    assert snapped() == random.getstate()
    random.gauss(0.0, 1.0)                   # draws a pair, caches the second
    assert random.getstate()[2] is not None and snapped() == random.getstate()
    random.gauss(0.0, 1.0)                   # uses the cached one: the words unchanged
    assert random.getstate()[2] is None and snapped() == random.getstate()
    snap = snapped()
    expected = random.random()
    random.random()
    random.setstate(snap)                    # what a resume from the snapshot restores
    assert random.random() == expected


def test_a_rescue_of_a_plain_sgd_without_state_does_not_count_its_own_state_building_as_a_step(
        tmp_path: Path) -> None:
    # DCP gives an optimizer without state (SGD, no momentum) one at a step with lr 0; the
    # rescue's own thread doing so must not look like the training moving past the boundary.
    state = _build()
    state["optim"] = torch.optim.SGD(state["model"].parameters(), lr=1e-2)
    state["sched"] = torch.optim.lr_scheduler.StepLR(state["optim"], step_size=3, gamma=0.5)
    boundary = Boundary(TrainState(state))
    boundary.attach()
    boundary.mark(3)
    generation = boundary.generation
    assert boundary.freeze(5.0)
    [snap, *_] = boundary.snapshots()
    info = write_rescue(boundary.state, boundary, {0: snap.payload}, 3,
                        paths=RunPaths(tmp_path / "rescued"), run_id=None, io_threads=2,
                        world_size=1, extra={"rescue": {"reason": "test"}})
    assert info.step == 3 and boundary.generation == generation
    assert boundary.why_inconsistent() is None
    layout.verify_entry(layout.scan_one(info.path))


def test_the_snapshot_gives_back_a_state_dicts_tensors_bitwise_and_a_later_change_cannot_reach_it(
) -> None:
    from kempner_resilience.rescue.boundary import decode, encode

    gen = torch.Generator().manual_seed(3)
    shared = torch.arange(6.0)
    sd = {"generator": gen.get_state(), "bf16": torch.randn(3, 2).to(torch.bfloat16),
          "scalar": torch.tensor(2.5), "empty": torch.empty(0, 3),
          "strided": torch.arange(10.0)[2:8:2], "flags": torch.tensor([True, False]),
          "param": nn.Parameter(torch.ones(2)), "twice": [shared, shared], "step": 7}

    class Entry:
        def state_dict(self) -> dict:
            return sd

    payload = encode(4, {"data": Entry()})
    shared.add_(1)                       # after the snapshot: not in it
    back = decode(payload)["objects"]["data"]

    shared.sub_(1)
    for key in ("generator", "bf16", "scalar", "empty", "strided", "flags", "param"):
        assert type(back[key]) is type(sd[key]) and back[key].dtype == sd[key].dtype
        assert back[key].shape == sd[key].shape and torch.equal(back[key], sd[key]), key
    assert torch.equal(back["twice"][0], shared) and back["twice"][0] is back["twice"][1]
    assert back["step"] == 7
