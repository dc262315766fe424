"""The emergency save is refused only when measured saves say it cannot fit before the deadline.

Real ranks (gloo), real signals through the local launcher, real DCP files.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from helpers import write_script
from kempner_resilience.checkpoint import CheckpointManager
from kempner_resilience.checkpoint.estimate import SAFETY
from kempner_resilience.config import CheckpointConfig
from kempner_resilience.demo.launcher import LocalLauncher
from kempner_resilience.exitcodes import ExitCode

# One dominant tensor: DCP's dedup gives it to rank 0 and leaves rank 1 a few KiB to write, so
# rank 1's bytes-per-second over a whole save says nothing about how long a save takes.
SCRIPT = """
import argparse, os, signal, sys
import kempner_resilience as kr
import torch, torch.distributed as dist
from torch import nn

ap = argparse.ArgumentParser()
ap.add_argument("--dir"); ap.add_argument("--progress")
args = ap.parse_args()
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
dist.init_process_group("gloo", rank=rank, world_size=world)
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Linear(4096, 4096, bias=False))   # 64 MiB
optim = torch.optim.SGD(model.parameters(), lr=1e-3)
progress = open(args.progress, "a", buffering=1)
cfg = kr.load_config(None, [f"checkpoint.dir={args.dir}", "checkpoint.every_steps=4"])
with kr.ResilientRun(cfg, state={"model": model, "optim": optim}) as run:
    for step in run.steps(14):
        optim.zero_grad()
        model(torch.randn(8, 4096)).sum().backward()
        optim.step()
        if step == 6:   # as SLURM's --signal would, to every rank
            os.kill(os.getpid(), signal.SIGUSR1)
        progress.write(f"rank {rank} step {step}\\n")
dist.destroy_process_group()
"""


def test_a_two_rank_job_commits_its_emergency_checkpoint_after_a_periodic_save(tmp_path):
    script = write_script(tmp_path, SCRIPT)
    ckpt = tmp_path / "ckpt"
    launches = LocalLauncher([sys.executable, str(script), "--dir", str(ckpt)], ranks=2,
                             workdir=tmp_path, max_launches=3).run()
    logs = "".join((tmp_path / f"rank{r}.0.log").read_text() for r in (0, 1))
    assert [l.exit_code for l in launches] == [ExitCode.REQUEUE, 0], logs
    assert "refused" not in logs
    assert launches[0].report["stop_step"] == 9       # USR1 seen at boundary 7, stop at 7 + 2
    assert '"reason":"emergency"' in (ckpt / "step_000000009" / "MANIFEST.json").read_text()
    assert launches[1].report["resumed_from"] == 9


def _trained_manager(root: Path, **kw) -> CheckpointManager:
    from checkpoint_helpers import toy

    state = toy.build(0)
    toy.train_step(state)
    return CheckpointManager(CheckpointConfig(dir=str(root), **kw), state)


def test_without_a_measured_save_the_emergency_save_is_tried_even_near_the_deadline(tmp_path):
    mgr = _trained_manager(tmp_path, save_margin_s=5.0)
    info = mgr.emergency_save(3, deadline=time.monotonic() + 4.0)
    assert info is not None and (tmp_path / "step_000000003" / "MANIFEST.json").exists()


def test_a_measured_save_that_cannot_fit_is_refused_and_the_last_checkpoint_kept(tmp_path,
                                                                                  caplog):
    mgr = _trained_manager(tmp_path, save_margin_s=5.0)
    first = mgr.save(1)
    assert mgr.emergency_save(2, deadline=time.monotonic() + 5.0) is None
    assert "refused" in caplog.text and mgr.latest() == first


def test_a_measured_save_that_fits_is_written(tmp_path):
    mgr = _trained_manager(tmp_path, save_margin_s=0.5)
    mgr.save(1)
    info = mgr.emergency_save(2, deadline=time.monotonic() + 60.0)
    assert info is not None and info.reason == "emergency" and mgr.latest() == info


def test_the_estimate_of_a_tiny_state_is_its_measured_save_not_its_bytes_over_a_bandwidth(
        tmp_path):
    # Bytes over a bandwidth said minutes for a tiny state; the time its save took, with the
    # safety factor, says what it costs (seconds here, more on a machine loaded at the time).
    mgr = _trained_manager(tmp_path)
    info = mgr.save(1)
    est = mgr.estimate()
    assert est.measured and est.seconds == pytest.approx(SAFETY * info.save_seconds)
