"""Per-step cost of watching for gradient-accumulation windows (checkpoint/carried.py): the
post-step hook that notes each gradient's tensor and version after ``optimizer.step()``, against
the same optimizer step without it, in the same process; and the check a save (or a stop) runs.

    python bench/carried_bench.py [--layers 100] [--width 64] [--steps 300]

Prints the hook's cost per step in microseconds and per parameter tensor, the step time with
and without it, and the pending-gradient check's time.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from kempner_resilience.checkpoint.carried import PendingGrads


def timed_steps(model: nn.Module, optim: torch.optim.Optimizer, steps: int) -> list[float]:
    x = torch.randn(8, model[0].in_features)
    out = []
    for _ in range(steps):
        model(x).sum().backward()
        t0 = time.perf_counter()
        optim.step()
        out.append(time.perf_counter() - t0)
        optim.zero_grad()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=100)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = nn.Sequential(*[nn.Linear(args.width, args.width) for _ in range(args.layers)])
    params = len(list(model.parameters()))
    plain = torch.optim.SGD(model.parameters(), lr=1e-6)
    watched = torch.optim.SGD(model.parameters(), lr=1e-6)
    grads = PendingGrads({"optim": watched})
    base, hooked = [], []
    for _ in range(3):                      # alternate, so both see the same machine load
        base += timed_steps(model, plain, args.steps)
        hooked += timed_steps(model, watched, args.steps)
    b, h = statistics.median(base), statistics.median(hooked)
    model(torch.randn(8, args.width)).sum().backward()    # a window's first micro-batch
    t0 = time.perf_counter()
    pending = grads.pending()
    check = time.perf_counter() - t0
    print(f"{params} parameter tensors: optimizer.step() {b * 1e6:.0f} us plain, "
          f"{h * 1e6:.0f} us with the hook: +{(h - b) * 1e6:.0f} us per step "
          f"({(h - b) * 1e9 / params:.0f} ns per tensor); pending check at a save "
          f"{check * 1e6:.0f} us ({len(pending.get('optim', {}))} pending)")


if __name__ == "__main__":
    main()
