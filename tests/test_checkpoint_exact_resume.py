"""Resuming is exact: a run saved after k steps and resumed in a NEW process ends bitwise
identical (weights, Adam state, scheduler, data position, RNG streams) to a run that never
stopped. Real processes, real DCP files; 2-rank runs use gloo and DDP.

With 3+ ranks the order in which DDP's all-reduce adds the ranks' gradients depends on its
gradient bucket layout, which DDP rebuilds after a process's first step: the checkpoint carries
that layout and resume restores it (``ddp_train.py``, several buckets).

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


@pytest.fixture(scope="module")
def ddp_3_ranks(tmp_path_factory) -> Path:
    """3 DDP ranks trained 8 steps with a save after 4 (``straight.pt``), computed once."""
    work = tmp_path_factory.mktemp("ddp3")
    run_ranks("ddp_train.py", ["--dir", str(work / "ckpt"), "--steps", "8", "--save-at", "4",
                               "--bucket-cap-mb", "0.005", "--out", str(work / "straight.pt")], 3)
    return work


@pytest.mark.slow
def test_resume_in_new_processes_is_bitwise_exact_3_ranks_ddp_several_buckets(
        ddp_3_ranks: Path) -> None:
    work = ddp_3_ranks
    run_ranks("ddp_train.py", ["--dir", str(work / "ckpt"), "--steps", "8", "--resume",
                               "--bucket-cap-mb", "0.005", "--out", str(work / "resumed.pt")], 3)
    assert_bitwise_equal(torch.load(work / "straight.pt"), torch.load(work / "resumed.pt"))


@pytest.mark.slow
def test_a_bucket_layout_that_does_not_match_the_model_is_skipped_with_a_warning(
        ddp_3_ranks: Path, tmp_path: Path) -> None:
    # Resumed with the first layer frozen: DDP reduces 4 parameters, the record names 6.
    outs = run_ranks("ddp_train.py", ["--dir", str(ddp_3_ranks / "ckpt"), "--steps", "6",
                                      "--resume", "--freeze-first", "--bucket-cap-mb", "0.005",
                                      "--out", str(tmp_path / "frozen.pt")], 3)
    assert "gradient bucket layout not restored: the recorded layout does not match" in outs[0]
    assert "not trained by this DDP: 0.bias, 0.weight" in outs[0]
    assert (tmp_path / "frozen.pt").exists()
