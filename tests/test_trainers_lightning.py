"""PyTorch Lightning under `kempner-resilience torchrun`: a script written Lightning's
documented way (a ``LightningModule``, ``Trainer.fit`` with the DDP strategy), adopted with a
``ResilientCallback``, on two gloo ranks that Lightning takes from torchelastic's environment.
Signals go where a user's go: USR1 and SIGTERM to the launcher (what ``--signal=B:USR1`` and a
preemption send), Ctrl+C to its whole process group (a terminal). One uninterrupted run is the
reference for the module.
"""

from __future__ import annotations

import sys

import pytest

from helpers import require
from trainers_helpers import (SCRIPTS, assert_same_final, committed_steps, interrupt,
                              kill_held, last_steps, run_to_end, signal, write_config)
from kempner_resilience.exitcodes import ExitCode

require("pytorch_lightning")

STEPS = 40        # 16 batches an epoch on each rank: the stops fall mid-epoch


def _launch(work, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kempner_resilience.cli", "torchrun", "--standalone",
            "--nproc-per-node=2", str(SCRIPTS / "lightning_train.py"), "--steps", str(STEPS),
            "--out", str(work / "final.pt"), "--progress", str(work / "progress"), *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    work = tmp_path_factory.mktemp("lightning_reference")
    code, out = run_to_end(work, _launch(work, "--step-s", "0"))
    assert code == 0, out[-4000:]
    return work / "final.pt"


def test_sigterm_ctrl_c_and_usr1_each_stop_every_rank_at_one_step_with_its_code_and_fit_resumes_bitwise(
        tmp_path, reference):
    cmd = _launch(tmp_path)
    stops = [(6, signal.SIGTERM, False, 143), (17, signal.SIGINT, True, 130),
             (29, signal.SIGUSR1, False, int(ExitCode.REQUEUE))]
    for at, signum, group, expected in stops:
        code, out = interrupt(tmp_path, cmd, at, signum, group)
        assert code == expected, out[-4000:]
        last = last_steps(tmp_path / "progress")
        assert last[0] == last[1], last                          # one step on every rank
        assert committed_steps(tmp_path)[-1] == last[0] + 1, out[-4000:]
        assert "Traceback" not in out, out[-4000:]
        assert not (tmp_path / "final.pt").exists()    # the code after fit never ran
        assert not list(tmp_path.rglob("hpc_ckpt_*.ckpt"))       # Lightning saved nothing
    code, out = run_to_end(tmp_path, cmd)
    assert code == 0, out[-4000:]
    assert "resumed from" in out
    assert "not resumable" not in out     # Lightning sees a loader that resumes mid-epoch
    assert_same_final(reference, tmp_path / "final.pt")


def test_a_rank_sigkilled_inside_a_step_is_not_rescued_and_the_relaunch_resumes_the_last_commit_bitwise(
        tmp_path, reference):
    from kempner_resilience.checkpoint import layout
    from kempner_resilience.core.runpaths import RunPaths

    write_config(tmp_path, every_steps=5)
    cmd = _launch(tmp_path, "--step-s", "0")        # the hold, not the step time, times the kill
    # Rank 1 dies in training_step 12. Lightning runs it inside optimizer.step(closure), so
    # rank 0's gradient all-reduce fails inside an optimizer step: the rescue, which writes
    # only a boundary's state, declines (docs/trainers.md), and nothing is written for it.
    code, out = kill_held(tmp_path, cmd, 12)
    assert code == int(ExitCode.PEER_LOST), out[-4000:]
    assert "rescue skipped: an optimizer step was in progress" in out, out[-4000:]
    [*_, newest] = [e for e in layout.scan(RunPaths(tmp_path / "ckpt")) if e.committed]
    assert newest.step == 10
    layout.verify_entry(newest)                  # the resume point, whole, byte for byte
    assert not (tmp_path / "ckpt" / "step_000000012").exists()
    code, out = run_to_end(tmp_path, cmd)
    assert code == 0, out[-4000:]
    assert "(step 10, reason periodic)" in out, out[-4000:]
    assert_same_final(reference, tmp_path / "final.pt")


def _tiny_fit(tmp_path, loader, resilient: bool = True, **fit_kwargs):
    """``Trainer.fit`` in this process on one CPU device, with a ResilientCallback whose
    checkpoints go to ``tmp_path/ckpt`` (or none); the trainer."""
    import pytorch_lightning as pl
    import torch

    from kempner_resilience.trainers.lightning import ResilientCallback

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    cb = ResilientCallback({"checkpoint": {"dir": str(tmp_path / "ckpt")}}, exit_mode="raise")
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=2,
                         callbacks=[cb] if resilient else [],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=tmp_path)
    trainer.fit(Tiny(), loader, **fit_kwargs)
    return trainer


