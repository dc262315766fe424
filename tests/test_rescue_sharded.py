"""The rescue of sharded state with real processes: a ``fully_shard`` (FSDP2) MLP with dropout,
AdamW, a step LR schedule, shuffled per-rank data and per-rank RNG streams on gloo ranks (CPU),
periodic saves every 10 steps, one rank SIGKILLed between two saves in the first launch; the
second launch is the requeue.

HSDP 2 x 2 (``("replicate", "shard")``): the other replica group holds every shard of the last
step boundary, so the survivors write it (at most one step lost) and the resumed run ends bitwise
equal to an uninterrupted one. Pure FSDP (no replica dimension): the rescue is off with one log
line saying why, and the run resumes bitwise from its periodic checkpoint. A shard whose every
holder died is not guessed: the survivors write nothing and the run falls back the same way.
"""

from __future__ import annotations

import random
import signal
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

from helpers import assert_bitwise_equal, committed_manifests, rank_logs
from kempner_resilience.checkpoint import layout
from kempner_resilience.demo.launcher import LocalLauncher
from kempner_resilience.exitcodes import ExitCode

JOB = Path(__file__).resolve().parent / "checkpoint_helpers" / "sharded_rescue_job.py"
STEPS, EVERY = 30, 10


def run_job(work: Path, mesh: str, ranks: int, *extra: str):
    work.mkdir(parents=True, exist_ok=True)
    out = work / "weights.pt"
    cmd = [sys.executable, str(JOB), "--steps", str(STEPS), "--mesh", mesh, "--out", str(out),
           "--set", f"checkpoint.dir={work / 'ckpt'}", "--set", f"checkpoint.every_steps={EVERY}",
           "--set", "rescue.budget_s=20", "--set", "watchdog.hang_timeout_s=60", *extra]
    relaunch = {int(ExitCode.PEER_LOST), int(ExitCode.HANG), 128 + signal.SIGKILL}
    launches = LocalLauncher(cmd, ranks=ranks, workdir=work, max_launches=2,
                             relaunch_codes=relaunch, stop_timeout_s=90).run()
    return launches, torch.load(out, weights_only=True) if out.exists() else None


def chunk_layout(path: Path) -> dict:
    """Each tensor of a DCP checkpoint: its global size and its chunks (offsets, sizes)."""
    md = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {k: (tuple(v.size), sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks))
            for k, v in md.items() if hasattr(v, "chunks")}


@pytest.fixture(scope="module")
def hsdp_reference(tmp_path_factory):
    launches, weights = run_job(tmp_path_factory.mktemp("hsdp-ref"), "hsdp", 4)
    assert [l.exit_codes for l in launches] == [[0, 0, 0, 0]]
    return weights


@pytest.mark.slow
def test_hsdp_rank_killed_between_saves_is_rescued_from_the_other_replica_group_bitwise(
        tmp_path, hsdp_reference):
    kill_step = random.randint(EVERY + 1, 2 * EVERY - 1)      # any step between two saves
    print(f"rank 3 killed in step {kill_step}")
    launches, weights = run_job(tmp_path, "hsdp", 4, "--kill-at", f"3:{kill_step}")
    first, second = launches
    assert first.exit_codes == [ExitCode.PEER_LOST] * 3 + [-signal.SIGKILL]
    manifests = committed_manifests(tmp_path)
    [rescued] = [s for s, m in manifests.items() if m["reason"] == "rescue"]
    assert rescued == kill_step              # only the step the rank died in is lost
    assert manifests[rescued]["rescue"]["sharded"]["columns"] == 2
    ckpt = tmp_path / "ckpt"
    layout.verify_entry(layout.scan_one(ckpt / f"step_{rescued:09d}"))
    # A normal sharded checkpoint: every tensor in the chunks a periodic save at 4 ranks has.
    assert chunk_layout(ckpt / f"step_{rescued:09d}") == chunk_layout(ckpt / f"step_{2 * EVERY:09d}")
    assert f"committed step {rescued}" in rank_logs(tmp_path)
    assert second.report["resumed_from"] == rescued and second.exit_codes == [0] * 4
    assert_bitwise_equal(hsdp_reference, weights)


@pytest.mark.slow
def test_hsdp_rank_hanging_with_the_gil_held_is_rescued_by_the_others_watchdogs_bitwise(
        tmp_path, hsdp_reference):
    # The survivors' training threads stay blocked in a collective of the backward (FSDP2's
    # parameters unsharded meanwhile): their hang watchdogs write the boundary from their own
    # thread.
    launches, weights = run_job(tmp_path, "hsdp", 4, "--hang-at", "3:15",
                                "--set", "watchdog.hang_timeout_s=5")
    first, second = launches
    assert first.exit_codes == [ExitCode.HANG] * 4
    rescue = committed_manifests(tmp_path)[15]
    assert rescue["reason"] == "rescue" and rescue["rescue"]["reason"] == "hang"
    assert second.report["resumed_from"] == 15
    assert_bitwise_equal(hsdp_reference, weights)


@pytest.mark.slow
def test_hsdp_both_holders_of_a_shard_killed_falls_back_to_the_periodic_save_bitwise(
        tmp_path, hsdp_reference):
    # Ranks 1 and 3 hold shard column 1 (one per replica group): nobody has it any more. Their
    # per-rank state survives on their buddies (ranks 2 and 0); the shards do not.
    launches, weights = run_job(tmp_path, "hsdp", 4, "--kill-at", "1,3:15")
    first, second = launches
    assert first.exit_codes == [ExitCode.PEER_LOST, -signal.SIGKILL] * 2
    assert "no shards of step 15 for shard column(s) [1]" in rank_logs(tmp_path)
    assert {m["reason"] for m in committed_manifests(tmp_path).values()} == {"periodic"}
    assert second.report["resumed_from"] == EVERY and second.exit_codes == [0] * 4
    assert_bitwise_equal(hsdp_reference, weights)


@pytest.mark.slow
def test_pure_fsdp_rank_killed_turns_no_rescue_and_resumes_bitwise_from_the_periodic_save(
        tmp_path, tmp_path_factory):
    ref_launches, reference = run_job(tmp_path_factory.mktemp("fsdp-ref"), "fsdp", 2)
    assert [l.exit_codes for l in ref_launches] == [[0, 0]]
    launches, weights = run_job(tmp_path, "fsdp", 2, "--kill-at", "1:15")
    first, second = launches
    assert first.exit_codes[1] == -signal.SIGKILL
    assert "rescue off: rank 0: sharded without a replica dimension" in rank_logs(tmp_path)
    assert {m["reason"] for m in committed_manifests(tmp_path).values()} == {"periodic"}
    assert second.report["resumed_from"] == EVERY and second.exit_codes == [0, 0]
    assert_bitwise_equal(reference, weights)
