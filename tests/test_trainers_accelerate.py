"""Hugging Face Accelerate under `kempner-resilience accelerate launch`: a script written
Accelerate's documented way (``Accelerator``, ``prepare``, a loop), adopted in three lines,
on two gloo ranks started by accelerate's own launch command. Signals go where a user's go:
USR1 and SIGTERM to the launcher (what ``--signal=B:USR1`` and a preemption send), Ctrl+C to
its whole process group (a terminal). One uninterrupted run is the reference for the module.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from helpers import env, require
from trainers_helpers import (SCRIPTS, assert_same_final, committed_steps, interrupt,
                              last_steps, run_to_end, signal)
from kempner_resilience.exitcodes import ExitCode

require("accelerate")

STEPS = 40        # 16 batches an epoch on each rank: the stops fall mid-epoch


def _launch(work, *extra: str) -> list[str]:
    return [sys.executable, "-m", "kempner_resilience.cli", "accelerate", "launch", "--cpu",
            "--num_processes", "2", "--main_process_port", "0",
            str(SCRIPTS / "accelerate_train.py"), "--steps", str(STEPS),
            "--out", str(work / "final.pt"), "--progress", str(work / "progress"), *extra]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    work = tmp_path_factory.mktemp("accelerate_reference")
    code, out = run_to_end(work, _launch(work, "--step-s", "0"))
    assert code == 0, out[-4000:]
    return work / "final.pt"


def test_sigterm_ctrl_c_and_usr1_each_stop_every_rank_at_one_step_with_its_code_and_the_run_resumes_bitwise(
        tmp_path, reference):
    cmd = _launch(tmp_path)
    stops = [(6, signal.SIGTERM, False, 143), (17, signal.SIGINT, True, 130),
             (29, signal.SIGUSR1, False, int(ExitCode.REQUEUE))]
    for at, signum, group, expected in stops:
        code, out = interrupt(tmp_path, cmd, at, signum, group)
        assert code == expected, out[-4000:]
        last = last_steps(tmp_path / "progress")
        assert last[0] == last[1], last                          # one step on every rank
        assert committed_steps(tmp_path)[-1] == last[0] + 1, out[-4000:]
        assert "Traceback" not in out, out[-4000:]
    code, out = run_to_end(tmp_path, cmd)
    assert code == 0, out[-4000:]
    assert "resumed from" in out
    assert_same_final(reference, tmp_path / "final.pt")


def test_ctrl_c_with_a_reward_thread_pool_exits_130_within_the_grace_leaving_no_process(tmp_path):
    # Flow-Factory's case: a reward ThreadPoolExecutor holding tensors, Ctrl+C to the launch.
    cmd = _launch(tmp_path, "--rewards")
    t0 = time.monotonic()
    code, out = interrupt(tmp_path, cmd, 8, signal.SIGINT, group=True)
    assert code == 130, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert committed_steps(tmp_path), out[-4000:]
    assert time.monotonic() - t0 < 120          # the default grace (signals.grace_s)
    ranks = [int(p.read_text()) for p in tmp_path.glob("progress.pid*")]
    assert len(ranks) == 2
    assert [pid for pid in ranks if os.path.exists(f"/proc/{pid}")] == []


def test_cpu_with_several_processes_starts_that_many_gloo_ranks_not_one():
    from kempner_resilience.supervise.torchrun.accelerate import parse

    probe = ("import os; from kempner_resilience.supervise.torchrun.accelerate import parse;"
             "a = parse(['launch', '--cpu', '--num_processes', '2', 'train.py']);"
             "print(a.cpu, a.multi_gpu, os.environ['ACCELERATE_USE_CPU'])")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=env(), timeout=120)
    assert out.stdout.split() == ["False", "True", "true"], out.stderr[-2000:]
    assert parse(["launch", "--cpu", "train.py"]).cpu     # one process asked: left as it is


def test_the_package_imports_without_the_trainer_libraries():
    probe = ("import sys, kempner_resilience, kempner_resilience.trainers;"
             "print(sorted(m for m in ('accelerate', 'transformers', 'pytorch_lightning',"
             " 'lightning') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         env=env(), timeout=120)
    assert out.stdout.strip() == "[]", out.stderr[-2000:]


def test_the_rescue_snapshot_of_an_accelerated_loader_gives_back_its_state_dict_in_every_epoch():
    # The snapshot takes the epoch's generator states once per epoch, not at every boundary:
    # what it gives back must still be the position of that very boundary.
    from accelerate import Accelerator
    from torch.utils.data import DataLoader, TensorDataset

    from kempner_resilience.rescue.boundary import decode, encode
    from kempner_resilience.trainers.accelerate import AcceleratedLoader

    import torch

    loader = Accelerator(cpu=True).prepare(
        DataLoader(TensorDataset(torch.arange(12.0)), batch_size=4, shuffle=True))
    data = AcceleratedLoader(loader)
    for _ in range(7):                   # across two epoch ends (3 batches an epoch)
        next(data)
        back = decode(encode(0, {"data": data}))["objects"]["data"]
        want = data.state_dict()
        assert (back["epoch"], back["batch"]) == (want["epoch"], want["batch"])
        assert len(back["generators"]) == len(want["generators"])
        assert all(torch.equal(a, b) for a, b in zip(back["generators"], want["generators"]))
