"""Just-in-time rescue with real processes: 4 DDP ranks over gloo (the demo's model with dropout,
Adam, a step LR schedule, shuffled data, per-rank RNG streams), periodic saves every 10 steps,
one rank failing between two saves in the first launch; the second launch is the requeue.

A rescue commits the last step boundary (one step lost, not a checkpoint interval) and the
resumed run ends bitwise equal to an uninterrupted one; a survivor caught inside an optimizer
step refuses, and the run falls back to the periodic checkpoint; a writer killed mid-rescue
leaves nothing committed.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from helpers import (assert_bitwise_equal, buddy_ring_of_two, committed_manifests, rank_logs,
                     run_rescue_job)
from kempner_resilience.checkpoint import layout
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.core.goodput import analyze_dir
from kempner_resilience.core.ledger import read_ledger
from kempner_resilience.core.runpaths import RunPaths

STEPS, EVERY, FAIL_AT = 30, 10, 25


def run_job(work: Path, *extra: str, ranks: int = 4, every: int = EVERY, on_launch=None):
    return run_rescue_job(work, *extra, steps=STEPS, every=every, ranks=ranks,
                          sets=("rescue.budget_s=20", "watchdog.hang_timeout_s=60"),
                          on_launch=on_launch)


committed, logs = committed_manifests, rank_logs


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    launches, weights = run_job(tmp_path_factory.mktemp("rescue-ref"))
    assert [l.exit_codes for l in launches] == [[0, 0, 0, 0]]
    return weights


@pytest.mark.slow
def test_a_rank_killed_in_the_gradient_all_reduce_costs_one_step_and_the_run_ends_bitwise_equal(
        tmp_path, reference):
    launches, weights = run_job(tmp_path, "--kill-at", f"3:{FAIL_AT}")
    first, second = launches
    assert first.exit_codes == [ExitCode.PEER_LOST] * 3 + [-signal.SIGKILL]
    rescue = committed(tmp_path)[FAIL_AT]      # the boundary of the step the rank died in
    assert rescue["reason"] == "rescue"
    assert rescue["rescue"]["reason"] == "peer lost" and rescue["rescue"]["writer_rank"] in (0, 1, 2)
    layout.verify_entry(layout.scan_one(tmp_path / "ckpt" / f"step_{FAIL_AT:09d}"))
    assert f"committed step {FAIL_AT}" in logs(tmp_path)
    assert second.report["resumed_from"] == FAIL_AT and second.exit_codes == [0] * 4
    assert_bitwise_equal(reference, weights)
    # The run ledger (rank 0 survived) records the rescue; the requeue resumed where it ended.
    events = read_ledger(RunPaths(tmp_path / "ckpt").ledger)
    assert [(e["step"], e["committed"]) for e in events if e["ev"] == "rescue"] == [(FAIL_AT, True)]
    attempts = analyze_dir(tmp_path / "ckpt").attempts
    assert attempts[0].last_step - attempts[1].start_step <= 1


@pytest.mark.slow
def test_a_rank_that_hangs_holding_the_gil_is_rescued_by_the_others(tmp_path, reference):
    launches, weights = run_job(tmp_path, "--hang-at", f"3:{FAIL_AT}",
                                "--set", "watchdog.hang_timeout_s=5")
    first, second = launches
    assert first.exit_codes == [ExitCode.HANG] * 4   # the hung one by its kernel-timer backstop
    assert committed(tmp_path)[FAIL_AT]["rescue"]["reason"] == "hang"
    assert second.report["resumed_from"] == FAIL_AT
    assert_bitwise_equal(reference, weights)


@pytest.mark.slow
def test_survivors_inside_an_optimizer_step_refuse_the_rescue_and_the_run_falls_back(
        tmp_path, reference):
    # Every optimizer step starts with a collective; rank 3 dies inside it, so the survivors
    # fail inside optimizer.step(): their parameters may be half updated.
    launches, weights = run_job(tmp_path, "--optim-collective", "--kill-in-optim",
                                f"3:{FAIL_AT}")
    first, second = launches
    assert first.exit_codes == [ExitCode.PEER_LOST] * 3 + [-signal.SIGKILL]
    assert FAIL_AT not in committed(tmp_path) and FAIL_AT + 1 not in committed(tmp_path)
    assert "an optimizer step was in progress" in logs(tmp_path)
    assert second.report["resumed_from"] == 20          # the periodic checkpoint
    assert_bitwise_equal(reference, weights)


@pytest.mark.slow
def test_a_rank_dying_after_its_all_reduce_but_before_its_boundary_falls_back_cleanly(
        tmp_path, reference):
    # The survivors finished the step (the all-reduce completed) and marked its boundary; the
    # dead rank never sent its RNG and data position of that boundary, so no complete state of
    # it exists anywhere: nothing that mixes steps is written, the run resumes from the
    # periodic checkpoint (a node dying in this window loses the interval, not one step).
    launches, weights = run_job(tmp_path, "--kill-after-step", f"3:{FAIL_AT}")
    first, second = launches
    assert first.exit_codes == [ExitCode.PEER_LOST] * 3 + [-signal.SIGKILL]
    assert not [s for s, m in committed(tmp_path).items() if m.get("reason") == "rescue"]
    assert f"no state of step {FAIL_AT + 1} from rank(s) [3]" in logs(tmp_path)
    # Said as it is: the dead rank's buddy is alive and holds its older boundary.
    assert f"rank 3 is one boundary behind, at step {FAIL_AT}" in logs(tmp_path)
    # Its buddy saw its link end without a word: the writer gave up on it at once, not after
    # GIVE_UP_S (the survivors must leave within SLURM's KillWait).
    assert "holds that and saw it die)" in logs(tmp_path)
    assert "both gone or stuck" not in logs(tmp_path)
    assert second.report["resumed_from"] == 20          # the periodic checkpoint
    assert_bitwise_equal(reference, weights)


@pytest.mark.slow
def test_a_rescue_writer_killed_mid_write_leaves_nothing_committed(tmp_path):
    # 2 ranks: rank 1 dies, rank 0 writes the rescue, with 64 MB of replicated ballast so that
    # it takes long enough to be killed while writing.
    killed: list[int] = []
    stop = threading.Event()

    def kill_the_writer() -> None:
        ckpt = tmp_path / "ckpt"
        while not stop.is_set():
            for claim in ckpt.glob(".rescue/*/claim"):
                try:
                    who = json.loads(claim.read_text())
                except ValueError:
                    continue
                if (ckpt / f"step_{who['step']:09d}").is_dir():   # its write has begun
                    os.kill(who["pid"], signal.SIGKILL)
                    killed.append(who["step"])
                    return
            time.sleep(0.001)

    after_first: list[tuple[bool, bool, dict]] = []

    def look(launch) -> None:
        if launch.index == 0:       # before the next launch's retention cleans up
            partial = tmp_path / "ckpt" / f"step_{FAIL_AT:09d}"
            after_first.append((partial.is_dir(), (partial / layout.MANIFEST_NAME).exists(),
                                committed(tmp_path)))

    watcher = threading.Thread(target=kill_the_writer, daemon=True)
    watcher.start()
    try:
        launches, _ = run_job(tmp_path, "--kill-at", f"1:{FAIL_AT}", "--ballast-mb", "64",
                              "--set", "rescue.budget_s=6", ranks=2, on_launch=look)
    finally:
        stop.set()
    assert killed == [FAIL_AT]
    assert launches[0].exit_codes == [-signal.SIGKILL] * 2     # rank 1, and rank 0 writing
    [(begun, manifest, commits)] = after_first
    assert begun and not manifest and sorted(commits) == [10, 20]
    for entry in layout.scan(RunPaths(tmp_path / "ckpt")):
        if entry.committed:
            layout.verify_entry(entry)
    assert launches[1].report["resumed_from"] == 20 and launches[1].exit_codes == [0] * 2


def test_rescue_is_off_with_a_log_line_when_the_ranks_modules_are_not_replicas(tmp_path):
    launches, _ = run_job(tmp_path, "--no-ddp-unsynced", ranks=2)
    assert [l.exit_codes for l in launches] == [[0, 0]]
    assert "rescue off: the modules not wrapped in DDP differ across ranks" in logs(tmp_path)


@pytest.mark.slow
def test_a_rescue_written_when_rank_0_died_is_in_the_ledger_and_its_step_counts_as_kept(
        tmp_path, capsys):
    from kempner_resilience.cli import main as cli_main

    launches, _ = run_job(tmp_path, "--kill-at", f"0:{FAIL_AT}", ranks=2)
    first, second = launches
    assert first.exit_codes[0] == -signal.SIGKILL
    assert committed(tmp_path)[FAIL_AT]["rescue"]["writer_rank"] == 1
    # Rank 0, the ledger's writer, is dead: rank 1 recorded the rescue it wrote.
    rescues = [e for e in read_ledger(RunPaths(tmp_path / "ckpt").ledger) if e["ev"] == "rescue"]
    assert [(e["step"], e["committed"], e["writer"], e["rank"]) for e in rescues] == \
        [(FAIL_AT, True, 1, 1)]
    attempts = analyze_dir(tmp_path / "ckpt").attempts
    assert attempts[0].crashed and attempts[0].rescue_step == FAIL_AT
    assert attempts[0].kept_steps == FAIL_AT and second.report["resumed_from"] == FAIL_AT
    assert cli_main(["report", str(tmp_path / "ckpt")]) == 0
    assert f"killed? rescue@{FAIL_AT} kept" in capsys.readouterr().out


def _woken_by(a, woken: list[str]) -> None:
    end = time.monotonic() + 30
    while not woken and time.monotonic() < end:
        time.sleep(0.01)
    assert woken, "the predecessor's end never woke the rescue"


def test_a_rank_that_dies_without_a_word_is_named_by_its_buddy_and_one_that_leaves_is_not():
    # The survivors tell their launcher which peers died (a torchrun agent drops their node
    # from its rendezvous at once): a rank whose link just ends died (SIGKILL closes its
    # sockets, nothing more); one that leaves on a failure wakes its buddy first.
    woken: list[str] = []
    a, b = buddy_ring_of_two(woken)
    try:
        b._out.close()             # noqa: SLF001 - what the kernel does for a killed process
        _woken_by(a, woken)
        assert a.pred_died
    finally:
        a.close(clean=False)
        b.close(clean=False)
    woken = []
    a, b = buddy_ring_of_two(woken)
    try:
        b.close(clean=False)       # rank 1 leaves after its rescue, or on its own error
        _woken_by(a, woken)
        a._thread.join(10)         # noqa: SLF001 - the link's end, read after the wake
        assert not a.pred_died
    finally:
        a.close(clean=False)
