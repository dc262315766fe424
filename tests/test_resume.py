"""Exact resume through ResilientRun: interrupted by real signals, resumed in new processes.

The job (kempner_resilience.demo.train) has dropout, Adam, a step LR schedule and a seeded
shuffling data iterator; each launch is a fresh set of processes, as after a requeue.
"""

import pytest
import torch

from helpers import assert_bitwise_equal
from kempner_resilience.demo.launcher import LocalLauncher, train_command
from kempner_resilience.exitcodes import ExitCode


STEPS = 30


def run_job(tmp_path, name, ranks, steps, interrupts=None, extra=(), relaunch=None):
    work = tmp_path / name
    work.mkdir()
    out = work / "weights.pt"
    cmd = train_command(steps, step_time=0.02, out=out,
                        overrides=[f"checkpoint.dir={work / 'ckpt'}", "signals.grace_s=60",
                                   "watchdog.hang_timeout_s=120", *extra])
    kw = {} if relaunch is None else {"relaunch_codes": relaunch}
    launches = LocalLauncher(cmd, ranks=ranks, workdir=work, interrupts=interrupts,
                             max_launches=5, **kw).run()
    return launches, torch.load(out, weights_only=True) if out.exists() else None, work


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Final state of uninterrupted runs, by rank count (computed once per module)."""
    cache = {}

    def get(ranks):
        if ranks not in cache:
            launches, ref, _ = run_job(tmp_path_factory.mktemp("ref"), "straight", ranks, STEPS)
            assert [l.exit_code for l in launches] == [0]
            cache[ranks] = ref
        return cache[ranks]
    return get


@pytest.mark.parametrize("ranks", [1, 2])
def test_usr1_interrupted_and_resumed_run_ends_bitwise_equal_to_an_uninterrupted_one(
        tmp_path, ranks, reference):
    ref = reference(ranks)
    launches, got, work = run_job(tmp_path, "interrupted", ranks, STEPS, {8: "SIGUSR1"})
    assert [l.exit_code for l in launches] == [ExitCode.REQUEUE, 0]
    stop = launches[0].report["stop_step"]
    assert launches[1].report["resumed_from"] == stop > 8
    assert launches[1].report["start_step"] == stop
    assert (work / "ckpt" / f"step_{stop:09d}").is_dir()
    assert launches[0].report["saved_path"].endswith(f"step_{stop:09d}")
    assert launches[0].report["timings"]["emergency_save_s"] > 0
    assert_bitwise_equal(ref, got)


def test_two_interruptions_with_periodic_saves_still_end_bitwise_equal(tmp_path, reference):
    ref = reference(1)
    launches, got, _ = run_job(tmp_path, "interrupted", 1, STEPS, {6: "SIGUSR1", 17: "SIGTERM"},
                               extra=["checkpoint.every_steps=4"],
                               relaunch={ExitCode.REQUEUE, ExitCode.SIGTERM})
    # SIGTERM stops with 143; the launcher (like SLURM on preemption) runs the job again.
    assert [l.exit_code for l in launches][:2] == [ExitCode.REQUEUE, ExitCode.SIGTERM]
    assert_bitwise_equal(ref, got)
