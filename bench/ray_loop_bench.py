"""The per-step cost of adopting the Ray driver-loop shape (``kempner_resilience.ray``): the
same driver loop over a 2-actor worker group whose step takes ``--step-ms`` (a stand-in for
the forward passes and the update), plain (``ray.get`` on the actors' calls) and adopted
(``RayRun``, ``run.steps``, ``WorkerGroup.call``), in one run of the bench. Target: at most 1 %
with a 50 ms step.

    python bench/ray_loop_bench.py [--steps 200] [--step-ms 50] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import kempner_resilience.ray as krr  # noqa: E402


class Stepper(krr.Worker):
    def __init__(self) -> None:
        import torch

        self.model = torch.nn.Linear(4, 4)

    def checkpoint_state(self):
        return {"model": self.model}

    def step(self, ms: float) -> int:
        time.sleep(ms / 1000.0)
        return 0


def plain(ray, steps: int, ms: float) -> float:
    actors = [ray.remote(num_cpus=0)(Stepper).remote() for _ in range(2)]
    ray.get([a.step.remote(0) for a in actors])          # started
    t0 = time.perf_counter()
    for _ in range(steps):
        ray.get([a.step.remote(ms) for a in actors])
    took = (time.perf_counter() - t0) / steps
    for a in actors:
        ray.kill(a)
    return took


def adopted(steps: int, ms: float) -> float:
    with tempfile.TemporaryDirectory(prefix="kr-ray-bench-") as tmp:
        cfg = krr.load_config(overrides=[f"checkpoint.dir={tmp}"])
        group = krr.WorkerGroup(Stepper, 2, options={"num_cpus": 0})
        with krr.RayRun(cfg, state={"group": group}) as run:
            group.call("step", 0)
            t0 = time.perf_counter()
            for _ in run.steps(steps):
                group.call("step", ms)
            return (time.perf_counter() - t0) / steps


def main() -> None:
    import ray

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows = []
    for _ in range(a.rounds):      # interleaved: the same load for both
        base, ours = plain(ray, a.steps, a.step_ms), adopted(a.steps, a.step_ms)
        rows.append((base, ours))
        print(f"plain {base * 1e3:.2f} ms/step, adopted {ours * 1e3:.2f} ms/step, "
              f"{(ours / base - 1) * 100:+.2f} %", flush=True)
    ratio = statistics.median(o / b for b, o in rows)
    print(f"\nmedian per-step cost of the adoption: {(ratio - 1) * 100:+.2f} % "
          f"({a.step_ms:.0f} ms step, {a.rounds} rounds of {a.steps} steps)")
    ray.shutdown()


if __name__ == "__main__":
    main()
