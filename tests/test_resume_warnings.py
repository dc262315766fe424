"""Every resume is exact or says why not (issue 31, items 2 and 3): the traps users fall into,
each found at run time and named in one line on rank 0, or made exact.

- a stop inside a gradient-accumulation window: the gradients are saved and put back, so the
  resumed run ends bitwise equal to an uninterrupted one (DDP ``no_sync`` windows, 2 ranks);
- an LR scheduler driving a saved optimizer but left out of the state: named;
- a ``ResumableLoader`` resumed with another batch size, dataset length or sampler: named (a
  batch size alone goes on from the same sample);
- a sampler whose RNG no checkpoint holds: named; a torch generator of any name: saved;
- a torch.Generator of the script's own that the loop draws from, left out of the state: named
  at the next save; put in the state, it is saved and set back;
- a script that never iterates ``run.steps()``: named at exit; batches taken from a loader
  before the checkpoint was restored into it: named;
- ``zip(data, run.steps(n))``, ``zip(run.steps(n), data)`` and a batch carried into the next
  step all resume bitwise (the saved position is the batches finished steps trained on);
- the quickstart's own lines on 2 ranks say nothing but the start line: asserted on the runs of
  tests/test_quickstart_adopt.py, which runs that script fresh and resumed anyway.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, TensorDataset

import kempner_resilience as kr
from checkpoint_helpers.launch import HERE
from helpers import assert_bitwise_equal, rank_logs
from kempner_resilience.checkpoint.carried import PendingGrads
from kempner_resilience.checkpoint.state import TrainState
from kempner_resilience.demo.launcher import LocalLauncher
from kempner_resilience.exitcodes import ExitCode

STEPS, SIGNAL_AT, PER_EPOCH = 25, 12, 10


def run_job(work: Path, *extra: str, launches: int = 3, ranks: int = 2):
    """(launches, rank 0's --out or None, each rank's seen samples) of carry_train.py."""
    work.mkdir(parents=True)
    out = work / "w.pt"
    cmd = [sys.executable, str(HERE / "carry_train.py"), "--ckpt", str(work / "ckpt"),
           "--out", str(out), *extra]
    done = LocalLauncher(cmd, ranks=ranks, workdir=work, max_launches=launches).run()
    seen = [(work / f"seen.rank{r}").read_text().splitlines()
            if (work / f"seen.rank{r}").exists() else [] for r in range(ranks)]
    return done, torch.load(out, weights_only=True) if out.exists() else None, seen


def warned(caplog) -> str:
    """What was logged at WARNING or above (an earlier in-process CLI test may have let INFO
    through: the loader's own info lines are no warning)."""
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING)


def ours(text: str, rank: int) -> list[str]:
    """The lines this package logged as ``rank``."""
    return [line for line in text.splitlines() if f"[rank {rank}]" in line]


# ----------------------------------------------------------------------- zip, either way

@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    launches, weights, seen = run_job(tmp_path_factory.mktemp("straight") / "job",
                                      "--steps", str(STEPS))
    assert [l.exit_code for l in launches] == [0]
    return weights, seen


@pytest.mark.slow
@pytest.mark.parametrize("loop", ["steps-first", "loader-first", "prefetch"])
def test_each_loop_order_interrupted_mid_epoch_resumes_bitwise(tmp_path, straight, loop):
    # zip(data, run.steps(n)) takes the batch of a step that the stop never runs; so does a
    # batch carried into the next step. Neither is counted as trained, so nothing is skipped.
    launches, weights, seen = run_job(tmp_path / loop, "--steps", str(STEPS), "--loop", loop,
                                      "--signal-at", str(SIGNAL_AT))
    assert [l.exit_code for l in launches] == [ExitCode.REQUEUE, 0], launches[-1].stderr_tail
    stop = launches[0].report["stop_step"]
    assert stop % PER_EPOCH != 0 and stop > PER_EPOCH, f"stopped at {stop}: not mid-epoch 2"
    assert seen == straight[1]           # every step the same samples as the straight run
    assert_bitwise_equal(straight[0], weights)


# ------------------------------------------------------------------ gradient accumulation

ACCUM = ("--accum", "4", "--no-sync", "--steps", "16")   # optim.step() at steps 3, 7, 11, 15


