"""No supervisor: the ranks' endings reach rank 0's decision (``supervise/endings.py``).

Two plain gloo processes (``RANK``, ``WORLD_SIZE``, ``MASTER_PORT`` in their environment, as a
plain ``srun python train.py`` or plain torchrun gives them): nothing outside the ranks decides
whether the job runs again, rank 0 does, after a lost peer. A rank that raised says so, and
rank 0 leaves with its code (1) instead of 81, "a rescued failure, run me again"; a rank
SIGKILLed says nothing, and rank 0 still leaves with 81, and the next launch resumes bitwise.
The requeue itself (SLURM) is in tests/test_slurm_peer_endings.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from kempner_resilience.core.runpaths import RunPaths
from kempner_resilience.rescue.files import RescueFiles
from kempner_resilience.supervise.channel import CHANNEL_ENV
from kempner_resilience.supervise.endings import RankEnding, note_ending, peer_decision
from kempner_resilience.supervise.policy import Action, RankEnd
from helpers import RESCUE_JOB, assert_bitwise_equal, env, free_port, spawn_script

STEPS, EVERY = 24, 4


def _launch(work: Path, *extra: str, timeout: float = 240.0,
            ranks: int = 2) -> tuple[list[int], list[str]]:
    """The rescue job's ranks, plain processes, no supervisor: (codes, stderr texts)."""
    port = str(free_port())
    cmd = [sys.executable, str(RESCUE_JOB), "--steps", str(STEPS), "--out",
           str(work / "weights.pt"), "--set", f"checkpoint.dir={work / 'ckpt'}",
           "--set", f"checkpoint.every_steps={EVERY}", *extra]
    procs = []
    for rank in range(ranks):
        e = env(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks),
                MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
        e.pop(CHANNEL_ENV, None)
        procs.append(spawn_script(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=e, cwd=work))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[1])
    finally:
        for p in procs:
            p.kill()
    return [p.returncode for p in procs], outs


def test_a_peer_that_recorded_no_ending_counts_as_killed_and_the_job_runs_again(tmp_path):
    decision, seen = peer_decision(RunPaths(tmp_path), "t1", RankEnd(81), 0, 2, wait_s=0.0)
    assert seen == {}
    assert decision.action is not Action.LEAVE and decision.code == 81


def test_a_peer_s_recorded_exception_ends_the_job_with_its_code(tmp_path):
    note_ending(RunPaths(tmp_path), "t1", RankEnding(1, "error", 1, 7))
    decision, seen = peer_decision(RunPaths(tmp_path), "t1", RankEnd(81), 0, 2, wait_s=0.0)
    assert seen[1].kind == "error"
    assert (decision.action, decision.code) == (Action.LEAVE, 1)


def test_an_earlier_attempt_s_ending_is_never_read(tmp_path):
    note_ending(RunPaths(tmp_path), "old", RankEnding(1, "error", 1, 7))
    decision, _ = peer_decision(RunPaths(tmp_path), "new", RankEnd(81), 0, 2, wait_s=0.0)
    assert decision.action is not Action.LEAVE


def test_silent_peers_the_rescue_accounts_for_are_not_waited_for(tmp_path):
    # Rank 1 offered its state to this failure's rescue (a survivor, stuck in a collective
    # with rank 0 until rank 0 leaves); rank 2's buddy saw it die. Neither will write an
    # ending before rank 0 exits, so rank 0 does not wait its minute for them.
    rescue = RescueFiles(RunPaths(tmp_path), "a1")
    rescue.mark_offered(1)
    rescue.mark_died(2)
    began = time.monotonic()
    decision, seen = peer_decision(RunPaths(tmp_path), "t1", RankEnd(81), 0, 3, wait_s=60.0,
                                   rescue=rescue)
    assert time.monotonic() - began < 30.0 and seen == {}
    assert decision.runs_again and decision.code == 81


