"""A function to submit with submitit's local executor: the demo job (``demo.train.build``: a
DDP MLP with dropout, Adam, a step LR schedule, a shuffled data iterator) under ResilientRun,
where one rank SIGKILLs itself once, in the first start of the tasks only
(``KEMPNER_RESTART_COUNT`` 0), after its forward pass of step ``kill_step``: the others are in
the gradient all-reduce, see the lost peer, commit the rescue and exit 81 (PEER_LOST).

Importable in the task when ``tests/`` is on ``PYTHONPATH`` (the tests set it). Rank 0 writes
the final weights and optimizer state to ``out``; returns ``{"rank", "start", "resumed",
"parent"}`` (the task's parent process).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any


def train_with_one_death(steps: int, out: str, kill_rank: int = -1, kill_step: int = -1,
                         step_time: float = 0.0, config: Any = None) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch import nn

    import kempner_resilience as kr
    from kempner_resilience.demo.train import build

    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    start = int(os.environ.get("KEMPNER_RESTART_COUNT", "0"))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    state = build(rank, world)
    model, optim, sched, data = state["model"], state["optim"], state["sched"], state["data"]
    with kr.ResilientRun(config, state=state) as run:
        resumed = run.start_step if run.resumed_from is not None else None
        for step in run.steps(steps):
            x, y = next(data)
            optim.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            if start == 0 and (rank, step) == (kill_rank, kill_step):
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            optim.step()
            sched.step()
            if step_time:
                time.sleep(step_time)
    if rank == 0:
        inner = getattr(model, "module", model)
        torch.save({"model": inner.state_dict(), "optim": optim.state_dict()}, out)
    dist.destroy_process_group()
    return {"rank": rank, "start": start, "resumed": resumed, "parent": os.getppid()}


def end_as_told(first: list[str]) -> int:
    """In the first start, rank r ends as ``first[r]`` says: an exit code, or ``"freeze"``
    (SIGSTOP itself, as a frozen node does); in later starts every rank returns its start."""
    rank = int(os.environ["RANK"])
    start = int(os.environ.get("KEMPNER_RESTART_COUNT", "0"))
    if start > 0:
        return start
    if first[rank] == "freeze":
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)
    os._exit(int(first[rank]))