@pytest.fixture(scope="module")
def accumulated(tmp_path_factory):
    launches, weights, _ = run_job(tmp_path_factory.mktemp("accum") / "straight", *ACCUM)
    assert [l.exit_code for l in launches] == [0]
    return weights


@pytest.mark.slow
def test_a_stop_agreed_inside_a_no_sync_window_waits_for_its_end_and_resumes_bitwise(
        tmp_path, accumulated):
    # The signal comes during step 8: the agreed step falls inside the window of steps 8-11,
    # where the ranks drift apart (no collective); every rank stops at its end, step 12.
    launches, weights, _ = run_job(tmp_path / "job", *ACCUM, "--signal-at", "8")
    assert [l.exit_code for l in launches] == [ExitCode.REQUEUE, 0], launches[-1].stderr_tail
    assert launches[0].report["stop_step"] == 12
    said = ours(rank_logs(tmp_path / "job", 0), 0)
    assert [l for l in said if "inside a gradient-accumulation window" in l], "\n".join(said)
    assert_bitwise_equal(accumulated, weights)


@pytest.mark.slow
def test_a_stop_published_while_the_other_rank_ran_a_window_ahead_still_stops_both_at_its_end(
        tmp_path, accumulated):
    # Rank 0 dawdles in step 8, so rank 1 runs steps 9 and 10 (no collective) and checks for
    # a stop before rank 0 publishes one; it learns of it only after the window's closing
    # all-reduce, and must still stop at the window's end, step 12, with rank 0.
    launches, weights, _ = run_job(tmp_path / "job", *ACCUM, "--signal-at", "8",
                                   "--lag-s", "1.5")
    assert [l.exit_code for l in launches] == [ExitCode.REQUEUE, 0], launches[-1].stderr_tail
    assert launches[0].report["stop_step"] == 12
    assert_bitwise_equal(accumulated, weights)


@pytest.mark.slow
def test_a_single_rank_stops_inside_a_window_at_once_and_its_checkpoint_keeps_the_gradients(
        tmp_path):
    # One rank has nobody to drift from: no step of the signal's grace is spent on waiting for
    # the window's end (steps 8-11); the emergency checkpoint keeps the window's gradients.
    one = ("--accum", "4", "--steps", "16")
    straight, reference, _ = run_job(tmp_path / "straight", *one, ranks=1)
    assert [l.exit_code for l in straight] == [0]
    launches, weights, _ = run_job(tmp_path / "job", *one, "--signal-at", "8", ranks=1)
    assert [l.exit_code for l in launches] == [ExitCode.REQUEUE, 0], launches[-1].stderr_tail
    assert launches[0].report["stop_step"] in (9, 10, 11)
    assert_bitwise_equal(reference, weights)


@pytest.mark.slow
def test_a_checkpoint_saved_inside_a_window_keeps_its_gradients_and_resumes_bitwise(
        tmp_path, accumulated):
    # The periodic save at step 7 falls inside the window of steps 4-7; rank 0 is SIGKILLed
    # during step 9, and the relaunch resumes from step 7 with the window's gradients.
    launches, weights, _ = run_job(tmp_path / "job", *ACCUM, "--kill-at", "9", "--no-rescue")
    assert launches[-1].exit_code == 0 and len(launches) == 2, launches[-1].stderr_tail
    assert launches[1].report["resumed_from"] == 7
    said = ours(rank_logs(tmp_path / "job", 0), 0)
    assert [l for l in said if "the checkpoint keeps them" in l], "\n".join(said)
    assert_bitwise_equal(accumulated, weights)


