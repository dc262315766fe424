"""A Lightning script written the library's documented way (a ``LightningModule``,
``Trainer.fit``), adopted in the marked lines. Rank 0 saves the final model, optimizer,
scheduler and RNG to --out; each step is a line in --progress (``rank R step S``). Config:
$KEMPNER_RESILIENCE_CONFIG. Launched by ``kempner-resilience torchrun --nproc-per-node 2``."""

import argparse
import os
import sys
import time

PLAIN = "--plain" in sys.argv       # the script as it was before (bench/trainers_bench.py)
if not PLAIN:
    import kempner_resilience as kr                                      # first, before torch
    from kempner_resilience.trainers.lightning import ResilientCallback  # marked
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=40)
ap.add_argument("--out")
ap.add_argument("--progress")
ap.add_argument("--step-s", type=float, default=0.05)
ap.add_argument("--hold", help="at --hold-at, wait while this file exists (at most 300 s)")
ap.add_argument("--hold-at", type=int, default=8)
ap.add_argument("--iterable", action="store_true",
                help="the batches from an IterableDataset: no index to resume mid-epoch at")
ap.add_argument("--plain", action="store_true", help="without the package: Lightning alone")
ap.add_argument("--times", help="rank 0 appends each step's end (time.perf_counter) here")
args = ap.parse_args()


class Tiny(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 1))
        self.progress = open(args.progress, "a", buffering=1) if args.progress else None
        self.times = None

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        time.sleep(args.step_s)
        if self.progress:
            self.progress.write(f"rank {self.global_rank} step {self.global_step}\n")
        if args.hold and self.global_step == args.hold_at:
            if self.progress:
                self.progress.write(f"rank {self.global_rank} holds at {self.global_step} "
                                    f"pid {os.getpid()}\n")
            deadline = time.monotonic() + 300
            while os.path.exists(args.hold) and time.monotonic() < deadline:
                time.sleep(0.05)
        if args.times and self.global_rank == 0:
            self.times = self.times or open(args.times, "a", buffering=1)
            self.times.write(f"{time.perf_counter()}\n")
        return loss

    def configure_optimizers(self):
        optim = torch.optim.AdamW(self.parameters(), lr=1e-2)
        sched = torch.optim.lr_scheduler.StepLR(optim, step_size=7, gamma=0.5)
        return {"optimizer": optim, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


pl.seed_everything(0, verbose=False)
data = TensorDataset(torch.randn(256, 16), torch.randn(256, 1))
loader = DataLoader(data, batch_size=8, shuffle=True)
if args.iterable:
    class Stream(IterableDataset):
        def __iter__(self):
            return iter(data)

    loader = DataLoader(Stream(), batch_size=8)
model = Tiny()
trainer = pl.Trainer(accelerator="cpu", strategy="ddp", devices=2, max_steps=args.steps,
                     callbacks=[] if PLAIN else [ResilientCallback(None)],  # marked
                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)
trainer.fit(model, loader)

if trainer.is_global_zero and args.out:
    torch.save({"model": model.state_dict(), "optim": trainer.optimizers[0].state_dict(),
                "sched": trainer.lr_scheduler_configs[0].scheduler.state_dict(),
                "rng": torch.get_rng_state()}, args.out)
