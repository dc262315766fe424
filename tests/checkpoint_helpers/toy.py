"""A tiny training setup whose every source of state must survive a checkpoint: dropout (torch
RNG), Adam, an LR scheduler, a shuffling data iterator with its own position, and noise from
python ``random`` and numpy's global RNG."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import nn


class ShuffledData:
    """Seeded, shuffling, resumable iterator over a synthetic regression set (one shard per rank)."""

    def __init__(self, seed: int, rank: int = 0, n: int = 64, batch: int = 8) -> None:
        g = torch.Generator().manual_seed(1234 + rank)
        self.x = torch.randn(n, 16, generator=g)
        self.y = torch.randn(n, 4, generator=g)
        self.seed, self.batch, self.epoch, self.pos = seed + rank, batch, 0, 0
        self._order = self._perm()

    def _perm(self) -> torch.Tensor:
        return torch.randperm(len(self.x), generator=torch.Generator().manual_seed(
            self.seed * 1000 + self.epoch))

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.pos + self.batch > len(self.x):
            self.epoch, self.pos = self.epoch + 1, 0
            self._order = self._perm()
        idx = self._order[self.pos:self.pos + self.batch]
        self.pos += self.batch
        return self.x[idx], self.y[idx]

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.epoch, self.pos, self.seed = sd["epoch"], sd["pos"], sd["seed"]
        self._order = self._perm()


def build(rank: int = 0, ddp: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)                      # same initial weights on every rank
    model: nn.Module = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3),
                                     nn.Linear(32, 4))
    if ddp:
        model = nn.parallel.DistributedDataParallel(model)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=3, gamma=0.5)
    seed_all(rank)
    return {"model": model, "optim": optim, "sched": sched, "data": ShuffledData(7, rank)}


def seed_all(rank: int) -> None:
    torch.manual_seed(100 + rank)             # dropout masks differ per rank
    random.seed(200 + rank)
    np.random.seed(300 + rank)


def train_step(state: dict[str, Any]) -> None:
    x, y = state["data"].next()
    x = x + 0.01 * random.random() + 0.01 * float(np.random.rand())
    loss = ((state["model"](x) - y) ** 2).mean()
    state["optim"].zero_grad()
    loss.backward()
    state["optim"].step()
    state["sched"].step()


def snapshot(state: dict[str, Any]) -> dict[str, Any]:
    """Everything that must match bitwise between a straight and a resumed run."""
    model = state["model"]
    model = getattr(model, "module", model)
    return {"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optim": state["optim"].state_dict(), "sched": state["sched"].state_dict(),
            "data": state["data"].state_dict(), "torch_rng": torch.get_rng_state(),
            "py_rng": random.random(), "np_rng": float(np.random.rand())}