def test_fit_with_a_ckpt_path_is_refused_naming_it_before_anything_is_written(tmp_path):
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)
    _tiny_fit(tmp_path, loader, resilient=False).save_checkpoint(tmp_path / "last.ckpt")
    with pytest.raises(ValueError, match="leave ckpt_path out"):
        _tiny_fit(tmp_path, loader, ckpt_path=str(tmp_path / "last.ckpt"))
    assert not (tmp_path / "ckpt").exists()


def test_an_iterable_train_dataset_is_refused_naming_the_fix_before_anything_is_written(
        tmp_path):
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    class Stream(IterableDataset):
        def __iter__(self):
            return iter([(torch.randn(4),) for _ in range(8)])

    with pytest.raises(ValueError, match="StatefulDataLoader"):
        _tiny_fit(tmp_path, DataLoader(Stream(), batch_size=2))
    assert not (tmp_path / "ckpt").exists()


def test_a_checkpoint_at_an_epoch_s_last_batch_resumes_at_the_next_epoch_s_first_batch_bitwise(
        tmp_path):
    """Lightning resumes a save at the epoch's last batch as the next epoch's start: the loader
    must not skip that next epoch's batches (a shuffled loader, 4 batches an epoch, the
    checkpoint at step 4, the resumed fit ends where a straight one does)."""
    import pytorch_lightning as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from kempner_resilience.trainers.lightning import ResilientCallback

    class Crash(Exception):
        pass

    class Tiny(pl.LightningModule):
        def __init__(self, crash_at: int | None) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.2),
                                           torch.nn.Linear(8, 1))
            self.crash_at = crash_at

        def training_step(self, batch, batch_idx):
            if self.global_step == self.crash_at:
                raise Crash()
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.05)

    def fit(work, crash_at=None):
        work.mkdir(exist_ok=True)
        torch.manual_seed(0)
        data = TensorDataset(torch.randn(8, 4))
        model = Tiny(crash_at)
        cfg = {"checkpoint": {"dir": str(work / "ckpt"), "every_steps": 4},
               "watchdog": {"hang_timeout_s": 0}}
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=10,
                             callbacks=[ResilientCallback(cfg, exit_mode="raise")],
                             logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False,
                             default_root_dir=work)
        trainer.fit(model, DataLoader(data, batch_size=2, shuffle=True))
        return model.net.state_dict()

    straight = fit(tmp_path / "straight")
    with pytest.raises(Crash):
        fit(tmp_path / "resumed", crash_at=5)
    assert committed_steps(tmp_path / "resumed")[-1] == 4      # the epoch's last batch
    resumed = fit(tmp_path / "resumed")
    for k in straight:
        assert torch.equal(straight[k], resumed[k]), k


def test_the_loop_state_in_each_step_snapshot_is_lightnings_own_fit_loop_state(tmp_path):
    import pytorch_lightning as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from kempner_resilience.rescue.boundary import decode, encode
    from kempner_resilience.trainers.lightning import LoaderPosition, _Loops

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    seen: list[tuple[dict, dict]] = []

    class Compare(pl.Callback):
        def on_fit_start(self, trainer, pl_module):
            trainer.fit_loop.setup_data()
            LoaderPosition(trainer.fit_loop._combined_loader.flattened[0], trainer)
            iter(trainer.fit_loop._data_fetcher)
            self.loops = _Loops(trainer)

        def on_train_batch_end(self, trainer, *args):
            snapshot = decode(encode(0, {"loops": self.loops}))["objects"]["loops"]
            lightnings = trainer.fit_loop.state_dict()
            seen.append((self.loops.state_dict(), lightnings))
            seen.append((snapshot, lightnings))         # what the rescue writes

    loader = DataLoader(TensorDataset(torch.randn(24, 4), torch.randn(24, 1)), batch_size=4,
                        shuffle=True)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=9, callbacks=[Compare()],
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(Tiny(), loader)

    def same(a, b) -> bool:
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and torch.equal(a, b)
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k])
                                                                        for k in a)
        if isinstance(a, (list, tuple)):
            return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
        return type(a) is type(b) and a == b

    assert len(seen) == 2 * 9                # over an epoch's end (6 batches an epoch)
    assert all(same(ours, lightnings) for ours, lightnings in seen)
    assert any(ours["state_dict"].get("combined_loader") for ours, _ in seen)   # the position
