"""A SkyRL-shaped Ray job for tests/test_ray.py (docs/ray.md shows the same shape).

A driver, 2 training actors in one gloo group (each a rank of one ResilientRun), and an asyncio
rollout actor whose N episodes each hold a stand-in external resource (a file in WORK/resources,
created when the episode starts and removed in its ``finally``). Every actor writes
WORK/finally.<name> from its own ``finally``; rank 0 writes WORK/progress (the last step) and,
when the training completes, the model's weights to --out.

The plain job uses the names of the earlier shape (``RayDriver.get``, the actors' ``address`` and
``init_group``, ``stop_context(board)``, the config shipped by the script). ``--supervise`` is
docs/ray.md's actor-loop shape through ``kempner_resilience.ray`` in its five names: the driver's
``run_group`` forms the group, hands it the config, and brings it back when an actor is lost
(``ray_supervise``). Each training call writes WORK/pids/r<rank>.<pid> when it starts; its
``finally`` records whether its process group was destroyed. The rollout's call writes
WORK/pids/rollout.<pid>. ``--post-step STEP``: rank 1 has a long post-step phase (a weight
sync, an eval) after STEP's all-reduce, once per job: it writes WORK/post-step when it begins.

``--parent`` runs the driver under a parent that, like ``uv run``, dies on Ctrl+C and sends its
child SIGTERM (once: it is dead after); it exits with the driver's code.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import kempner_resilience as kr
import kempner_resilience.ray as krr
from kempner_resilience.supervise.ray.actor import TrainingActor
from kempner_resilience.supervise.ray.aio import AsyncActor, supervise_tasks
from kempner_resilience.supervise.ray.driver import RayDriver


def _loop(run, model, optim, work: str, steps: int, sleep_s: float, out: str,
          post_step: int = 0) -> None:
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    for step in run.steps(steps):
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(step * 1000 + rank))
        optim.zero_grad()
        model(x).pow(2).mean().backward()
        time.sleep(sleep_s)    # the step's compute: most of a real step
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        optim.step()
        if rank == 0:
            Path(work, "progress").write_text(str(step))
        marker = Path(work, "post-step")
        if post_step and rank == 1 and step == post_step and not marker.exists():
            marker.write_text(str(step))
            time.sleep(60)     # a weight sync, an eval: past the all-reduce, before the boundary
    if rank == 0 and out:
        torch.save(model.state_dict(), out)


def _started(work: str) -> tuple:
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    Path(work, "pids").mkdir(exist_ok=True)
    Path(work, "pids", f"r{rank}.{os.getpid()}").write_text("")
    Path(work, "pids", f"host.r{rank}").write_text(socket.gethostname())
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    return rank, model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _ended(work: str, rank: int, run=None) -> None:
    import torch.distributed as dist

    group = "group live" if dist.is_initialized() else "group destroyed"
    Path(work, f"finally.trainer{rank}").write_text(group)
    Path(work, "pids", f"r{rank}.{os.getpid()}").write_text(group)
    if run is not None:   # where this actor's run ended, read by the tests from the disk: Ray
        # forwards an actor's last log lines late, or not at all once the driver shuts Ray down
        Path(work, "steps").mkdir(exist_ok=True)
        Path(work, "steps", f"r{rank}.{os.getpid()}").write_text(str(run.step))


class Trainer(TrainingActor):
    """The earlier shape: the script ships the config and the board, and forms the group."""

    def train(self, board, ckpt: str, work: str, steps: int, sleep_s: float, out: str) -> dict:
        rank, model, optim = _started(work)
        cfg = kr.load_config(overrides=[f"checkpoint.dir={ckpt}",
                                        "checkpoint.every_steps=100000"])
        run = None
        try:
            with self.stop_context(board) as ending:
                with kr.ResilientRun(cfg, state={"model": model, "optim": optim}) as run:
                    _loop(run, model, optim, work, steps, sleep_s, out)
            return {"rank": rank, "code": ending.code, "step": run.step if run else None,
                    "ending": ending}
        finally:
            _ended(work, rank)


class GroupTrainer(krr.TrainingActor):
    """docs/ray.md's actor-loop shape: the driver formed the group and handed the config."""

    def train(self, work: str, steps: int, sleep_s: float, out: str, post_step: int) -> dict:
        rank, model, optim = _started(work)
        run = None
        try:
            with self.resilient_run(state={"model": model, "optim": optim}) as run:
                _loop(run, model, optim, work, steps, sleep_s, out, post_step)
            return {"rank": rank, "step": run.step if run else None}
        finally:
            _ended(work, rank, run)


