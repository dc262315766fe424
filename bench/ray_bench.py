"""Ray: Ctrl+C → every process of the job gone, and the package's per-step cost.

    .venv/bin/python bench/ray_bench.py [--rounds 3] [--steps 200] [--dir /tmp/raybench]
    .venv/bin/python bench/ray_bench.py --only ctrl-c       # or: --only steps

``ctrl-c``: each round runs tests/ray_job.py (the SkyRL-shaped job: a driver, 2 training actors
in one gloo group, an asyncio rollout actor holding 50 stand-in resources) in a session of its
own, under a parent that SIGTERMs the driver when it dies on Ctrl+C (as ``uv run`` does). Every
process of the round carries a tag in its environment (Ray's GCS, raylet, agents and workers
inherit the driver's), so "gone" is a scan of /proc. Once rank 0 is past step 8 and the 50
resources are held, SIGINT goes to the process group; the bench times from it to the driver's
exit (``exit``) and to the last tagged process gone (``all gone``), and counts the tagged
processes still there 30 s after the exit (``left``: must be 0) and the resources left.

``steps``: the same small Ray training (2 actors, a gloo group among them, a Linear(64, 64),
``--steps`` steps of forward, backward, an all-reduce of the gradients and SGD) with and
without the package (``RayDriver`` + ``TrainingActor.stop_context`` + ``ResilientRun`` /
``run.steps``, default config, a checkpoint directory of its own, no periodic save), in one Ray
session, the two kinds interleaved round by round (alternating which goes first). Each round
creates fresh actors (a run's teardown destroys its group). A step's time is rank 0's
``perf_counter`` between consecutive iterations (the package's per-step work, in ``run.steps``,
is inside it); the first 10 steps are dropped. Reported: each kind's median step time over all
rounds and the ratio with/without. ``--sleep`` adds a stand-in compute per step.

The load average (1 min) is printed: other jobs on the machine skew the figures.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent
JOB = HERE.parent / "tests" / "ray_job.py"
WARMUP = 10


# ------------------------------------------------------------------ Ctrl+C → all gone

def _tagged(tag: str) -> list[int]:
    needle = f"KR_RAY_BENCH_TAG={tag}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if needle in Path(f"/proc/{pid}/environ").read_bytes():
                stat = Path(f"/proc/{pid}/stat").read_text()
                if not stat.split(") ")[1].startswith("Z"):
                    found.append(int(pid))
        except OSError:
            continue
    return found


def _progress(work: Path) -> int:
    try:
        return int((work / "progress").read_text())
    except (OSError, ValueError):
        return -1


def ctrl_c_round(root: Path) -> dict:
    """One job stopped by Ctrl+C: seconds to the driver's exit and to every process gone."""
    work = root / f"work-{uuid.uuid4().hex[:6]}"
    work.mkdir(parents=True)
    tag = uuid.uuid4().hex
    env = {**os.environ, "KR_RAY_BENCH_TAG": tag, "RAY_DEDUP_LOGS": "0"}
    env.pop("RANK", None)
    log = open(work / "driver.log", "wb")
    proc = subprocess.Popen([sys.executable, str(JOB), "--parent", "--ckpt", str(work / "ckpt"),
                             "--work", str(work), "--steps", "100000"], stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True,
                            stdin=subprocess.DEVNULL)
    until = time.monotonic() + 120
    while _progress(work) < 8 or len(list((work / "resources").glob("sandbox*"))) < 50:
        if proc.poll() is not None or time.monotonic() > until:
            raise RuntimeError(f"the job never trained: {(work / 'driver.log').read_text()}")
        time.sleep(0.1)
    seen = len(_tagged(tag))
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    code = proc.wait(timeout=120)
    exited = time.monotonic() - sent
    until = time.monotonic() + 30
    gone = None
    while time.monotonic() < until:
        if not _tagged(tag):
            gone = time.monotonic() - sent
            break
        time.sleep(0.02)
    left = _tagged(tag)
    for pid in left:         # leave the machine clean for the next round
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return {"code": code, "processes": seen, "exit": exited, "gone": gone, "left": len(left),
            "resources": len(list((work / "resources").glob("sandbox*")))}


# ------------------------------------------------------------------ per-step cost

class PlainTrainer:
    """Ray actor without the package: the group and the loop as a Ray script has them."""

    def address(self) -> tuple[str, int]:
        import socket

        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            return ray.util.get_node_ip_address(), int(s.getsockname()[1])

    def init_group(self, rank: int, world: int, addr: str, port: int) -> None:
        import datetime

        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=120))

    def train(self, board: object, ckpt: str, steps: int, sleep_s: float) -> list[float]:
        import torch.distributed as dist

        model, optim = _model()
        stamps = []
        for step in range(steps):
            stamps.append(time.perf_counter())
            _step(model, optim, step, sleep_s)
        dist.destroy_process_group()
        return stamps


