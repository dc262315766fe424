"""The rescue against the races around it, with real processes (DDP over gloo, the demo's state,
real files): a stall that ends while the hang watchdog's rescue writes, and a rescue writer
that dies after claiming.

A hang-path rescue runs beside a live training thread: a stall (data loader, NFS, a continued
peer) that ends during the write must not let that thread step the state being written, save,
or leave with another code. A checkpoint of step S holds step S's tensors, or nothing is
committed; the resumed run ends bitwise equal to an uninterrupted one.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from helpers import assert_bitwise_equal, committed_manifests, rank_logs, run_rescue_job
from kempner_resilience.checkpoint import layout
from kempner_resilience.exitcodes import ExitCode

STEPS, EVERY, STALL_AT = 30, 10, 15
# Repetitions of the stall case: 1 in CI; `KR_RESCUE_STALL_RUNS=20` for the by-hand check.
STALL_RUNS = int(os.environ.get("KR_RESCUE_STALL_RUNS", "1"))


def run_job(work: Path, *extra: str, ranks: int = 2, every: int = EVERY, on_launch=None):
    return run_rescue_job(work, *extra, steps=STEPS, every=every, ranks=ranks,
                          sets=("checkpoint.keep_last=100", "rescue.budget_s=60"),
                          on_launch=on_launch)


committed, logs = committed_manifests, rank_logs


def tensors(step_dir: Path, scratch: Path) -> dict[str, torch.Tensor]:
    """The model's and optimizer's tensors a checkpoint holds, flattened by key."""
    out = scratch / f"{step_dir.parent.parent.name}-{step_dir.name}.pt"
    dcp_to_torch_save(step_dir, out)
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value

    sd = torch.load(out, weights_only=False)
    for name in ("model", "optim"):
        walk(name, sd[name])
    return flat


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run, with a checkpoint at every step to compare a rescue with."""
    work = tmp_path_factory.mktemp("rescue-race-ref")
    launches, weights = run_job(work, every=1)
    assert [l.exit_codes for l in launches] == [[0, 0]]
    return work, weights


@pytest.mark.slow
def test_a_stall_that_ends_during_the_hang_rescue_commits_that_step_exactly_or_nothing(
        tmp_path, reference):
    # Rank 1 stalls in step 15 (rank 0 waits in the gradient all-reduce); both hang watchdogs
    # fire; the stall ends 0.05 s after the rescue's claim, while the writer sleeps on slow
    # storage: both training threads could run on and step the state being written.
    ref_dir, ref_weights = reference
    for run in range(STALL_RUNS):
        work = tmp_path / f"run{run}"
        first_commits: list[dict[int, dict]] = []
        launches, weights = run_job(
            work, "--stall-until-claim", f"1:{STALL_AT}", "--slow-rescue-write", "1.0",
            "--set", "watchdog.hang_timeout_s=2",
            on_launch=lambda launch: launch.index == 0 and first_commits.append(
                committed(work)))
        assert len(launches) == 2, f"run {run}: {[l.exit_codes for l in launches]}"
        first, second = launches
        # The hang path's code (or, on the rank whose hang path had not decided yet, the lost
        # peer's): never 0, never a save after the decision.
        assert set(first.exit_codes) <= {ExitCode.HANG, ExitCode.PEER_LOST}, \
            f"run {run}: {first.exit_codes}"
        [commits] = first_commits
        assert set(commits) <= {EVERY, STALL_AT}, f"run {run}: {sorted(commits)}"
        if STALL_AT in commits:
            assert commits[STALL_AT]["reason"] == "rescue"
            entry = layout.scan_one(work / "ckpt" / f"step_{STALL_AT:09d}")
            layout.verify_entry(entry)
            assert_bitwise_equal(
                tensors(ref_dir / "ckpt" / f"step_{STALL_AT:09d}", tmp_path),
                tensors(entry.path, tmp_path), f"run {run}: ")
        assert second.report["resumed_from"] in (EVERY, STALL_AT)
        assert second.exit_codes == [0, 0]
        assert_bitwise_equal(ref_weights, weights, f"run {run}: ")


@pytest.mark.slow
def test_a_rescue_claimant_killed_after_its_claim_costs_the_other_survivors_seconds(tmp_path):
    # 3 ranks: rank 2 dies in step 25, ranks 0 and 1 survive and one claims the rescue; that
    # one is SIGKILLed right after its claim (a slow write keeps it from finishing first). The
    # other sees its process gone and leaves with PEER_LOST, instead of waiting out the 60 s
    # budget for an outcome that never comes.
    killed: list[int] = []
    stop = threading.Event()

    def kill_the_claimant() -> None:
        while not stop.is_set():
            for claim in (tmp_path / "ckpt").glob(".rescue/*/claim"):
                try:
                    who = json.loads(claim.read_text())
                except ValueError:
                    continue
                os.kill(who["pid"], signal.SIGKILL)
                killed.append(who["rank"])
                return
            time.sleep(0.001)

    watcher = threading.Thread(target=kill_the_claimant, daemon=True)
    watcher.start()
    try:
        launches, _ = run_job(tmp_path, "--kill-at", "2:25", "--slow-rescue-write", "3",
                              ranks=3)
    finally:
        stop.set()
    [claimant] = killed
    other = 1 - claimant
    first, second = launches
    assert first.exit_codes[2] == -signal.SIGKILL and first.exit_codes[claimant] == -signal.SIGKILL
    assert first.exit_codes[other] == ExitCode.PEER_LOST
    other_log = (tmp_path / f"rank{other}.0.log").read_text()
    assert f"rank {claimant} claimed it but is gone" in other_log
    assert 25 not in committed(tmp_path)
    assert second.report["resumed_from"] == 20 and second.exit_codes == [0, 0, 0]
