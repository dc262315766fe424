"""Resumable data loading: a DDP job with dropout and a real DataLoader over a shuffling
``DistributedSampler``, interrupted mid-epoch by a real SIGUSR1 and resumed in new processes,
ends bitwise equal to an uninterrupted run and trains on the same samples in the same order.

Two ways in: torchdata's ``StatefulDataLoader`` put in the state as it is, and a plain
``DataLoader`` wrapped in ``kempner_resilience.ResumableLoader``. Before either, a resumed run
drew its loader's seed from the global RNG once more than the run it continues (every later
dropout mask differed) and restarted the sampler at epoch 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from checkpoint_helpers.launch import HERE
from helpers import assert_bitwise_equal, require
from kempner_resilience.checkpoint import CheckpointError
from kempner_resilience.checkpoint.data import ResumableLoader
from kempner_resilience.checkpoint.state import TrainState
from kempner_resilience.demo.launcher import LocalLauncher
from kempner_resilience.exitcodes import ExitCode

STEPS, PER_EPOCH, INTERRUPT_AT = 25, 10, 12     # the stop lands inside the second epoch


def run_job(work: Path, loader: str, interrupts: dict[int, str] | None = None,
            workers: int = 0) -> tuple[list, dict, list[list[str]]]:
    work.mkdir(parents=True)
    cmd = [sys.executable, str(HERE / "loader_train.py"), "--loader", loader,
           "--steps", str(STEPS), "--ckpt", str(work / "ckpt"), "--out", str(work / "w.pt"),
           "--workers", str(workers)]
    launches = LocalLauncher(cmd, ranks=2, workdir=work, interrupts=interrupts,
                             max_launches=3).run()
    seen = [(work / f"seen.rank{r}").read_text().splitlines() for r in range(2)]
    return launches, torch.load(work / "w.pt", weights_only=True), seen


def assert_resumed_mid_epoch_bitwise(tmp_path: Path, loader: str, workers: int = 0) -> None:
    _, ref, ref_seen = run_job(tmp_path / "straight", loader, workers=workers)
    launches, got, seen = run_job(tmp_path / "interrupted", loader, {INTERRUPT_AT: "SIGUSR1"},
                                  workers=workers)
    assert [l.exit_code for l in launches] == [ExitCode.REQUEUE, 0], launches[-1].stderr_tail
    stop = launches[0].report["stop_step"]
    assert launches[1].report["resumed_from"] == stop
    assert stop % PER_EPOCH != 0 and stop > PER_EPOCH, f"stopped at {stop}: not mid-epoch 2"
    assert seen == ref_seen           # every sample once, in the uninterrupted run's order
    assert_bitwise_equal(ref, got)


@pytest.mark.slow
def test_a_stateful_dataloader_resumes_mid_epoch_bitwise_2_rank_ddp_with_dropout(tmp_path):
    require("torchdata")
    assert_resumed_mid_epoch_bitwise(tmp_path, "stateful")


@pytest.mark.slow
def test_a_plain_dataloader_with_distributed_sampler_and_workers_resumes_mid_epoch_bitwise(
        tmp_path):
    # Through kr.ResumableLoader; 2 worker processes, whose base seed the wrapper restores.
    assert_resumed_mid_epoch_bitwise(tmp_path, "resumable", workers=2)


def test_a_plain_dataloader_in_the_state_is_refused_naming_the_wrapper():
    loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2)
    with pytest.raises(CheckpointError, match=r"ResumableLoader\(loader\)"):
        TrainState({"data": loader})


class HandWrittenLoader:
    """The kind of resumable loader users wrote before: position saved, seed not."""

    def __init__(self) -> None:
        self.loader = torch.utils.data.DataLoader(list(range(8)), batch_size=2, shuffle=True)
        self.epoch = 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch}

    def load_state_dict(self, sd: dict) -> None:
        self.epoch = sd["epoch"]


def test_a_hand_written_loader_seeded_from_the_global_rng_is_warned_about(caplog):
    TrainState({"data": HandWrittenLoader()})
    assert "without its own generator" in caplog.text and "ResumableLoader" in caplog.text


def persistent_loader() -> ResumableLoader:
    """mnist's train loader, as the torch docs suggest seeding it: shuffled, one persistent
    worker, a generator of its own (which the RandomSampler made by shuffle=True shares)."""
    data = TensorDataset(torch.arange(24))
    return ResumableLoader(DataLoader(data, batch_size=4, shuffle=True, num_workers=1,
                                      persistent_workers=True,
                                      generator=torch.Generator().manual_seed(1)))


def test_a_persistent_worker_loader_resumed_in_a_later_epoch_repeats_its_batches_and_state():
    # Persistent workers draw their base seed at the loader's first pass only. A process
    # resumed in epoch 1 drew it from the restored generator, the sampler's too: that epoch
    # came in another order, and the saved generator differed by its position (2 of 5,056
    # bytes) in every checkpoint after.
    straight = persistent_loader()
    batches = [next(straight)[0] for _ in range(16)]          # 6 batches an epoch: into epoch 2
    first = persistent_loader()
    for _ in range(8):
        next(first)                                            # epoch 1, batch 2
    resumed = persistent_loader()
    resumed.load_state_dict(first.state_dict())
    assert_bitwise_equal(batches[8:], [next(resumed)[0] for _ in range(8)])
    assert_bitwise_equal(straight.state_dict(), resumed.state_dict())