def _model():
    import torch

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def _step(model, optim, step: int, sleep_s: float) -> None:
    import torch
    import torch.distributed as dist

    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step))
    optim.zero_grad()
    model(x).pow(2).mean().backward()
    if sleep_s:
        time.sleep(sleep_s)
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    optim.step()


def _kr_trainer():
    from kempner_resilience.supervise.ray.actor import TrainingActor

    class KrTrainer(TrainingActor):
        """The same loop inside the package: stop_context, ResilientRun, run.steps."""

        def train(self, board: object, ckpt: str, steps: int, sleep_s: float) -> list[float]:
            import kempner_resilience as kr

            model, optim = _model()
            cfg = kr.load_config(overrides=[f"checkpoint.dir={ckpt}"])
            stamps = []
            with self.stop_context(board):
                with kr.ResilientRun(cfg, state={"model": model, "optim": optim}) as run:
                    for step in run.steps(steps):
                        stamps.append(time.perf_counter())
                        _step(model, optim, step, sleep_s)
            return stamps

    return KrTrainer


def steps_round(kind: str, remote: object, root: Path, steps: int, sleep_s: float) -> float:
    """Median step time (s) of rank 0 in one run of ``kind`` with fresh actors."""
    import ray

    import kempner_resilience as kr
    from kempner_resilience.supervise.ray.driver import RayDriver

    ckpt = str(root / f"ckpt-{uuid.uuid4().hex[:6]}")
    actors = [remote.remote() for _ in range(2)]
    addr, port = ray.get(actors[0].address.remote())
    ray.get([a.init_group.remote(r, 2, addr, port) for r, a in enumerate(actors)])
    if kind == "with":
        with RayDriver(kr.load_config(overrides=[f"checkpoint.dir={ckpt}"])) as driver:
            driver.track(*actors)
            out = driver.get([a.train.remote(driver.board, ckpt, steps, sleep_s)
                              for a in actors])
    else:
        out = ray.get([a.train.remote(None, ckpt, steps, sleep_s) for a in actors])
    for a in actors:
        ray.kill(a)
    stamps = out[0]
    return statistics.median(b - a for a, b in zip(stamps[WARMUP:], stamps[WARMUP + 1:]))


def bench_steps(rounds: int, steps: int, sleep_s: float, root: Path) -> None:
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    kinds = {"without": ray.remote(num_cpus=1)(PlainTrainer),
             "with": ray.remote(num_cpus=1)(_kr_trainer())}
    got: dict[str, list[float]] = {"without": [], "with": []}
    for i in range(rounds):
        order = ["without", "with"] if i % 2 == 0 else ["with", "without"]
        for kind in order:
            got[kind].append(steps_round(kind, kinds[kind], root, steps, sleep_s))
        print(f"round {i + 1}: without {got['without'][-1] * 1e3:.2f} ms, "
              f"with {got['with'][-1] * 1e3:.2f} ms", flush=True)
    ray.shutdown()
    w, wo = statistics.median(got["with"]), statistics.median(got["without"])
    print(f"per-step: without {wo * 1e3:.2f} ms, with {w * 1e3:.2f} ms (medians of {rounds} "
          f"rounds), ratio with/without {w / wo:.2f}x, +{(w - wo) * 1e3:.2f} ms per step")


def bench_ctrl_c(rounds: int, root: Path) -> None:
    rows = []
    for i in range(rounds):
        r = ctrl_c_round(root)
        rows.append(r)
        gone = f"{r['gone']:.2f} s" if r["gone"] is not None else "not within 30 s"
        print(f"round {i + 1}: exit {r['code']} after {r['exit']:.2f} s, all {r['processes']} "
              f"processes gone after {gone}, left {r['left']}, resources left "
              f"{r['resources']}", flush=True)
    done = [r["gone"] for r in rows if r["gone"] is not None]
    print(f"ctrl-c: driver exit median {statistics.median(r['exit'] for r in rows):.2f} s, "
          f"all gone median {statistics.median(done) if done else float('nan'):.2f} s, "
          f"processes left {sum(r['left'] for r in rows)}, resources left "
          f"{sum(r['resources'] for r in rows)}, codes {[r['code'] for r in rows]}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--sleep", type=float, default=0.0, help="stand-in compute per step, s")
    p.add_argument("--only", choices=["ctrl-c", "steps"])
    p.add_argument("--dir", default="")
    a = p.parse_args()
    root = Path(a.dir or tempfile.mkdtemp(prefix="raybench-"))
    root.mkdir(parents=True, exist_ok=True)
    print(f"load average (1 min): {os.getloadavg()[0]:.2f}, cpus {os.cpu_count()}", flush=True)
    if a.only in (None, "ctrl-c"):
        bench_ctrl_c(a.rounds, root)
    if a.only in (None, "steps"):
        bench_steps(a.rounds, a.steps, a.sleep, root)


if __name__ == "__main__":
    main()
