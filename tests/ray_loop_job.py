"""A driver-loop Ray job shaped like SkyRL's trainer, for tests/test_ray_loop.py.

The loop runs in the driver over a torchdata ``StatefulDataLoader``; each step draws noise from
the driver's RNG, runs ``asyncio.run`` of N rollout episodes (each holds a sandbox file in
WORK/resources, removed in its ``finally``), then a forward pass on a 1-actor reference group
and the update on a 2-actor policy group (gloo). Checkpoint every 10 steps (``--every``).
Rank 0 of the policy writes WORK/progress; each policy actor writes WORK/pids/policy.r<rank>
with its pid, the reference actor WORK/pids/ref.r0. At the end the driver saves the policy's weights and optimizer, the data
position, its counters and its RNG to --out.

``--parent``: under a parent that, like ``uv run``, dies on Ctrl+C and SIGTERMs the driver
0.2 s later. ``--supervise``: the training under ``krr.supervise_loop``; ``--spares N``: the
policy group's spare actors; ``--cold``: no actor parked, every recreation makes new ones.
Each train_step appends "<step> <time>" to WORK/steps.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import kempner_resilience.ray as krr


def _pidfile(work: Path, name: str) -> None:
    (work / "pids").mkdir(exist_ok=True)
    tmp = work / "pids" / f"{name}.tmp"
    tmp.write_text(str(os.getpid()))
    os.replace(tmp, work / "pids" / name)       # whole, for the test to read


class PolicyWorker(krr.Worker):
    def __init__(self, work: str) -> None:
        import torch

        torch.manual_seed(0)
        self.work = Path(work)
        self.model = torch.nn.Linear(8, 4)
        self.optim = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)

    def checkpoint_state(self):
        return {"model": self.model, "optim": self.optim}

    def train_step(self, step: int, x, reward: float, sleep_s: float) -> None:
        import torch
        import torch.distributed as dist

        _pidfile(self.work, f"policy.r{self.kr_rank}")
        shard = x[self.kr_rank::self.kr_world_size]
        self.optim.zero_grad()
        (self.model(shard).pow(2).mean() * reward).backward()
        time.sleep(sleep_s)
        for p in self.model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= self.kr_world_size
        self.optim.step()
        if self.kr_rank == 0:
            (self.work / "progress").write_text(str(step))
            with open(self.work / "steps", "a") as f:
                f.write(f"{step} {time.time():.4f}\n")

    def final(self) -> dict:
        return {"model": self.model.state_dict(), "optim": self.optim.state_dict()}


class RefWorker(krr.Worker):
    def __init__(self, work: str) -> None:
        import torch

        torch.manual_seed(1)
        self.work = Path(work)
        self.model = torch.nn.Linear(8, 4)

    def checkpoint_state(self):
        return {"model": self.model}

    def forward(self, x) -> float:
        import torch

        _pidfile(self.work, f"ref.r{self.kr_rank}")
        with torch.no_grad():
            return float(self.model(x).mean())


class Counters:
    def __init__(self) -> None:
        self.global_step = 0
        self.reward_sum = 0.0

    def state_dict(self) -> dict:
        return {"global_step": self.global_step, "reward_sum": self.reward_sum}

    def load_state_dict(self, sd: dict) -> None:
        self.global_step, self.reward_sum = sd["global_step"], sd["reward_sum"]


async def episode(work: Path, i: int, x) -> float:
    sandbox = work / "resources" / f"sandbox{i}"
    sandbox.write_text(str(os.getpid()))
    try:
        await asyncio.sleep(0.002)
        return float(x[i % len(x)].sum())
    finally:
        await asyncio.sleep(0)      # an async teardown, as a sandbox's would be
        sandbox.unlink()


async def generate(work: Path, n: int, x) -> list[float]:
    return await krr.supervise_tasks(episode(work, i, x) for i in range(n))


def train(a: argparse.Namespace) -> None:
    import torch
    from torchdata.stateful_dataloader import StatefulDataLoader

    work = Path(a.work)
    cfg = krr.load_config(overrides=[f"checkpoint.dir={a.ckpt}",
                                     f"checkpoint.every_steps={a.every}"])
    data = torch.arange(8 * 40, dtype=torch.float32).reshape(40, 8) / 100
    torch.manual_seed(3)        # the driver's RNG: the loader's order and the noise
    # Shuffled from the global RNG, which the checkpoint restores (a loader generator= of
    # its own resumes its epoch, not the next epoch's order: torchdata keeps no more of it).
    loader = StatefulDataLoader(torch.utils.data.TensorDataset(data), batch_size=4,
                                shuffle=True)
    counters = Counters()
    policy = krr.WorkerGroup(PolicyWorker, 2, str(work), options={"num_cpus": 0.5},
                             spares=a.spares, warm=not a.cold)
    ref = krr.WorkerGroup(RefWorker, 1, str(work), options={"num_cpus": 0.5}, warm=not a.cold)
    with krr.RayRun(cfg, state={"data": loader, "trainer": counters, "policy": policy,
                                "ref": ref}) as run:
        batches = iter(loader)
        for step in run.steps(a.steps):
            try:
                (x,) = next(batches)
            except StopIteration:                       # the next epoch
                batches = iter(loader)
                (x,) = next(batches)
            x = x + 0.01 * torch.randn(x.shape)          # the driver's RNG
            rewards = asyncio.run(generate(work, a.resources, x))
            reward = math.tanh(sum(rewards) / len(rewards) - ref.call("forward", x)[0])
            policy.call("train_step", step, x, reward, a.sleep)
            counters.global_step += 1
            counters.reward_sum += reward
        final = policy.call("final")[0]
    torch.save({"policy": final, "data": loader.state_dict(), "rng": torch.get_rng_state(),
                "counters": counters.state_dict()}, a.out)
    print("trained", flush=True)


def driver(a: argparse.Namespace) -> None:
    import ray

    (Path(a.work) / "resources").mkdir(parents=True, exist_ok=True)
    if os.environ.get("RAY_ADDRESS"):
        # The cluster the `ray` sbatch template started over the allocation.
        ray.init(runtime_env=krr.warm_runtime_env())
    else:
        ray.init(num_cpus=2, include_dashboard=False, runtime_env=krr.warm_runtime_env())
    try:
        if a.supervise:
            krr.supervise_loop(train, a)
        else:
            train(a)
    finally:
        ray.shutdown()


def parent(argv: list[str]) -> int:
    child = subprocess.Popen([sys.executable, __file__, *argv])
    told = []

    def die(signum: int, frame: object) -> None:
        if not told:            # a dying parent tells its child once, 0.2 s later
            told.append(signum)
            time.sleep(0.2)
            child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGINT, die)
    return child.wait()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--parent", action="store_true")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--resources", type=int, default=50)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--out", default="")
    p.add_argument("--supervise", action="store_true")
    p.add_argument("--spares", type=int, default=0)
    p.add_argument("--cold", action="store_true")
    a = p.parse_args()
    if a.parent:
        sys.exit(parent([x for x in sys.argv[1:] if x != "--parent"]))
    driver(a)


if __name__ == "__main__":
    main()