class Rollout(AsyncActor):
    async def run(self, work: str, n: int, fail_at_step: int) -> list:
        Path(work, "pids").mkdir(exist_ok=True)
        Path(work, "pids", f"rollout.{os.getpid()}").write_text("")
        try:
            return await self.main(supervise_tasks(self._episode(Path(work), i, fail_at_step)
                                             for i in range(n)))
        finally:
            Path(work, "finally.rollout").write_text("ran")

    async def _episode(self, work: Path, i: int, fail_at_step: int) -> None:
        resource = work / "resources" / f"sandbox{i}"
        resource.write_text(str(os.getpid()))
        try:
            while True:
                await asyncio.sleep(0.05)
                if i == 7 and fail_at_step and _progress(work) >= fail_at_step:
                    raise RuntimeError("episode 7 failed")
        finally:
            await asyncio.sleep(0.01)   # an async teardown, as a sandbox's would be
            resource.unlink()


def _progress(work: Path) -> int:
    try:
        return int((work / "progress").read_text())
    except (OSError, ValueError):
        return -1


def driver(a: argparse.Namespace) -> None:
    import ray

    work = Path(a.work)
    (work / "resources").mkdir(parents=True, exist_ok=True)
    if os.environ.get("RAY_ADDRESS"):
        # The cluster the `ray` sbatch template started over the allocation.
        ray.init(runtime_env=krr.warm_runtime_env())
    else:
        ray.init(num_cpus=2, include_dashboard=False, runtime_env=krr.warm_runtime_env())
    remote_trainer = ray.remote(num_cpus=1)(Trainer)
    remote_rollout = ray.remote(num_cpus=0)(Rollout)
    if a.supervise:
        supervised(a, work, remote_rollout)
        return
    with RayDriver(kr.load_config()) as drv:
        trainers = drv.track(*[remote_trainer.remote() for _ in range(2)])
        rollout = drv.track(remote_rollout.remote())[0]
        addr, port = ray.get(trainers[0].address.remote())
        ray.get([t.init_group.remote(r, 2, addr, port) for r, t in enumerate(trainers)])
        episodes = rollout.run.remote(str(work), a.resources, a.fail_at_step)
        out = drv.get([t.train.remote(drv.board, a.ckpt, str(work), a.steps, a.sleep, a.out)
                       for t in trainers], cancel=[episodes])
        print("trained", out, flush=True)
    ray.shutdown()


def supervised(a: argparse.Namespace, work: Path, remote_rollout) -> None:
    import ray

    cfg = krr.load_config(overrides=[f"checkpoint.dir={a.ckpt}",
                                     f"checkpoint.every_steps={a.every}"])
    with krr.RayDriver(cfg) as drv:
        rollout = drv.track(remote_rollout.remote())[0]
        episodes = rollout.run.remote(str(work), a.resources, a.fail_at_step)
        out = drv.run_group(GroupTrainer, 2, "train", str(work), a.steps, a.sleep, a.out,
                            a.post_step, cancel=[episodes], warm=a.warm)
        print("trained", [o["step"] for o in out], flush=True)
    ray.shutdown()


def parent(argv: list[str]) -> int:
    child = subprocess.Popen([sys.executable, __file__, *argv])
    told = []

    def die(signum: int, frame: object) -> None:
        if not told:    # a dying parent tells its child once
            told.append(signum)
            child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGINT, die)
    return child.wait()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--parent", action="store_true")
    p.add_argument("--ckpt", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--sleep", type=float, default=0.1)
    p.add_argument("--resources", type=int, default=50)
    p.add_argument("--fail-at-step", type=int, default=0, help="episode 7 raises once rank 0 "
                   "passed this step")
    p.add_argument("--out", default="")
    p.add_argument("--every", type=int, default=100000, help="checkpoint.every_steps")
    p.add_argument("--supervise", action="store_true", help="the five-name shape: run_group")
    p.add_argument("--warm", action="store_true", help="run_group(warm=True) (--supervise)")
    p.add_argument("--post-step", type=int, default=0, help="rank 1's long post-step phase "
                   "after this step (--supervise)")
    a = p.parse_args()
    if a.parent:
        sys.exit(parent([x for x in sys.argv[1:] if x != "--parent"]))
    driver(a)


if __name__ == "__main__":
    main()