def test_gradients_a_step_before_the_run_left_behind_are_not_pending():
    # A warm-up step taken before the state was wrapped: its gradients are no accumulation
    # window of the run (no warning, nothing extra in the checkpoint, no stop waiting).
    model = nn.Linear(4, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    grads = PendingGrads({"optim": optim})
    assert grads.pending() == {}


def test_gradients_a_finished_step_leaves_behind_are_not_pending():
    # zero_grad() at the start of the next step (the quickstart's loop): at the boundary the
    # gradients are the ones the optimizer applied; nothing is saved, nothing is said.
    model = nn.Linear(4, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = PendingGrads({"optim": optim})
    for _ in range(2):
        optim.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        optim.step()
    assert grads.pending() == {}
    model(torch.randn(2, 4)).sum().backward()      # one micro-batch of the next window
    assert set(grads.pending()) == {"optim"}
    optim.zero_grad(set_to_none=False)              # zeros in place: nothing to keep
    assert grads.pending() == {}


def test_a_window_reaching_only_the_middle_of_a_large_model_is_pending():
    # The post-step hook notes a few sentinel gradients only (O(1) per step); they are picked
    # among the parameters that get gradients, so a window through the unfrozen middle layers
    # of 400 (the first and last 100 frozen) is still seen, and all its gradients are kept.
    model = nn.ModuleList([nn.Linear(2, 1) for _ in range(400)])
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for layer in [*model[:100], *model[300:]]:
        layer.requires_grad_(False)
    grads = PendingGrads({"optim": optim})
    x = torch.randn(3, 2)

    def backward() -> None:
        sum(layer(x).sum() for layer in model).backward()

    for _ in range(2):
        optim.zero_grad()
        backward()
        optim.step()
    assert grads.pending() == {}
    backward()                                      # one micro-batch of the next window
    got = grads.pending()["optim"]
    assert sorted(got) == list(range(200, 600))     # every unfrozen tensor, nothing else
    params = list(model.parameters())
    assert all(torch.equal(got[i], params[i].grad) for i in got)


def test_the_first_window_of_a_fresh_run_is_pending_before_any_step():
    # No gradient at set-up: the sentinels cannot be chosen among the parameters that get one
    # (here one layer of 100 trains), so the check looks at all of them.
    model = nn.ModuleList([nn.Linear(2, 1) for _ in range(100)])
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    for i, layer in enumerate(model):
        layer.requires_grad_(i == 10)
    grads = PendingGrads({"optim": optim})
    sum(layer(torch.randn(3, 2)).sum() for layer in model).backward()
    assert sorted(grads.pending()["optim"]) == [20, 21]


def test_gradients_a_resume_put_back_stay_pending_until_the_next_step():
    # A stop right after the resume (before any backward) saves them again, not drops them.
    model = nn.Linear(4, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    grads = PendingGrads({"optim": optim})
    saved = {"optim": {0: torch.ones(1, 4), 1: torch.ones(1)}}
    grads.restore(saved)
    assert {i: g.tolist() for i, g in grads.pending()["optim"].items()} == \
        {0: [[1.0] * 4], 1: [1.0]}
    optim.step()
    assert grads.pending() == {}


def test_saving_a_stateless_optimizer_leaves_no_gradient_pending():
    # Plain SGD has no state: each save's get_optimizer_state_dict makes one up with a step of
    # zero gradients. That step is torch's, not the loop's: the real gradients stay applied.
    model = nn.Linear(4, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainState({"model": model, "optim": optim})
    for step in range(3):
        optim.zero_grad()
        model(torch.randn(2, 4)).sum().backward()
        optim.step()
        state.capture(step + 1, 0)
        assert state.grads.pending() == {}


# ---------------------------------------------------------------------------- schedulers

@pytest.mark.slow
def test_a_scheduler_left_out_of_the_state_is_named_once_on_rank_0(tmp_path):
    launches, _, _ = run_job(tmp_path / "job", "--steps", "3", "--case", "unsaved-sched",
                             launches=1)
    assert [l.exit_code for l in launches] == [0]
    logs = rank_logs(tmp_path / "job", 0)
    named = [l for l in ours(logs, 0) if "LR scheduler" in l]
    assert len(named) == 1 and "'optim'" in named[0], logs
    assert ours(logs, 1) == []


def test_a_scheduler_in_the_state_or_held_by_a_state_object_draws_no_warning(caplog):
    model = nn.Linear(4, 1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=3)

    class Schedules:                     # a scheduler kept inside an object of the user's
        def __init__(self) -> None:
            self.sched = sched

        def state_dict(self) -> dict:
            return self.sched.state_dict()

        def load_state_dict(self, sd: dict) -> None:
            self.sched.load_state_dict(sd)

    for held in (sched, Schedules()):
        TrainState({"model": model, "optim": optim, "sched": held}).loop_starts()
    assert warned(caplog) == ""
    TrainState({"model": model, "optim": optim}).loop_starts()
    assert "LR scheduler drives optimizer 'optim'" in caplog.text


# ----------------------------------------------------------------------- loop never entered

@pytest.mark.slow
def test_a_script_that_never_iterates_the_steps_is_named_at_exit(tmp_path):
    launches, _, _ = run_job(tmp_path / "job", "--steps", "3", "--case", "no-loop", launches=1)
    assert [l.exit_code for l in launches] == [0]
    logs = rank_logs(tmp_path / "job", 0)
    assert [l for l in ours(logs, 0) if "without iterating run.steps()" in l], logs
    assert ours(logs, 1) == []
    assert not list((tmp_path / "job" / "ckpt").glob("step_*"))


# ---------------------------------------------------------------------------- data loaders

DATA = TensorDataset(torch.arange(40))


def loader(batch: int = 4, data=DATA, sampler=None) -> kr.ResumableLoader:
    torch.manual_seed(0)
    return kr.ResumableLoader(DataLoader(data, batch_size=batch,
                                         sampler=sampler or RandomSampler(data)))


def saved_after(batches: int, **kw) -> dict:
    data = loader(**kw)
    for _ in range(batches):
        next(data)
    return data.state_dict()


def test_batches_taken_ahead_across_an_epoch_end_are_taken_again_at_resume():
    # Two batches taken before the loop's first step (carried ahead); the stop comes when the
    # loader has started the next epoch: its saved position falls back into the epoch before.
    straight = loader()
    order = [next(straight)[0] for _ in range(14)]
    first = loader()
    ahead = [next(first), next(first)]
    first.loop_starts()
    for _ in range(9):
        next(first)                     # 11 taken: epoch 1 has begun; 9 trained
    resumed = loader()
    resumed.load_state_dict(first.state_dict())
    resumed.loop_starts()
    assert ahead and resumed.epoch == 0 and resumed.batch == 9
    assert_bitwise_equal(order[9:14], [next(resumed)[0] for _ in range(5)])


def test_a_loader_resumed_with_another_batch_size_is_named_and_goes_on_from_the_same_sample(
        caplog):
    order = torch.cat([next(loader(batch=40))[0]])     # the epoch's order, in one batch
    resumed = loader(batch=2)
    resumed.load_state_dict(saved_after(3, batch=4))    # 12 samples trained
    assert "batch size 4 -> 2" in caplog.text
    assert torch.equal(next(resumed)[0], order[12:14])


def test_a_loader_resumed_over_a_dataset_of_another_length_is_named(caplog):
    resumed = loader(data=TensorDataset(torch.arange(48)))
    resumed.load_state_dict(saved_after(3))
    assert "dataset length 40 -> 48" in caplog.text


def test_a_loader_resumed_with_another_sampler_is_named(caplog):
    resumed = loader(sampler=DistributedSampler(DATA, num_replicas=2, rank=0, shuffle=False))
    resumed.load_state_dict(saved_after(3, sampler=DistributedSampler(
        DATA, num_replicas=2, rank=0, shuffle=True)))
    assert "DistributedSampler.shuffle True -> False" in caplog.text


def test_batches_taken_before_the_checkpoint_was_restored_are_named(caplog):
    # A batch taken before `with ResilientRun(...)` came from the start, not from the resume.
    data = loader()
    next(data)
    data.load_state_dict(saved_after(3))
    assert "handed out 1 batch(es) before the checkpoint was restored" in caplog.text


def test_a_loader_resumed_as_it_was_saved_says_nothing(caplog):
    loader().load_state_dict(saved_after(3))
    assert warned(caplog) == ""


class NumpyShuffle(torch.utils.data.Sampler):
    def __init__(self, n: int) -> None:
        self.n, self.rng = n, np.random.default_rng(0)

    def __iter__(self):
        return iter(self.rng.permutation(self.n).tolist())

    def __len__(self) -> int:
        return self.n


class GlobalShuffle(NumpyShuffle):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        return iter(torch.randperm(self.n).tolist())


class OwnGenerator(NumpyShuffle):
    def __init__(self, n: int) -> None:
        self.n, self.rng = n, torch.Generator().manual_seed(3)

    def __iter__(self):
        return iter(torch.randperm(self.n, generator=self.rng).tolist())


def test_a_sampler_shuffling_with_a_numpy_rng_is_named(caplog):
    loader(sampler=NumpyShuffle(40))
    assert "NumpyShuffle.rng (numpy Generator)" in caplog.text


def test_a_sampler_drawing_from_the_global_rng_is_named_when_its_epoch_starts(caplog):
    data = loader(sampler=GlobalShuffle(40))
    assert warned(caplog) == ""
    next(data)
    assert "draws from a global RNG" in caplog.text


def test_a_sampler_with_a_torch_generator_of_any_name_resumes_the_same_order(caplog):
    ref = loader(sampler=OwnGenerator(40))
    straight = [next(ref)[0] for _ in range(15)]       # into the second epoch
    resumed = loader(sampler=OwnGenerator(40))
    resumed.load_state_dict(saved_after(12, sampler=OwnGenerator(40)))
    assert_bitwise_equal(straight[12:], [next(resumed)[0] for _ in range(3)])
    assert warned(caplog) == ""


def test_a_resumable_loader_in_the_state_draws_no_warning(caplog):
    # The quickstart's own line used to warn on every rank that it should be wrapped.
    TrainState({"data": kr.ResumableLoader(DataLoader(DATA, sampler=DistributedSampler(
        DATA, num_replicas=1, rank=0)))})
    assert warned(caplog) == ""


# ------------------------------------------------------------------- the script's generators

def draw_noise(state: TrainState, noise: torch.Generator, step: int) -> torch.Tensor:
    """One step that draws input noise from ``noise``, then a save of ``step``."""
    x = torch.randn(4, generator=noise)
    state.capture(step, 0)
    return x


def test_a_generator_the_loop_draws_from_left_out_of_the_state_is_named_at_the_next_save(
        caplog):
    noise = torch.Generator().manual_seed(1234)       # the script's own, not in the state
    state = TrainState({"model": nn.Linear(4, 1)})
    state.loop_starts()
    state.capture(0, 0)
    assert warned(caplog) == ""                       # not drawn from yet: nothing to lose
    draw_noise(state, noise, 1)
    draw_noise(state, noise, 2)
    named = [r.getMessage() for r in caplog.records if "torch.Generator" in r.getMessage()]
    assert len(named) == 1, named
    assert "'noise' (test_resume_warnings.py) is drawn from in the loop but is not in the " \
        "state" in named[0] and "state={..., 'noise': noise}" in named[0]


def test_a_generator_in_the_state_is_saved_and_set_back_at_resume_and_not_named(caplog):
    noise = torch.Generator().manual_seed(1234)
    state = TrainState({"model": nn.Linear(4, 1), "noise": noise})
    state.loop_starts()
    draw_noise(state, noise, 1)
    saved = state.capture(2, 0)
    straight = torch.randn(4, generator=noise)
    again = torch.Generator().manual_seed(9)
    resumed = TrainState({"model": nn.Linear(4, 1), "noise": again})
    resumed.restore(saved, "rank_state.rank0")
    assert torch.equal(torch.randn(4, generator=again), straight)
    assert warned(caplog) == ""


def test_a_generator_a_resumable_loader_or_a_state_object_saves_is_not_named(caplog):
    shuffle = torch.Generator().manual_seed(1)        # given to the loader: the loader saves it
    data = kr.ResumableLoader(DataLoader(DATA, batch_size=4, shuffle=True, generator=shuffle))
    noise = torch.Generator().manual_seed(2)

    class Noise:                                      # an object of the user's that saves it
        def state_dict(self) -> dict:
            return {"rng": noise.get_state()}

        def load_state_dict(self, sd: dict) -> None:
            noise.set_state(sd["rng"])

    state = TrainState({"model": nn.Linear(4, 1), "data": data, "noise": Noise()})
    state.loop_starts()
    for step in range(1, 12):                         # into the loader's second epoch
        next(data)
        draw_noise(state, noise, step)
    assert warned(caplog) == ""
