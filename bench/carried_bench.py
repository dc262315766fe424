"""Per-step cost of watching for gradient-accumulation windows (checkpoint/carried.py): the
post-step hook ``PendingGrads`` puts on every optimizer of the state, against the same
optimizer step without it (bare), in the same process; and the check a save (or a stop) runs.

The hook runs at every training step. Before, it noted every gradient's
tensor and version, O(parameter tensors); now it notes ``carried.SENTINELS`` gradients, O(1).
The old hook is reproduced here (``EveryGradient``) so that one run shows both:

    python bench/carried_bench.py [--tensors 200 800] [--steps 300] [--rounds 3] [--optim sgd adam]

For each model size (Linear layers of ``--width``, 2 tensors each) it prints the median
``optimizer.step()`` time bare (plain SGD by default: the cheapest step, so the largest ratio;
``--optim adam`` too), each hook's own cost per call (the fastest of 10 batches of 200 calls, so
that the load of a shared machine drops out) in microseconds and as a ratio to the bare step,
the step-time ratio with each hook (noisier: interleaved medians), and the pending check's time
(which runs at a save or a stop decision, not at every step).
"""

from __future__ import annotations

import argparse
import statistics
import time
import weakref
from typing import Any

import torch
from torch import nn

from kempner_resilience.checkpoint.carried import PendingGrads
from kempner_resilience.core.torch_private import tensor_version


class EveryGradient:
    """The hook as it was: after each step, every gradient's tensor (weakly) and version."""

    def __init__(self, optim: torch.optim.Optimizer) -> None:
        self.applied: list[Any] = []
        optim.register_step_post_hook(self._stepped)

    def _stepped(self, optim: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.applied = [None if p.grad is None else (weakref.ref(p.grad), tensor_version(p.grad))
                        for g in optim.param_groups for p in g["params"]]


def timed_steps(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor,
                steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        optim.zero_grad()
        model(x).sum().backward()
        t0 = time.perf_counter()
        optim.step()
        out.append(time.perf_counter() - t0)
    return out


def hook_cost(hook: Any, optim: torch.optim.Optimizer, calls: int, batches: int) -> float:
    """Seconds per call of the post-step ``hook`` alone (the gradients as a step left them):
    the fastest of ``batches`` batches, so that other load on the machine drops out."""
    best = float("inf")
    for _ in range(batches):
        t0 = time.perf_counter()
        for _ in range(calls):
            hook(optim, (), {})
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def measure(tensors: int, width: int, steps: int, rounds: int, optim_name: str) -> None:
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(tensors // 2)])
    make = {"sgd": lambda: torch.optim.SGD(model.parameters(), lr=1e-6),
            "adam": lambda: torch.optim.Adam(model.parameters(), lr=1e-6)}[optim_name]
    bare, before, now = make(), make(), make()
    old = EveryGradient(before)
    grads = PendingGrads({"optim": now})
    x = torch.randn(8, width)
    times: dict[str, list[float]] = {"bare": [], "before": [], "now": []}
    for _ in range(rounds):                 # interleaved: all three see the same machine load
        for name, optim in (("bare", bare), ("before", before), ("now", now)):
            times[name] += timed_steps(model, optim, x, steps)
    med = {k: statistics.median(v) for k, v in times.items()}
    # The hooks alone, on the gradients a finished step left (what they see at every step).
    hooks = {"before": hook_cost(old._stepped, before, 200, 10),
             "now": hook_cost(grads._stepped, now, 200, 10)}
    model(x).sum().backward()                           # a window's first micro-batch
    t0 = time.perf_counter()
    pending = grads.pending()
    check = time.perf_counter() - t0

    def cost(name: str) -> str:
        return (f"{hooks[name] * 1e6:.1f} us = {hooks[name] / med['bare']:.4f}x the bare step "
                f"(step with it {med[name] / med['bare']:.3f}x)")

    print(f"{tensors} tensors, {optim_name}: bare step {med['bare'] * 1e6:.0f} us (median); "
          f"hook before {cost('before')}; hook now {cost('now')}; pending check at a save "
          f"{check * 1e6:.0f} us ({len(pending.get('optim', {}))} pending)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tensors", type=int, nargs="+", default=[200, 800])
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--optim", choices=["sgd", "adam"], nargs="+", default=["sgd"])
    args = ap.parse_args()
    torch.set_num_threads(1)
    for optim_name in args.optim:
        for n in args.tensors:
            measure(n, args.width, args.steps, args.rounds, optim_name)


if __name__ == "__main__":
    main()