def test_a_peer_that_left_early_beside_survivors_in_the_rescue_still_ends_the_job(tmp_path):
    # The survivors have not written their endings yet: each counts as a lost peer (81), not
    # as killed, so the job still leaves with 1 and is not relaunched.
    note_ending(RunPaths(tmp_path), "t1", RankEnding(1, "left-early", 0, 5))
    rescue = RescueFiles(RunPaths(tmp_path), "a1")
    rescue.mark_offered(2)
    rescue.mark_offered(3)
    decision, _ = peer_decision(RunPaths(tmp_path), "t1", RankEnd(81), 0, 4, wait_s=60.0,
                                rescue=rescue)
    assert (decision.action, decision.code, decision.left_early) == (Action.LEAVE, 1, (1,))


def test_a_rank_that_raises_makes_rank_0_leave_with_1_not_81(tmp_path):
    codes, errs = _launch(tmp_path, "--raise-at", "1:9")
    assert codes == [1, 1], errs
    assert "not requeued" in errs[0] and "rank 1: error 1" in errs[0], errs[0]
    ledger = [json.loads(line) for line in (tmp_path / "ckpt" / "ledger.jsonl").open()]
    assert [e["code"] for e in ledger if e["ev"] == "exit"] == [1]


def test_every_survivor_leaves_with_rank_0_s_code_so_srun_s_status_is_1(tmp_path):
    codes, errs = _launch(tmp_path, "--raise-at", "1:9", ranks=3)
    assert codes == [1, 1, 1], errs
    assert "rank 0 decided" in errs[2], errs[2]


def test_a_rank_that_leaves_run_steps_by_sys_exit_makes_rank_0_leave_with_1(tmp_path):
    codes, errs = _launch(tmp_path, "--exit-at", "1:9")
    assert codes == [1, 0], errs
    assert "left run.steps early" in errs[0], errs[0]


def test_a_rank_that_raises_while_rank_0_hangs_waiting_for_it_ends_the_job_with_1_not_42(
        tmp_path):
    # With NCCL a peer that raised leaves the others stuck in the collective: no error reaches
    # them, their hang watchdog decides. Rank 0 reads the endings there too: the job ends with
    # the peer's code, not requeued (a requeue would replay the same bug until the budget).
    codes, errs = _launch(tmp_path, "--raise-at", "1:9", "--wait-forever", "0:9",
                          "--set", "watchdog.hang_timeout_s=3")
    assert codes == [1, 1], errs
    assert "hang detected" in errs[0], errs[0]
    assert "not requeued" in errs[0] and "rank 1: error 1" in errs[0], errs[0]
    ledger = [json.loads(line) for line in (tmp_path / "ckpt" / "ledger.jsonl").open()]
    assert [(e["code"], e["ending"]) for e in ledger if e["ev"] == "exit"] == [(1, "hang")]


def test_a_rank_sigkilled_leaves_81_and_the_next_launch_resumes_bitwise(tmp_path):
    ref = tmp_path / "ref"
    ref.mkdir()
    assert _launch(ref)[0] == [0, 0]
    work = tmp_path / "killed"
    work.mkdir()
    codes, errs = _launch(work, "--kill-at", "1:9")
    assert codes == [81, -9], errs
    assert "not requeued" not in errs[0]
    assert _launch(work)[0] == [0, 0]       # run again, as the 81 asks: no kill this time
    assert_bitwise_equal(torch.load(work / "weights.pt", weights_only=True),
                         torch.load(ref / "weights.pt", weights_only=True))


def test_a_rank_that_breaks_out_of_run_steps_is_named_with_its_step_by_the_survivor(tmp_path):
    codes, errs = _launch(tmp_path, "--break-at", "1:5")
    assert codes == [1, 0], errs
    assert "rank 1 left run.steps at step 5" in errs[0], errs[0]
    assert "not requeued" in errs[0] and "node" not in errs[0], errs[0]
    assert "left run.steps at step 5" in errs[1], errs[1]
