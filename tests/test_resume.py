"""Exact resume through ResilientRun: interrupted by real signals, resumed in new processes.

The job (kempner_resilience.demo.train) has dropout, Adam, a step LR schedule and a seeded
shuffling data iterator; each launch is a fresh set of processes, as after a requeue.
With 2+ ranks the model is wrapped in DDP.
"""

import shutil

import pytest
import torch

from helpers import assert_bitwise_equal
from kempner_resilience.demo.launcher import LocalLauncher, train_command
from kempner_resilience.exitcodes import ExitCode


STEPS = 30


def run_job(tmp_path, name, ranks, steps, interrupts=None, extra=(), relaunch=None):
    work = tmp_path / name
    work.mkdir(exist_ok=True)
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


def test_usr1_interrupted_and_resumed_2_rank_run_ends_bitwise_equal_to_an_uninterrupted_one(
        tmp_path, reference):
    # One rank: test_two_interruptions_with_periodic_saves_still_end_bitwise_equal below, whose
    # first stop is this SIGUSR1 stop and resume, asserted the same way.
    ranks = 2
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
    launches, got, _ = run_job(tmp_path, "interrupted", 1, STEPS,
                               {6: "SIGUSR1", 17: "SIGTERM"},
                               extra=["checkpoint.every_steps=4"],
                               relaunch={ExitCode.REQUEUE, ExitCode.SIGTERM})
    # SIGTERM stops with 143; the launcher (like SLURM on preemption) runs the job again.
    assert [l.exit_code for l in launches][:2] == [ExitCode.REQUEUE, ExitCode.SIGTERM]
    # The SIGUSR1 stop: an emergency checkpoint of the stop step, which the next launch
    # resumes from and starts at (one rank's case of the 2-rank test above; by the end of this
    # longer run retention may have removed that checkpoint, so the resume proves it was there).
    stop = launches[0].report["stop_step"]
    assert launches[1].report["resumed_from"] == stop > 6
    assert launches[1].report["start_step"] == stop
    assert launches[0].report["saved_path"].endswith(f"step_{stop:09d}")
    assert launches[0].report["timings"]["emergency_save_s"] > 0
    assert_bitwise_equal(ref, got)


@pytest.fixture(scope="module")
def ddp_4_ranks_interrupted(tmp_path_factory):
    """4 DDP ranks interrupted by SIGUSR1 at step 8 and resumed (computed once per module)."""
    return run_job(tmp_path_factory.mktemp("ddp4"), "interrupted", 4, STEPS, {8: "SIGUSR1"})


@pytest.mark.slow
def test_usr1_interrupted_and_resumed_4_rank_ddp_run_ends_bitwise_equal_to_an_uninterrupted_one(
        ddp_4_ranks_interrupted, reference):
    # With 3+ ranks the ring all-reduce's order of additions depends on DDP's gradient bucket
    # layout, which DDP rebuilds after a process's first step: the resume must restore it.
    launches, got, _ = ddp_4_ranks_interrupted
    assert [l.exit_code for l in launches] == [ExitCode.REQUEUE, 0]
    assert launches[1].report["resumed_from"] == launches[0].report["stop_step"]
    assert_bitwise_equal(reference(4), got)


@pytest.mark.slow
def test_a_checkpoint_written_by_4_ddp_ranks_resumes_on_2(tmp_path, ddp_4_ranks_interrupted):
    launches, _, work = ddp_4_ranks_interrupted
    stop = launches[0].report["stop_step"]
    name = f"step_{stop:09d}"
    shutil.copytree(work / "ckpt" / name, tmp_path / "two" / "ckpt" / name)
    # A copied-in checkpoint belongs to another run (its run id): say that it is wanted.
    resumed, got, two = run_job(tmp_path, "two", 2, STEPS,
                                extra=["checkpoint.allow_other_run=true"])
    assert [l.exit_code for l in resumed] == [0]
    assert resumed[0].report["resumed_from"] == stop
    assert got is not None
    # The bucket layout saved by 4 ranks names the same parameters: it applies at 2 as well.
    assert "gradient bucket layout not restored" not in (two / "rank0.0.log").read_text()
