"""A sharded training job under ResilientRun: a small MLP with dropout, ``fully_shard`` (FSDP2)
on a 1-D mesh (``--mesh fsdp``) or on a 2-D ``("replicate", "shard")`` mesh (``--mesh hsdp``:
HSDP, 2 replica groups), AdamW, a step LR schedule and a shuffled per-rank data iterator, on
``WORLD_SIZE`` gloo ranks (CPU). The model and optimizer go to ResilientRun as the user holds
them.

    --out PATH          after the run, the full (gathered) weights and optimizer state: rank 0
                        writes PATH (every rank takes part in the gather)
    --dump-resumed PATH the same, right after the resume (what was loaded), with the step
    --app               model and optimizer go to ResilientRun inside one ``Stateful`` app
                        state (``get_state_dict``/``set_state_dict``, as in DCP's tutorial)

Launched by ``LocalLauncher`` (rank, world and port from the environment, ``--progress``
appended).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import kempner_resilience as kr  # noqa: E402
from kempner_resilience.demo.train import ShuffledBatches  # noqa: E402
from kempner_resilience.core.log import configure  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.checkpoint.state_dict import (StateDictOptions,  # noqa: E402
                                                     get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402


def build(rank: int, world: int, mesh_kind: str) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 32),
                          nn.ReLU(), nn.Linear(32, 1))
    if mesh_kind == "hsdp":
        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    for layer in (model[0], model[3], model[5]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=5, gamma=0.7)
    data = ShuffledBatches(seed=0, rank=rank, world=world)
    torch.manual_seed(1000 * (rank + 1))      # per-rank dropout streams
    return {"model": model, "optim": optim, "sched": sched, "data": data}


class AppState:
    """DCP's tutorial wrapper: the model and optimizer as one ``Stateful``."""

    def __init__(self, model: nn.Module, optim: torch.optim.Optimizer) -> None:
        self.model, self.optim = model, optim

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.optim)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, sd: dict) -> None:
        set_state_dict(self.model, self.optim, model_state_dict=sd["model"],
                       optim_state_dict=sd["optim"])


def full_state(model: nn.Module, optim: torch.optim.Optimizer) -> dict:
    """The gathered weights and optimizer state (collective), on CPU."""
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {"model": get_model_state_dict(model, options=opts),
            "optim": get_optimizer_state_dict(model, optim, options=opts)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--mesh", choices=("fsdp", "hsdp"), default="fsdp")
    p.add_argument("--out", required=True)
    p.add_argument("--dump-resumed")
    p.add_argument("--app", action="store_true")
    p.add_argument("--progress")
    p.add_argument("--set", dest="overrides", action="append", default=[])
    args = p.parse_args()
    configure("INFO")
    torch.set_num_threads(1)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    state = build(rank, world, args.mesh)
    model, optim, sched, data = state["model"], state["optim"], state["sched"], state["data"]
    if args.app:
        state = {"app": AppState(model, optim), "sched": sched, "data": data}
    progress = open(args.progress, "a", buffering=1) if args.progress else None
    cfg = kr.load_config(None, args.overrides)
    with kr.ResilientRun(cfg, state=state) as run:
        if args.dump_resumed and run.resumed_from is not None:
            full = full_state(model, optim)
            if rank == 0:
                torch.save({"step": run.start_step, **full}, args.dump_resumed)
        for step in run.steps(args.steps):
            x, y = next(data)
            optim.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            optim.step()
            sched.step()
            if progress is not None:
                progress.write(f"rank {rank} step {step}\n")
    full = full_state(model, optim)
    if rank == 0:
        torch.save(full, args.out)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
