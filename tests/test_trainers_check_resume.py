"""`kempner-resilience check-resume` on the adopted trainer scripts (tests/trainer_scripts/).

check-resume starts the ranks itself (``supervise/local/launcher.py``: RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT, as torchrun sets them), so a script is given as ``python train.py``, not
under its library's launcher: the HF Trainer and Lightning take that environment as torchrun's;
Accelerate takes it too, and on a machine without CUDA it needs ``ACCELERATE_USE_CPU=1`` (what
``accelerate launch --cpu`` sets). Each adopted script is found exact; one variant per library
that cannot resume exactly is found out, with its cause named. Each test is one check-resume
(several launches of a script): once per library and verdict.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import env, require, run_script
from trainers_helpers import SCRIPTS
from kempner_resilience.exitcodes import ExitCode

pytestmark = pytest.mark.slow

SCRIPT = {"accelerate": "accelerate_train.py", "hf": "hf_train.py",
          "lightning": "lightning_train.py"}
MODULE = {"accelerate": "accelerate", "hf": "transformers", "lightning": "pytorch_lightning"}
CPU_RANKS = {"accelerate": {"ACCELERATE_USE_CPU": "1"}, "hf": {}, "lightning": {}}


def check_resume(tmp_path: Path, library: str, *script_args: str, ranks: int = 2,
                 steps: str = "9", at: str = "3,6", **extra_env: str
                 ) -> subprocess.CompletedProcess:
    """check-resume on the library's adopted script, run from ``tmp_path`` as a user would."""
    require(MODULE[library])
    cmd = [sys.executable, "-m", "kempner_resilience.cli", "check-resume", "--ranks",
           str(ranks), "--steps", steps, "--interrupt-at", at, "--timeout", "150",
           "--workdir", str(tmp_path / "check"), "--", sys.executable,
           str(SCRIPTS / SCRIPT[library]), "--step-s", "0", *script_args]
    return run_script(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=600,
                      env=env(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                              TOKENIZERS_PARALLELISM="false", **extra_env))


def said(proc: subprocess.CompletedProcess) -> str:
    """The verdict, with stderr attached for a failing assertion's message."""
    return proc.stdout + "\n--- stderr:\n" + proc.stderr[-3000:]


def causes(proc: subprocess.CompletedProcess) -> str:
    """The verdict's "Likely cause" section, its lines joined into one text."""
    tail = proc.stdout.split("Likely cause:", 1)[-1]
    return " ".join(line.strip() for line in tail.splitlines()).strip()


@pytest.mark.parametrize("library", ["accelerate", "hf"])
def test_each_adopted_trainer_script_on_two_ranks_is_found_exact(tmp_path, library):
    # Exact from the signal's stops and from the survivors' rescue after rank 1's SIGKILL.
    proc = check_resume(tmp_path, library, **CPU_RANKS[library])
    assert proc.returncode == int(ExitCode.OK), said(proc)
    assert proc.stdout.startswith("check-resume: exact."), said(proc)
    assert "SIGKILLed at step(s) 3 and resumed from the survivors' rescue checkpoint" in \
        proc.stdout.replace("\n  ", " "), said(proc)


def test_the_lightning_script_is_exact_but_a_lost_rank_is_not_rescued_and_the_report_says_why(
        tmp_path):
    # Lightning runs forward and backward inside optimizer.step(closure): a peer lost in the
    # backward's all-reduce finds the survivor inside an optimizer step, and the rescue, which
    # writes only a boundary's state, declines. A real job then loses the steps since its last
    # checkpoint: the default check on 2 ranks is exact and says so.
    proc = check_resume(tmp_path, "lightning")
    assert proc.returncode == 0, said(proc)
    out = proc.stdout.replace("\n    ", " ").replace("\n  ", " ")
    assert "a lost rank is not rescued in this script" in out, said(proc)
    assert "rescue skipped: an optimizer step was in progress" in out, said(proc)


def test_a_trainer_with_ignore_data_skip_is_found_inexact_and_the_setting_named(tmp_path):
    proc = check_resume(tmp_path, "hf", "--ignore-data-skip", ranks=1, at="3")
    assert proc.returncode == int(ExitCode.RESUME_INEXACT), said(proc)
    assert "from step 4 on" in proc.stdout, said(proc)         # the first step after the stop
    assert causes(proc).startswith(
        "- the run said: TrainingArguments(ignore_data_skip=True): the Trainer starts the "
        "resumed epoch from its first batch"), said(proc)


def test_a_lightning_loader_that_cannot_resume_mid_epoch_is_refused_before_a_step_and_named(
        tmp_path):
    proc = check_resume(tmp_path, "lightning", "--iterable", at="3")
    assert proc.returncode == int(ExitCode.RESUME_UNCHECKED), said(proc)
    assert "the train DataLoader cannot resume mid-epoch here: an IterableDataset" \
        in proc.stdout, said(proc)
    assert "StatefulDataLoader" in proc.stdout, said(proc)
    assert not list((tmp_path / "check").rglob("step_*")), "a refused run wrote a checkpoint"


def test_an_accelerate_scheduler_left_out_of_state_is_found_by_the_learning_rate_and_named(
        tmp_path):
    # One process: Accelerate shards nothing, the loader's RandomSampler has no generator of
    # its own; equal up to step 6 shows that the adapter seeded it (the epoch is not drawn
    # again from the global RNG at the resume), and the scheduler alone differs from step 7.
    proc = check_resume(tmp_path, "accelerate", "--sched-outside-state", ranks=1, steps="9",
                        at="3")
    assert proc.returncode == int(ExitCode.RESUME_INEXACT), said(proc)
    assert "from step 7 on" in proc.stdout, said(proc)      # StepLR(step_size=7) restarted
    first = proc.stdout.split("At step 7, the first that differs:", 1)[1].split("At step")[0]
    assert "optim.param_groups.0.lr: 0.005 vs 0.01" in first and "model" not in first, \
        said(proc)
    assert causes(proc).startswith("- the run said: an LR scheduler drives optimizer 'optim' "
                                   "but is not in the state"), said(proc)


def test_accelerate_ranks_without_cuda_or_accelerate_use_cpu_are_refused_naming_it(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("with CUDA, Accelerate takes the launcher's ranks as GPU ranks")
    proc = check_resume(tmp_path, "accelerate", at="3", ACCELERATE_USE_CPU="false")
    assert proc.returncode == int(ExitCode.RESUME_UNCHECKED), said(proc)
    assert "the Accelerator runs as 1 process" in proc.stdout, said(proc)
    assert "set ACCELERATE_USE_CPU=1" in proc.stdout, said(proc)


def test_a_trainer_stopped_at_an_eval_step_resumes_after_that_eval_exactly(tmp_path):
    # The Trainer evaluates after a step's on_step_end: the stop at step 3 waits for step 3's
    # eval (which draws from the global RNG and appends to log_history), so the resumed run
    # neither skips it nor repeats it. The adapter also tells the run of each eval, so the
    # check's stops cross one.
    proc = check_resume(tmp_path, "hf", "--eval-every", "3", ranks=1, steps="9", at="3")
    assert proc.returncode == int(ExitCode.OK), said(proc)
    out = proc.stdout.replace("\n  ", " ")
    assert "Its stops crossed the eval" in out, said(proc)
