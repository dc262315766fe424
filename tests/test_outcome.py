"""The one table from what happened to the exit code (kempner_resilience.exitcodes.exit_code)."""

from __future__ import annotations

import itertools
import signal
from pathlib import Path

from kempner_resilience.core import startup
from kempner_resilience.stop import watchdog
from kempner_resilience.exitcodes import (CLI_ONLY, ROWS, Ending, ExitCode, Facts, Saved,
                                          Verdict, after_requeue, endings_markdown, exit_code)

DOC = Path(__file__).resolve().parents[1] / "docs" / "exit-codes.md"


def _every_fact():
    """Every combination of facts a run's deciders can pass to the table."""
    for ending, signum, saved, requeue, forced in itertools.product(
            Ending, (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP), Saved,
            (None, *Verdict), (None, int(ExitCode.SIGINT), int(ExitCode.SIGTERM))):
        if ending is Ending.FORCED and signum not in (signal.SIGINT, signal.SIGTERM):
            continue            # only a second SIGINT/SIGTERM forces a rank out
        yield Facts(ending, 7, signum, saved, requeue, forced)


def test_every_exit_code_a_run_can_produce_is_a_row_of_the_one_table_and_of_the_docs():
    rows = {r.code for r in ROWS}
    produced = {exit_code(f) for f in _every_fact()}
    # The deciders outside the shutdown sequence take their codes from the same table.
    produced |= {ExitCode(watchdog.HANG_CODE), ExitCode(watchdog.DEADLINE_CODE),
                 ExitCode(startup.CONFIG_EXIT_CODE)}
    assert produced <= rows
    assert rows | CLI_ONLY == set(ExitCode) and not rows & CLI_ONLY
    assert {r.facts.ending for r in ROWS} == set(Ending)
    assert {r.facts.requeue for r in ROWS} >= set(Verdict)
    assert endings_markdown() in DOC.read_text(), "run scripts/regen_docs.py"


def test_a_sigterm_whose_requeue_is_disabled_exits_143_as_the_docs_promise():
    def code(sig):
        return exit_code(Facts(Ending.SIGNAL, 3, sig, Saved.COMMITTED, Verdict.DISABLED))
    assert code(signal.SIGTERM) == ExitCode.SIGTERM == 143
    assert code(signal.SIGINT) == ExitCode.SIGINT
    assert code(signal.SIGUSR1) == ExitCode.STOPPED


def test_a_failed_emergency_save_wins_over_the_requeue_and_a_forced_peer_over_everything():
    failed = Facts(Ending.SIGNAL, 3, signal.SIGUSR1, Saved.FAILED, Verdict.REQUEUED)
    assert exit_code(failed) == ExitCode.CHECKPOINT_FAILED
    failed.peer_forced_code = 143
    assert exit_code(failed) == ExitCode.SIGTERM


def test_a_committed_stop_exits_with_the_requeue_verdict_or_the_signal_convention():
    def code(sig, verdict=None):
        return exit_code(Facts(Ending.SIGNAL, 3, sig, Saved.COMMITTED, verdict))
    assert code(signal.SIGUSR1, Verdict.REQUEUED) == ExitCode.REQUEUE
    assert code(signal.SIGUSR1, Verdict.BUDGET_SPENT) == ExitCode.NO_REQUEUE
    assert code(signal.SIGUSR1, Verdict.NO_PROGRESS) == ExitCode.NO_REQUEUE
    assert code(signal.SIGUSR1, Verdict.SCONTROL_FAILED) == ExitCode.REQUEUE_FAILED
    assert code(signal.SIGTERM) == 143
    assert code(signal.SIGINT) == 130
    assert code(signal.SIGHUP) == ExitCode.STOPPED


def test_a_ray_driver_whose_requeue_after_a_lost_group_failed_says_so_not_81():
    # The driver is the job's one SLURM process: its code is the job's. After a dead node the
    # policy asks for a requeue; if that fails, "resubmit" (79), or "budget spent" (77).
    assert after_requeue(ExitCode.PEER_LOST, Verdict.SCONTROL_FAILED) == ExitCode.REQUEUE_FAILED
    assert after_requeue(ExitCode.PEER_LOST, Verdict.BUDGET_SPENT) == ExitCode.NO_REQUEUE
    assert after_requeue(ExitCode.PEER_LOST, Verdict.NO_PROGRESS) == ExitCode.NO_REQUEUE
    assert after_requeue(ExitCode.PEER_LOST, Verdict.REQUEUED) == ExitCode.PEER_LOST
    assert after_requeue(ExitCode.PEER_LOST, None) == ExitCode.PEER_LOST     # not under SLURM


def test_sigterm_with_action_requeue_and_requeue_disabled_exits_143_in_a_real_run(tmp_path):
    from helpers import start_running, write_script

    script = write_script(tmp_path, """
        import sys, time
        import kempner_resilience as kr
        cfg = kr.load_config(overrides=["signals.actions.SIGTERM=requeue",
                                        "requeue.enabled=false"])
        with kr.ResilientRun(cfg, exit_mode="exit") as run:
            for step in run.steps(100_000):
                if step == 2:
                    open(sys.argv[1], "w").write("running")
                time.sleep(0.01)
    """)
    proc = start_running(script, tmp_path / "stamp")
    try:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == ExitCode.SIGTERM == 143, err
    assert "requeue.enabled is false" in err


def test_a_run_forced_out_by_a_second_sigint_records_its_ending_in_the_ledger(tmp_path):
    from helpers import start, wait_for_file, write_script
    from kempner_resilience.core.ledger import read_ledger

    script = write_script(tmp_path, """
        import sys, time
        import kempner_resilience as kr
        class Counter:
            def state_dict(self):
                return {"n": 1}
            def load_state_dict(self, sd):
                pass
        cfg = kr.load_config(overrides=[f"checkpoint.dir={sys.argv[1]}"])
        with kr.ResilientRun(cfg, state={"counter": Counter()}, exit_mode="exit") as run:
            # A cleanup that takes its time: the user presses Ctrl+C again meanwhile.
            run.add_cleanup(lambda: (open(sys.argv[2], "w").write("cleanup"), time.sleep(60)),
                            timeout_s=90)
            for step in run.steps(100_000):
                if step == 2:
                    open(sys.argv[2], "w").write("running")
                time.sleep(0.01)
    """)
    ckpt, stamp = tmp_path / "ckpt", tmp_path / "stamp"
    proc = start(script, str(ckpt), str(stamp))
    try:
        wait_for_file(stamp, contains="running")
        proc.send_signal(signal.SIGINT)
        wait_for_file(stamp, contains="cleanup")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == ExitCode.SIGINT, err
    exits = [e for e in read_ledger(ckpt / "ledger.jsonl") if e["ev"] == "exit"]
    assert [(e["code"], e["ending"]) for e in exits] == [(130, "forced")]
