"""A periodic save waits for the other ranks no longer than any other wait: a rank paused
(SIGSTOP) inside a save is a lost peer, not a half-hour stall followed by a traceback.

Real processes: the demo job on 2 DDP ranks over gloo, periodic saves every 2 steps, one rank
SIGSTOPping itself inside the DCP write of the save of step 4 (the first launch only), while
the other waits for it in the save's collective. Rank 0 paused also pauses the TCPStore it
hosts. The relaunch is the requeue.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kempner_resilience.checkpoint import SavePeerLost, layout
from kempner_resilience.demo.launcher import free_port
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.core.faults import is_peer_failure
from kempner_resilience.core.runpaths import RunPaths
from helpers import spawn_script

HELPER = Path(__file__).resolve().parent / "checkpoint_helpers" / "stop_in_save.py"
STEPS, EVERY, STOP_AT = 8, 2, 4
HANG_S, RESCUE_S = 6, 10
# The contract: the survivor is gone within the hang budget (its wait for the paused rank), the
# rescue's budget and its own start-up and teardown (the slack, generous on a loaded 2-core
# machine). Before the fix it waited for gloo's 30-minute default, then exited 1.
ENDS_WITHIN_S = HANG_S + RESCUE_S + 30


def _launch(work: Path, restart: int, *extra: str) -> list[subprocess.Popen]:
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1",
                   KEMPNER_RESTART_COUNT=str(restart), PYTHONUNBUFFERED="1",
                   KEMPNER_RESILIENCE_REPORT=str(work / f"report.{restart}.json"))
        with open(work / f"rank{rank}.{restart}.log", "w") as log:
            procs.append(spawn_script(
                [sys.executable, str(HELPER), "--steps", str(STEPS), "--out",
                 str(work / "weights.pt"), "--set", f"checkpoint.dir={work / 'ckpt'}",
                 "--set", f"checkpoint.every_steps={EVERY}",
                 "--set", f"watchdog.hang_timeout_s={HANG_S}",
                 "--set", f"rescue.budget_s={RESCUE_S}", *extra],
                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def _state(pid: int) -> str:
    """The process's state letter from /proc (T: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@pytest.mark.slow
@pytest.mark.parametrize("paused_rank", [1, 0])
def test_a_rank_paused_inside_a_periodic_save_ends_the_job_as_a_lost_peer_and_it_resumes(
        tmp_path: Path, paused_rank: int) -> None:
    procs = _launch(tmp_path, 0, "--stop-in-save", f"{paused_rank}:{STOP_AT}")
    paused, survivor = procs[paused_rank], procs[1 - paused_rank]
    try:
        try:
            code = survivor.wait(timeout=ENDS_WITHIN_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the survivor still waits for the paused rank after {ENDS_WITHIN_S} s")
        assert (tmp_path / f"stopped.{paused_rank}").exists(), "it never paused in the save"
        assert _state(paused.pid) == "T"       # still paused: the survivor ended on its own
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
    log = (tmp_path / f"rank{1 - paused_rank}.0.log").read_text()
    assert code == ExitCode.PEER_LOST, log[-3000:]
    assert "a peer rank is gone" in log and "Traceback" not in log, log[-3000:]

    # Nothing partial is the resume point: the newest committed checkpoint (the periodic one
    # before the pause, or the survivor's rescue of the step it paused in) verifies ...
    newest = max((e for e in layout.scan(RunPaths(tmp_path / "ckpt")) if e.committed),
                 key=lambda e: e.step)
    assert STOP_AT - EVERY <= newest.step <= STOP_AT
    layout.verify_entry(newest)
    # ... and the relaunch resumes from it and completes.
    second = _launch(tmp_path, 1)
    try:
        codes = [p.wait(timeout=120) for p in second]
    finally:
        for p in second:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
    assert codes == [0, 0], (tmp_path / "rank0.1.log").read_text()[-3000:]
    report = json.loads((tmp_path / "report.1.json").read_text())
    assert report["resumed_from"] == newest.step


# gloo's own texts (torch 2.13), provoked with 2 ranks, one SIGSTOPped, a 3 s group timeout:
# the wait that times out, then every later operation on that group.
@pytest.mark.parametrize("text", [
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed out "
    "waiting 3000ms for send operation to complete",
    "Application timeout caused pair closure",
])
def test_gloo_timeout_texts_are_lost_peers(text: str) -> None:
    assert is_peer_failure(RuntimeError(text))
    assert is_peer_failure(SavePeerLost("periodic checkpoint of step 4: another rank is gone"))
    assert not is_peer_failure(RuntimeError("Application error caused by the training script"))
