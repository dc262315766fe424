"""DCP's plan cache lives in class-level dicts for the life of the process. A run's plans are
its own (``RunSavePlanner``) and go when the run ends, so a process that lives on into another
run (a warm Ray actor, a notebook) brings none of them along."""

from __future__ import annotations

import torch
from torch.distributed.checkpoint.planner import SavePlanner

import kempner_resilience as kr


def _cached_keys() -> set[str]:
    return {k for name in ("_cached_save_plan", "_cached_final_save_plan", "_cached_all_plans",
                           "_cached_global_plan", "_cached_metadata")
            for k in getattr(SavePlanner, name, {})}


def test_a_run_s_dcp_plans_are_gone_when_it_ends_and_the_next_run_in_the_process_saves(tmp_path):
    before = _cached_keys()
    for width in (4, 8):            # the second run's state has another layout
        cfg = kr.load_config(overrides=[f"checkpoint.dir={tmp_path / str(width)}",
                                        "watchdog.hang_timeout_s=0"])
        model = torch.nn.Linear(width, width)
        with kr.ResilientRun(cfg, state={"model": model}, exit_mode="raise") as run:
            for _ in run.steps(3):
                run.save()
        assert run.exit_code == 0
        assert len(list((tmp_path / str(width)).glob("step_*"))) >= 1
        assert _cached_keys() == before
