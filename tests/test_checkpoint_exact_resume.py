"""Resuming is exact: a run saved after k steps and resumed in a NEW process ends bitwise
identical (weights, Adam state, scheduler, data position, RNG streams) to a run that never
stopped. Real processes, real DCP files; 2-rank runs use gloo and DDP.

Each scenario starts two launches (process start costs seconds here): the first trains all N
steps, saving after k (it is the uninterrupted run: saving must not perturb training, which the
1-rank tests also check against a run without any save); the second resumes from that save.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpoint_helpers import toy
from helpers import assert_bitwise_equal
from checkpoint_helpers.launch import run_ranks

STEPS, SAVE_AT = 10, 4


def _never_saved_run() -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        state = toy.build(0)
        for _ in range(STEPS):
            toy.train_step(state)
        return toy.snapshot(state)
    finally:
        torch.set_num_threads(threads)


def _saved_then_resumed(tmp_path: Path, world: int, extra: list[str]) -> None:
    ckpt = str(tmp_path / "ckpt")
    run_ranks("train.py", ["--dir", ckpt, "--steps", str(STEPS), "--save-at", str(SAVE_AT),
                           *extra, "--out", str(tmp_path / "straight")], world)
    run_ranks("train.py", ["--dir", ckpt, "--steps", str(STEPS), "--resume",
                           "--out", str(tmp_path / "resumed")], world)
    for rank in range(world):
        a = torch.load(tmp_path / f"straight.rank{rank}.pt", weights_only=False)
        b = torch.load(tmp_path / f"resumed.rank{rank}.pt", weights_only=False)
        assert_bitwise_equal(a, b, f"rank{rank}")
    if world == 1:
        assert_bitwise_equal(_never_saved_run(), a, "never-saved vs saved")


def test_resume_in_new_process_is_bitwise_exact_1_rank(tmp_path: Path) -> None:
    _saved_then_resumed(tmp_path, 1, [])


def test_resume_from_async_save_is_bitwise_exact_1_rank(tmp_path: Path) -> None:
    _saved_then_resumed(tmp_path, 1, ["--async"])


@pytest.mark.slow
def test_resume_in_new_processes_is_bitwise_exact_2_ranks_ddp(tmp_path: Path) -> None:
    _saved_then_resumed(tmp_path, 2, [])
    a0 = torch.load(tmp_path / "straight.rank0.pt", weights_only=False)
    a1 = torch.load(tmp_path / "straight.rank1.pt", weights_only=False)
    # Per-rank state really is per rank (so a rank-shared key would have broken it).
    assert a0["data"] != a1["data"] and not torch.equal(a0["torch_rng"], a1["torch_rng"])
    assert_bitwise_equal(a0["params"], a1["params"], "DDP replicas")
