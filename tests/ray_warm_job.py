"""Warm worker actors (supervise/ray/parking.py) on a real local Ray, for tests/test_ray_warm.py.

``cycles N``: a 2-actor group formed, called and released N times under one parking; each
incarnation's census (pid, threads, file descriptors, the object's fresh state) on stdout.
``hang``: rank 1's call never ends while rank 0's returns (``hang-in-collective``: rank 0's
waits for rank 1 in an all-reduce); the group is lost for silence, released and formed again.
Prints one JSON line.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import ray
import torch

import kempner_resilience.ray as krr
from kempner_resilience.core.procs import pid_alive
from kempner_resilience.supervise.ray.parking import parking_for


class Probe(krr.Worker):
    def __init__(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = torch.nn.Linear(4, 4)
        self.calls = 0

    def checkpoint_state(self):
        return {"model": self.model}

    def work(self, hang_rank: int, collective: bool = True) -> float:
        import torch.distributed as dist

        self.calls += 1
        if self.kr_rank == hang_rank:
            time.sleep(3600)
        t = torch.ones(2)
        if collective:
            dist.all_reduce(t)
        return float(t[0])

    def census(self) -> dict:
        import torch.distributed as dist

        return {"pid": os.getpid(), "threads": threading.active_count(),
                "fds": len(os.listdir("/proc/self/fd")), "calls": self.calls,
                "weight": self.model.weight.flatten().tolist(), "rank": dist.get_rank(),
                "world": dist.get_world_size()}


def cycles(n: int) -> dict:
    cfg = krr.load_config(overrides=["checkpoint.dir=/nonexistent-unused"])
    group = krr.WorkerGroup(Probe, 2, 0, options={"num_cpus": 0.5})
    seen = []
    with parking_for():
        for _ in range(n):
            group.start("probe", cfg)
            group.call("work", -1)
            seen.append(group.call("census"))
            group.release()
    # The supervised loop is over: its parked actors are killed, before Ray shuts down.
    left = _alive([c["pid"] for c in seen[-1]])
    torch.manual_seed(0)
    return {"censuses": seen, "cold_weight": torch.nn.Linear(4, 4).weight.flatten().tolist(),
            "left_after_the_loop": left}


def _alive(pids: list, settle_s: float = 15.0) -> list:
    until = time.monotonic() + settle_s
    while True:
        left = [p for p in pids if pid_alive(p)]
        if not left or time.monotonic() > until:
            return left
        time.sleep(0.1)


def hang(collective: bool) -> dict:
    cfg = krr.load_config(overrides=["checkpoint.dir=/nonexistent-unused"])
    group = krr.WorkerGroup(Probe, 2, 0, options={"num_cpus": 0.5})
    with parking_for():
        group.start("probe", cfg)
        before = group.call("census")
        group.bound_s = 3.0       # watchdog.hang_timeout_s, for this call alone
        try:
            group.call("work", 1, collective)
            lost = None
        except krr.GroupLost as e:
            lost = str(e)
        group.release()
        group.start("probe", cfg)
        after = group.call("census")
        group.release()
    return {"before": before, "after": after, "lost": lost}


def main() -> None:
    ray.init(num_cpus=2, include_dashboard=False, runtime_env=krr.warm_runtime_env())
    try:
        out = cycles(int(sys.argv[2])) if sys.argv[1] == "cycles" else \
            hang(sys.argv[1] == "hang-in-collective")
    finally:
        ray.shutdown()
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
