"""`kempner-resilience check-resume` on the scripts users actually write (issue 31 item 1).

Each test runs the verb as a user would, as a subprocess, on a real script: the script runs on
real local ranks (gloo on CPU), is stopped by a real signal at the chosen steps, relaunched from
its real DCP checkpoints, and the verb's verdict, exit code and words are asserted. The scripts
are small but shaped like the real thing: the quickstart's own adoption example, a GPT-like
model trained as nanoGPT's loop trains it (a batch prefetched at the end of each step and
carried into the next), a gradient-accumulation loop, an LR scheduler left out of ``state``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.utils.data import DataLoader, TensorDataset

import kempner_resilience as kr
from adopt_helpers import doc_example
from helpers import env, run_script, write_script
from kempner_resilience.checkpoint.state import TrainState
from kempner_resilience.checkresume.compare import diff_snapshots
from kempner_resilience.checkresume.diagnose import likely_causes
from kempner_resilience.checkresume.snapshot import Kind, Snapshot, read_snapshot
from kempner_resilience.exitcodes import ExitCode


def check_resume(tmp_path: Path, script: Path, *args: str,
                 timeout: str = "100") -> subprocess.CompletedProcess:
    """The verb on ``script``, run from ``tmp_path`` as a user would; its work directory kept
    under ``tmp_path`` (the checkpoints and rank logs of both runs)."""
    return run_script(
        [sys.executable, "-m", "kempner_resilience.cli", "check-resume", "--workdir",
         str(tmp_path / "check"), "--timeout", timeout, *args, "--", sys.executable,
         str(script)],
        cwd=tmp_path, env=env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
        timeout=400)


def verdict(proc: subprocess.CompletedProcess) -> str:
    """The report on stdout, with stderr attached for a failing assertion's message."""
    return proc.stdout + "\n--- stderr:\n" + proc.stderr[-3000:]


# A GPT-like model trained as nanoGPT's train.py trains it (written here, not copied): token and
# position embeddings, causal self-attention blocks, AdamW, batches drawn with torch.randint from
# one token array, and the next batch fetched at the end of each step while the current one's
# backward runs. The adoption is the obvious +3/-1: the import, the `with` around the loop, the
# loop over run.steps instead of `while True`; model and optimizer in state, the carried batch
# (X, Y) not.
NANOGPT_SHAPED = """
import kempner_resilience as kr
import torch
from torch import nn
from torch.nn import functional as F

torch.manual_seed(1337)
vocab, block_size, batch_size, n_embd, n_head = 48, 16, 4, 32, 4
data = torch.randint(0, vocab, (4096,))


def get_batch():
    ix = torch.randint(len(data) - block_size, (batch_size,))
    x = torch.stack([data[i:i + block_size] for i in ix])
    y = torch.stack([data[i + 1:i + 1 + block_size] for i in ix])
    return x, y


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.attn(self.ln1(x)).split(n_embd, dim=2)
        q, k, v = (t.view(B, T, n_head, C // n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).contiguous().view(B, T, C))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, n_embd), nn.Embedding(block_size, n_embd)
        self.blocks = nn.Sequential(Block(), Block())
        self.ln_f, self.lm_head = nn.LayerNorm(n_embd), nn.Linear(n_embd, vocab, bias=False)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1])
        x = self.ln_f(self.blocks(self.wte(idx) + self.wpe(pos)))
        logits = self.lm_head(x)
        return logits, F.cross_entropy(logits.view(-1, vocab), targets.view(-1))


model = GPT()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
max_iters = 5000
X, Y = get_batch()  # fetch the very first batch
with kr.ResilientRun(state={"model": model, "optim": optimizer}) as run:
    for iter_num in run.steps(max_iters):
        logits, loss = model(X, Y)
        X, Y = get_batch()  # prefetch the next batch while the model is busy
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
"""

# Gradients accumulated over ACCUM steps of run.steps, the optimizer stepping at each window's
# end; the data is indexed by the step, so nothing but the gradients is carried across steps.
GRAD_ACCUMULATION = """
import kempner_resilience as kr
import torch
from torch import nn

ACCUM = 4
torch.manual_seed(0)
xs, ys = torch.randn(64, 8), torch.randn(64, 1)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
with kr.ResilientRun(state={"model": model, "optim": optim}) as run:
    for step in run.steps(1000):
        i = step % 64
        loss = nn.functional.mse_loss(model(xs[i:i + 1]), ys[i:i + 1]) / ACCUM
        loss.backward()
        if (step + 1) % ACCUM == 0:
            optim.step()
            optim.zero_grad()
"""

# An LR scheduler created in the script and stepped every step, but not in state.
SCHEDULER_LEFT_OUT = """
import kempner_resilience as kr
import torch
from torch import nn

torch.manual_seed(0)
xs, ys = torch.randn(64, 8), torch.randn(64, 1)
model = nn.Linear(8, 1)
optim = torch.optim.SGD(model.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s))
with kr.ResilientRun(state={"model": model, "optim": optim}) as run:
    for step in run.steps(1000):
        i = step % 64
        optim.zero_grad()
        nn.functional.mse_loss(model(xs[i:i + 8]), ys[i:i + 8]).backward()
        optim.step()
        sched.step()
"""


def test_the_quickstart_adoption_example_on_two_ranks_resumes_exactly(tmp_path):
    _, after = doc_example("quickstart.md", "### Adopting an existing DDP script", "\n#")
    script = write_script(tmp_path, after, "train.py")
    proc = check_resume(tmp_path, script, "--ranks", "2", "--steps", "6", "--interrupt-at", "3")
    # Its loader's first epoch end is at step 64: a second interrupted run stops just after it
    # and trains past the next one, and the whole is exact.
    assert proc.returncode == 0, verdict(proc)
    assert "stopped by SIGUSR1 at step(s) 3 and resumed" in proc.stdout, verdict(proc)
    assert "epoch end" in proc.stdout, verdict(proc)


def test_the_quickstart_example_resumes_exactly_from_the_rescue_after_a_rank_is_killed(tmp_path):
    _, after = doc_example("quickstart.md", "### Adopting an existing DDP script", "\n#")
    script = write_script(tmp_path, after, "train.py")
    proc = check_resume(tmp_path, script, "--ranks", "2", "--steps", "6", "--interrupt-at", "3",
                        "--kill-rank", "1", "--max-steps", "6")
    # Exact for every step compared; its loader's first epoch end (step 64) is beyond
    # --max-steps, so the verdict says so with its own code, never a plain 0.
    assert proc.returncode == ExitCode.RESUME_NOT_COVERED, verdict(proc)
    assert "not covered: the epoch end of 'data' at step 64" in proc.stdout, verdict(proc)
    assert "exact for steps 3-6" in proc.stdout, verdict(proc)
    assert "with rank 1 SIGKILLed at step(s) 3 and resumed" in proc.stdout, verdict(proc)
    # The interrupted run commits only its stops: step 3 is the survivors' rescue checkpoint.
    log = (tmp_path / "check" / "interrupted" / "logs" / "rank0.0.log").read_text()
    assert "rescue: committed step 3" in log


def test_a_nanogpt_shaped_adoption_carrying_a_prefetched_batch_is_reported_inexact(tmp_path):
    script = write_script(tmp_path, NANOGPT_SHAPED, "train.py")
    proc = check_resume(tmp_path, script, "--steps", "6", "--interrupt-at", "3")
    assert proc.returncode == ExitCode.RESUME_INEXACT, verdict(proc)
    out = proc.stdout
    assert "from step 4 on (1 step(s) after the stop at step 3)" in out, verdict(proc)
    first = out.split("At step 4, the first that differs:", 1)[1].split("Likely cause:")[0]
    # The effect of the carried batch: the first step after the resume trained on another batch,
    # so weights and AdamW's moments differ, while the RNG streams and the step are equal.
    assert "model (model)" in first and "optim (optimizer)" in first, verdict(proc)
    assert "max abs diff" in first and "rng" not in first, verdict(proc)
    assert "a variable carried from one step to the next is not in state (a prefetched batch" \
        in out.replace("\n    ", " "), verdict(proc)


@pytest.fixture(scope="module")
def accumulation_check(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """The check of GRAD_ACCUMULATION stopped at step 6, run once for the tests below, with a
    relative --workdir (./check) as a user types it: its folder and the verb's answer."""
    tmp_path = tmp_path_factory.mktemp("accumulation")
    script = write_script(tmp_path, GRAD_ACCUMULATION, "train.py")
    proc = run_script(
        [sys.executable, "-m", "kempner_resilience.cli", "check-resume", "--workdir", "check",
         "--timeout", "100", "--steps", "10", "--interrupt-at", "6", "--", sys.executable,
         str(script)],
        cwd=tmp_path, env=env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
        timeout=400)
    return tmp_path, proc


def test_a_stop_inside_a_gradient_accumulation_window_is_exact(accumulation_check):
    # The stop at step 6 cuts the window of steps 4-7. Before issue 31's run-time fix the
    # accumulated gradients were lost and the window's optimizer step (at step 8) used two
    # micro-batches of four (check-resume said so: "gradient-accumulation window cut by the
    # stop"). Now the checkpoint keeps them (one rank), and the verdict is exact.
    _, proc = accumulation_check
    assert proc.returncode == ExitCode.OK, verdict(proc)
    assert proc.stdout.startswith("check-resume: exact."), verdict(proc)


def test_a_relative_workdir_is_the_check_s_own_directory_and_the_verdict_exact(
        accumulation_check):
    tmp_path, proc = accumulation_check
    assert proc.returncode == ExitCode.OK, verdict(proc)
    assert proc.stdout.startswith("check-resume: exact."), verdict(proc)
    assert list((tmp_path / "check").rglob("step_*")), "the runs wrote nothing under ./check"


def test_an_lr_scheduler_left_out_of_state_is_reported_inexact_naming_the_scheduler(tmp_path):
    script = write_script(tmp_path, SCHEDULER_LEFT_OUT, "train.py")
    proc = check_resume(tmp_path, script, "--steps", "6", "--interrupt-at", "3")
    assert proc.returncode == ExitCode.RESUME_INEXACT, verdict(proc)
    out = proc.stdout.replace("\n    ", " ")
    first = out.split("At step 4, the first that differs:", 1)[1].split("At step")[0]
    # Right after the resume only the learning rate differs: the restored optimizer kept the
    # right lr for one step, then the restarted scheduler set its own.
    assert re.search(r"optim\.param_groups\.0\.lr: [0-9.]+ vs [0-9.]+", first), verdict(proc)
    assert "model" not in first.split("Likely cause:")[0], verdict(proc)
    assert "an LR scheduler not in state" in out, verdict(proc)
    # The run's own warning measured it: passed on word for word, first.
    assert "the run said: an LR scheduler drives optimizer 'optim' but is not in the state" \
        in out, verdict(proc)


def test_a_script_that_never_commits_a_checkpoint_is_unchecked_with_its_own_code(tmp_path):
    script = write_script(tmp_path, """
        import kempner_resilience as kr
        import torch

        model = torch.nn.Linear(2, 2)
        with kr.ResilientRun(state={"model": model}) as run:
            pass                          # the loop was never written
    """, "train.py")
    proc = check_resume(tmp_path, script, "--steps", "4", "--interrupt-at", "2")
    assert proc.returncode == ExitCode.RESUME_UNCHECKED, verdict(proc)
    assert "committed no checkpoint" in proc.stdout, verdict(proc)


def test_a_script_whose_step_hangs_is_stopped_at_the_timeout_and_unchecked(tmp_path):
    script = write_script(tmp_path, """
        import time
        import kempner_resilience as kr
        import torch

        model = torch.nn.Linear(2, 2)
        with kr.ResilientRun(state={"model": model}) as run:
            for step in run.steps(100):
                if step == 2:
                    time.sleep(3600)      # a step that never ends
    """, "train.py")
    proc = check_resume(tmp_path, script, "--steps", "6", "--interrupt-at", "3", timeout="8")
    assert proc.returncode == ExitCode.RESUME_UNCHECKED, verdict(proc)
    assert "the interrupted run did not end within --timeout 8 s" in proc.stdout, verdict(proc)
    assert subprocess.run(["pgrep", "-f", str(script)], capture_output=True).stdout == b""


def test_interrupts_too_close_for_the_ranks_agreement_are_a_usage_error(tmp_path):
    script = write_script(tmp_path, "print('never run')\n", "train.py")
    proc = check_resume(tmp_path, script, "--ranks", "2", "--steps", "6", "--interrupt-at",
                        "3,4")
    assert proc.returncode == ExitCode.USAGE, verdict(proc)
    assert "at least 3 apart" in proc.stderr
    assert not (tmp_path / "check").exists()


def test_a_wrong_command_line_is_answered_without_loading_torch(tmp_path):
    # torch's import costs seconds: a usage error comes before it.
    code = ("import sys\nfrom kempner_resilience.cli import main\n"
            "code = main(['check-resume', '--ranks', '2', '--steps', '6', '--interrupt-at', "
            "'3,4', '--', sys.executable, 'train.py'])\n"
            "print(code, 'torch' in sys.modules)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == [str(int(ExitCode.USAGE)), "False"], verdict(proc)


# A script that starts processes of its own and never ends them: a child (in the rank's
# session) and, through a shell, a grandchild that left the session with setsid.
STARTS_CHILDREN = """
import subprocess
from pathlib import Path
import kempner_resilience as kr
import torch

pids = Path(__file__).with_name("pids")
child = subprocess.Popen(["sleep", "300"])
subprocess.run(["sh", "-c", f"setsid sleep 300 & echo $! >> {pids}"], check=True)
with pids.open("a") as f:
    f.write(f"{child.pid}\\n")
torch.manual_seed(0)
model = torch.nn.Linear(2, 2)
optim = torch.optim.SGD(model.parameters(), lr=0.1)
with kr.ResilientRun(state={"model": model, "optim": optim}) as run:
    for step in run.steps(100):
        optim.zero_grad()
        model(torch.ones(1, 2)).sum().backward()
        optim.step()
"""


def test_processes_the_script_started_are_ended_with_each_launch_setsid_ones_included(tmp_path):
    from kempner_resilience.core.procs import pid_alive

    script = write_script(tmp_path, STARTS_CHILDREN, "train.py")
    proc = check_resume(tmp_path, script, "--steps", "4", "--interrupt-at", "2")
    assert proc.returncode == ExitCode.OK, verdict(proc)
    pids = [int(p) for p in (tmp_path / "pids").read_text().split()]
    assert len(pids) == 6, pids           # a child and a grandchild in each of 3 launches
    assert [p for p in pids if pid_alive(p)] == [], verdict(proc)


# A script whose data depends on the launch's number: the relaunch after the stop trains on
# other inputs, though nothing carried across steps is missing from state.
READS_RESTART_COUNT = """
import os
import kempner_resilience as kr
import torch

torch.manual_seed(0)
model = torch.nn.Linear(2, 1)
optim = torch.optim.SGD(model.parameters(), lr=0.1)
scale = 1.0 + int(os.environ.get("KEMPNER_RESTART_COUNT", "0"))
with kr.ResilientRun(state={"model": model, "optim": optim}) as run:
    for step in run.steps(100):
        optim.zero_grad()
        model(torch.ones(1, 2) * scale).sum().backward()
        optim.step()
"""


def test_a_script_that_reads_the_restart_count_is_told_so_not_that_it_carries_a_variable(
        tmp_path):
    script = write_script(tmp_path, READS_RESTART_COUNT, "train.py")
    proc = check_resume(tmp_path, script, "--steps", "4", "--interrupt-at", "2")
    assert proc.returncode == ExitCode.RESUME_INEXACT, verdict(proc)
    cause = proc.stdout.split("Likely cause:", 1)[1].replace("\n    ", " ")
    assert cause.lstrip().startswith("- the script reads KEMPNER_RESTART_COUNT (train.py)"), \
        verdict(proc)
    assert "carried from one step to the next" not in cause, verdict(proc)


# The README's own example, as a user fills it in: the config loaded from the shipped defaults
# with the real run's checkpoint.dir set in code, a ResumableLoader, a scheduler in state.
README_EXAMPLE = """
import kempner_resilience as kr
import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
dataset = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
model = torch.nn.Linear(8, 1)
optim = torch.optim.SGD(model.parameters(), lr=0.1)
sched = torch.optim.lr_scheduler.StepLR(optim, step_size=5)

cfg = kr.load_config("configs/default.yaml", overrides=["checkpoint.dir=REAL_RUN"])
data = kr.ResumableLoader(DataLoader(dataset, batch_size=32, shuffle=True))
with kr.ResilientRun(cfg, state={"model": model, "optim": optim, "sched": sched,
                                 "data": data}) as run:
    for step in run.steps(100):
        x, y = next(data)
        optim.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optim.step()
        sched.step()
"""


def test_a_script_that_sets_its_own_checkpoint_dir_is_refused_and_its_real_run_untouched(
        tmp_path):
    real = tmp_path / "scratch" / "run1"
    script = write_script(tmp_path, README_EXAMPLE.replace("REAL_RUN", str(real)), "train.py")
    proc = check_resume(tmp_path, script, "--steps", "4", "--interrupt-at", "2")
    assert proc.returncode == ExitCode.RESUME_UNCHECKED, verdict(proc)
    out = proc.stdout.replace("\n    ", " ")
    assert "sets its own checkpoint.dir" in out and "before its first step" in out, verdict(proc)
    assert f'the line to change: train.py:12: cfg = kr.load_config("configs/default.yaml", ' \
        f'overrides=["checkpoint.dir={real}"])' in out, verdict(proc)
    assert "kr.load_config()" in out, verdict(proc)
    assert not real.exists(), sorted(real.rglob("*"))
    # The refusal came at the first launch's start: nothing relaunched, no second run.
    assert not (tmp_path / "check" / "uninterrupted").exists()


# Gradients accumulated over 8 run steps under DDP's no_sync on 2 ranks, the optimizer stepping
# at each window's end (a micro-batch per run step, as a large-batch loop written around
# run.steps does). A stop inside a window waits for the window's end on 2 ranks.
DDP_ACCUMULATION = """
import contextlib
import kempner_resilience as kr
import torch
import torch.distributed as dist
from torch import nn

ACCUM = 8
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(0)
xs, ys = torch.randn(256, 8), torch.randn(256, 1)
model = nn.parallel.DistributedDataParallel(
    nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1)))
optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
with kr.ResilientRun(state={"model": model, "optim": optim}) as run:
    for step in run.steps(10_000):
        i = (2 * step + rank) % 256
        closes = (step + 1) % ACCUM == 0
        with contextlib.nullcontext() if closes else model.no_sync():
            (nn.functional.mse_loss(model(xs[i:i + 1]), ys[i:i + 1]) / ACCUM).backward()
        if closes:
            optim.step()
            optim.zero_grad(set_to_none=True)
"""


def test_a_stop_deferred_past_the_last_step_to_a_windows_end_is_found_and_the_check_ends(
        tmp_path):
    # The stop planned at 3 waits for the window's end, step 8, past --steps 6: the relaunch
    # resumed beyond every planned stop and trained on until the timeout. Now it makes its
    # final stop at once (it lands at the next window's end, 16), and the uninterrupted run
    # trains as far; DDP's bucket record, written later by a resumed process, is not a diff.
    script = write_script(tmp_path, DDP_ACCUMULATION, "train.py")
    proc = check_resume(tmp_path, script, "--ranks", "2", "--steps", "6", "--interrupt-at",
                        "3", "--set", "rescue.enabled=false", timeout="60")
    assert proc.returncode == ExitCode.OK, verdict(proc)
    out = proc.stdout.replace("\n    ", " ")
    assert "stopped by SIGUSR1 at step(s) 8 (planned at 3: a stop inside a gradient-" \
        "accumulation window waits for the window's end)" in out, verdict(proc)
    assert "steps 1..16" in out, verdict(proc)


# mnist-shaped: a small CNN on fixed images, with no seed anywhere: each run starts from other
# weights, so the interrupted run differs from the uninterrupted one for no fault of the resume.
UNSEEDED = """
import kempner_resilience as kr
import torch
from torch import nn
from torch.nn import functional as F


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.fc1 = nn.Linear(4 * 13 * 13, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        return F.log_softmax(self.fc1(torch.flatten(x, 1)), dim=1)


images = torch.linspace(0, 1, 8 * 28 * 28).reshape(8, 1, 28, 28)
target = torch.arange(8) % 10
model = Net()
optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
with kr.ResilientRun(state={"model": model, "optim": optimizer}) as run:
    for step in run.steps(100):
        optimizer.zero_grad()
        F.nll_loss(model(images), target).backward()
        optimizer.step()
"""


def test_an_unseeded_script_is_not_deterministic_with_its_own_code_not_inexact(tmp_path):
    script = write_script(tmp_path, UNSEEDED, "train.py")
    proc = check_resume(tmp_path, script, "--steps", "4", "--interrupt-at", "2")
    assert proc.returncode == ExitCode.RESUME_NONDETERMINISTIC, verdict(proc)
    out = proc.stdout.replace("\n    ", " ")
    assert out.startswith("check-resume: NOT DETERMINISTIC (unchecked)."), verdict(proc)
    assert "two straight runs already differ at step 1" in out, verdict(proc)
    assert "model (model)" in out and "seed it (torch.manual_seed" in out, verdict(proc)


# A learning rate decayed in place at the top of each step, before the optimizer steps, on 2
# DDP ranks: the survivors of a killed rank are inside the next step, its lr already set.
DECAYS_LR_BEFORE_ITS_STEP = """
import kempner_resilience as kr
import torch
import torch.distributed as dist
from torch import nn

dist.init_process_group("gloo")
torch.manual_seed(0)
xs, ys = torch.randn(64, 8), torch.randn(64, 1)
model = nn.parallel.DistributedDataParallel(nn.Linear(8, 1))
optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
with kr.ResilientRun(state={"model": model, "optim": optim}) as run:
    for step in run.steps(100):
        for group in optim.param_groups:
            group["lr"] *= 0.99
        i = (4 * step + 2 * dist.get_rank()) % 64
        optim.zero_grad()
        nn.functional.mse_loss(model(xs[i:i + 2]), ys[i:i + 2]).backward()
        optim.step()
"""


def test_a_rescue_holds_the_boundarys_lr_so_lr_decayed_before_the_step_resumes_exactly(
        tmp_path):
    # The rescue of step 3 held the lr step 3 had set for itself (one decay too many): a resume
    # from it decayed again, a real inexact resume, and check-resume said INEXACT for nanoGPT's
    # get_lr too. The rescue now holds the param groups as they were at the boundary.
    script = write_script(tmp_path, DECAYS_LR_BEFORE_ITS_STEP, "train.py")
    proc = check_resume(tmp_path, script, "--ranks", "2", "--steps", "6", "--interrupt-at",
                        "3", "--kill-rank", "1")
    assert proc.returncode == ExitCode.OK, verdict(proc)
    assert "with rank 1 SIGKILLed at step(s) 3 and resumed" in proc.stdout, verdict(proc)
    log = (tmp_path / "check" / "interrupted" / "logs" / "rank0.0.log").read_text()
    assert "rescue: committed step 3" in log


# word_language_model's shape: a learning rate the loop anneals at each epoch's end and carries
# in a variable, not in state. An epoch is 12 steps, beyond the default window of 10: a real
# resume after the first epoch end trains on with the first lr.
ANNEALS_AT_EPOCH_END = """
import kempner_resilience as kr
import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
dataset = TensorDataset(torch.randn(96, 8), torch.randn(96, 1))
model = torch.nn.Linear(8, 1)
data = kr.ResumableLoader(DataLoader(dataset, batch_size=8, shuffle=True))
lr = 0.1
with kr.ResilientRun(state={"model": model, "data": data}) as run:
    for step in run.steps(10_000):
        x, y = next(data)
        model.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
        if data.batch == len(data):      # the epoch's last batch: evaluate, anneal
            lr /= 4
"""


def test_an_lr_changed_only_at_the_epoch_end_is_found_by_a_stop_across_the_epoch_end(tmp_path):
    script = write_script(tmp_path, ANNEALS_AT_EPOCH_END, "train.py")
    proc = check_resume(tmp_path, script)           # the default window: steps 10, stops 3, 7
    assert proc.returncode == ExitCode.RESUME_INEXACT, verdict(proc)
    out = proc.stdout.replace("\n    ", " ")
    # The epoch end at step 12 was foreseen from the loader; a run stopped after it differs.
    assert "at step(s) 13 (across the epoch end of 'data' at step 12 (foreseen))" in out, \
        verdict(proc)
    assert "from step 14 on (1 step(s) after the stop at step 13)" in out, verdict(proc)
    assert "state that changes at the epoch end of 'data'" in out, verdict(proc)


def test_an_epoch_end_beyond_max_steps_is_not_covered_with_its_own_code_never_exact(tmp_path):
    script = write_script(tmp_path, ANNEALS_AT_EPOCH_END, "train.py")
    proc = check_resume(tmp_path, script, "--steps", "4", "--interrupt-at", "2",
                        "--max-steps", "20")
    assert proc.returncode == ExitCode.RESUME_NOT_COVERED, verdict(proc)
    out = proc.stdout.replace("\n    ", " ")
    assert out.startswith("check-resume: NOT COVERED: exact for steps 1-4; not covered: the "
                          "epoch end of 'data' at step 12 (foreseen)."), verdict(proc)
    assert "crossing it takes 25 steps, beyond --max-steps 20" in out, verdict(proc)
    # Only the runs needed: no run across the epoch end was started.
    assert not (tmp_path / "check" / "across-events").exists()


# mnist's test loader: persistent workers and no generator of its own, iterated at each epoch
# end (6 steps). Its first iterator draws the workers' seed from the global RNG; a process
# resumed after that draws again at its first eval, and dropout then differs.
PERSISTENT_EVAL_LOADER = """
import kempner_resilience as kr
import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
train = TensorDataset(torch.randn(48, 8), torch.randn(48, 1))
test = TensorDataset(torch.randn(16, 8), torch.randn(16, 1))
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 1))
optim = torch.optim.SGD(model.parameters(), lr=0.05)
data = kr.ResumableLoader(DataLoader(train, batch_size=8, shuffle=True))
test_loader = DataLoader(test, batch_size=8, num_workers=1, persistent_workers=True)
with kr.ResilientRun(state={"model": model, "optim": optim, "data": data}) as run:
    for step in run.steps(10_000):
        x, y = next(data)
        model.train()
        optim.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optim.step()
        if data.batch == len(data):      # the epoch's end: evaluate
            model.eval()
            with torch.no_grad():
                loss = sum(torch.nn.functional.mse_loss(model(a), b) for a, b in test_loader)
"""


def test_a_persistent_worker_eval_loader_is_found_by_a_stop_across_the_epoch_end(tmp_path):
    script = write_script(tmp_path, PERSISTENT_EVAL_LOADER, "train.py")
    proc = check_resume(tmp_path, script, "--steps", "6", "--interrupt-at", "3")
    assert proc.returncode == ExitCode.RESUME_INEXACT, verdict(proc)
    out = proc.stdout.replace("\n    ", " ")
    assert "at step(s) 7 (across the epoch end of 'data' at step 6)" in out, verdict(proc)
    # The next eval, the resumed process's first, drew the workers' seed from the global RNG.
    first = out.split("At step 12, the first that differs:", 1)[1].split("At step")[0]
    assert "rank0:rng.torch" in first and "model" not in first, verdict(proc)
    assert "an eval loader with persistent workers" in out, verdict(proc)


# mnist's train loader as the torch docs seed it: shuffled, a persistent worker and a generator
# of its own, which the RandomSampler made by shuffle=True shares; dropout in the model. An
# epoch is 6 steps.
PERSISTENT_SEEDED_LOADER = """
import kempner_resilience as kr
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(1)
images, labels = torch.rand(48, 1, 28, 28), torch.arange(48) % 10


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 4, 3, 1)
        self.dropout = nn.Dropout(0.25)
        self.fc1 = nn.Linear(4 * 13 * 13, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        return F.log_softmax(self.fc1(self.dropout(torch.flatten(x, 1))), dim=1)


model = Net()
optimizer = torch.optim.Adadelta(model.parameters(), lr=1.0)
loader = DataLoader(TensorDataset(images, labels), batch_size=8, shuffle=True, num_workers=1,
                    persistent_workers=True, generator=torch.Generator().manual_seed(1))
data = kr.ResumableLoader(loader)
with kr.ResilientRun(state={"model": model, "optim": optimizer, "data": data}) as run:
    for step in run.steps(10_000):
        x, y = next(data)
        optimizer.zero_grad()
        F.nll_loss(model(x), y).backward()
        optimizer.step()
"""


def test_a_persistent_worker_loader_with_its_own_generator_resumes_exactly_across_an_epoch_end(
        tmp_path):
    # The process resumed after the epoch end drew its workers' seed from the restored
    # generator, which the sampler shares: INEXACT, the loader's generator 2 of 5,056 bytes off.
    # Now it draws that seed from a copy, and the run across the epoch end is exact.
    script = write_script(tmp_path, PERSISTENT_SEEDED_LOADER, "train.py")
    proc = check_resume(tmp_path, script, "--steps", "6", "--interrupt-at", "3")
    assert proc.returncode == ExitCode.OK, verdict(proc)
    out = proc.stdout.replace("\n    ", " ")
    assert out.startswith("check-resume: exact."), verdict(proc)
    assert "Its stops crossed the epoch end of 'data' at step 6." in out, verdict(proc)
    # The loader saves the generator the script gave it: not named as left out of state.
    log = (tmp_path / "check" / "interrupted" / "logs" / "rank0.0.log").read_text()
    assert "is drawn from in the loop" not in log


# A denoising loop: the input noise comes from a torch.Generator of the script's own, seeded
# once in main() and left out of state. Nothing is prefetched or carried but the generator.
NOISE_GENERATOR_LEFT_OUT = """
import kempner_resilience as kr
import torch
from torch import nn
from torch.nn import functional as F


def main():
    torch.manual_seed(0)
    clean = torch.randn(64, 8)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    optim = torch.optim.SGD(model.parameters(), lr=0.05)
    noise = torch.Generator().manual_seed(1234)
    with kr.ResilientRun(state={"model": model, "optim": optim}) as run:
        for step in run.steps(10_000):
            x = clean[(8 * step) % 64:][:8]
            noisy = x + 0.1 * torch.randn(x.shape, generator=noise)
            optim.zero_grad()
            F.mse_loss(model(noisy), x).backward()
            optim.step()


main()
"""


def test_a_torch_generator_left_out_of_state_is_named_as_the_cause_not_a_carried_batch(
        tmp_path):
    script = write_script(tmp_path, NOISE_GENERATOR_LEFT_OUT, "train.py")
    proc = check_resume(tmp_path, script, "--steps", "6", "--interrupt-at", "3")
    assert proc.returncode == ExitCode.RESUME_INEXACT, verdict(proc)
    cause = proc.stdout.split("Likely cause:", 1)[1].replace("\n    ", " ")
    # The checkpoints show only the model and optimizer; the run saw the generator drawn from.
    assert cause.lstrip().startswith(
        "- the run said: torch.Generator 'noise' (train.py) is drawn from in the loop but is "
        "not in the state"), verdict(proc)
    assert "state={..., 'noise': noise}" in cause, verdict(proc)
    assert "prefetched batch" not in cause and "carried from one step" not in cause, \
        verdict(proc)


def test_a_generator_a_state_object_saves_is_compared_as_an_rng_stream_and_named_so(tmp_path):
    # In-process: real DCP checkpoints of a ResumableLoader and a generator in the state, the
    # generator drawn once more in one. Its entry is an RNG stream, named by its path, not
    # the data position.
    def saved(name: str, draws: int) -> Snapshot:
        torch.manual_seed(0)
        data = kr.ResumableLoader(DataLoader(TensorDataset(torch.arange(16)), batch_size=4,
                                             shuffle=True,
                                             generator=torch.Generator().manual_seed(1)))
        noise = torch.Generator().manual_seed(2)
        torch.randn(draws, generator=noise)
        state = TrainState({"model": torch.nn.Linear(2, 1), "data": data, "noise": noise})
        dcp.save(state.capture(3, 0), checkpoint_id=str(tmp_path / name), no_dist=True)
        return read_snapshot(tmp_path / name, 3)

    ref, got = saved("ref", 4), saved("got", 5)
    assert ref.kinds["rank0:objects.data.generators.0"] is Kind.RNG
    diffs = diff_snapshots(ref, got)
    assert [(d.key, d.kind) for d in diffs] == [("rank0:objects.noise.generator", Kind.RNG)]
    cause = likely_causes(diffs, 4, 3, has_scheduler=False)[0]
    assert cause.startswith("a torch.Generator (or RNG stream) the script draws from is not in "
                            "state, or is drawn from outside the steps: the torch.Generator of "
                            "state['noise'] (rank0:objects.noise.generator) differs"), cause


# nanoGPT's eval (`if iter_num % eval_interval == 0: estimate_loss()`), every 5 steps, said to
# the run with run.event("eval"); word_language_model's plateau rule: an eval no better than
# the best so far anneals the lr. best_val_loss is a variable, not in state: a process resumed
# between two evals starts it again, and its next eval keeps the lr the straight run annealed.
EVAL_EVERY_5_STEPS = """
import kempner_resilience as kr
import torch

torch.manual_seed(0)
xs, ys = torch.randn(64, 8), torch.randn(64, 1)
val_x, val_y = xs, -3 * ys          # its loss rises as the model trains: each later eval anneals
model = torch.nn.Linear(8, 1)
optim = torch.optim.SGD(model.parameters(), lr=0.1)
BEST
with kr.ResilientRun(state={"model": model, "optim": optim, STATE}) as run:
    for step in run.steps(10_000):
        if step % 5 == 0:
            run.event("eval")
            with torch.no_grad():
                val_loss = torch.nn.functional.mse_loss(model(val_x), val_y).item()
            if best.loss is None or val_loss < best.loss:
                best.loss = val_loss
            else:
                for group in optim.param_groups:
                    group["lr"] /= 4
        i = 8 * step % 64
        optim.zero_grad()
        torch.nn.functional.mse_loss(model(xs[i:i + 8]), ys[i:i + 8]).backward()
        optim.step()
"""

_BEST_IN_STATE = """class Best:
    def __init__(self):
        self.loss = None

    def state_dict(self):
        return {"loss": self.loss}

    def load_state_dict(self, sd):
        self.loss = sd["loss"]


best = Best()"""
EVAL_BEST_LEFT_OUT = EVAL_EVERY_5_STEPS.replace(
    "BEST", "class Best:\n    loss = None\n\n\nbest = Best()").replace(", STATE", "")
EVAL_BEST_IN_STATE = EVAL_EVERY_5_STEPS.replace("BEST", _BEST_IN_STATE).replace(
    "STATE", '"best": best')


def test_an_eval_every_5_steps_whose_best_val_loss_is_left_out_is_inexact_naming_the_eval(
        tmp_path):
    script = write_script(tmp_path, EVAL_BEST_LEFT_OUT, "train.py")
    proc = check_resume(tmp_path, script)
    assert proc.returncode == ExitCode.RESUME_INEXACT, verdict(proc)
    out = proc.stdout.replace("\n    ", " ")
    # The process resumed at step 3 went through the eval of step 5 (its checkpoint, step 6)
    # with no best_val_loss, so it kept the lr the straight run annealed there.
    assert "from step 6 on (3 step(s) after the stop at step 3)" in out, verdict(proc)
    assert "optim.param_groups.0.lr: 0.025 vs 0.1" in out, verdict(proc)
    causes = out.split("Likely cause:", 1)[1]
    assert causes.lstrip().startswith("- what the eval at step 6 changes is not in state"), \
        verdict(proc)
    assert "best_val_loss" in causes, verdict(proc)


def test_an_eval_every_5_steps_with_best_val_loss_in_state_resumes_exactly_across_it(tmp_path):
    script = write_script(tmp_path, EVAL_BEST_IN_STATE, "train.py")
    proc = check_resume(tmp_path, script)
    assert proc.returncode == ExitCode.OK, verdict(proc)
    assert "Its stops crossed the eval at steps 1 and 6." in proc.stdout, verdict(proc)


def test_the_steps_an_eval_falls_at_are_written_and_its_next_two_foreseen(tmp_path,
                                                                           monkeypatch):
    from kempner_resilience.checkresume.coverage import read_events
    from kempner_resilience.run import events

    path = tmp_path / "events.jsonl"
    monkeypatch.setenv(events.EVENTS_ENV, str(path))
    watch = events.watch({}, rank=0)
    for step in range(1, 12):
        if step in (5, 10):          # the eval ran in steps 4 and 9: before checkpoints 5, 10
            watch.named(events.event_kind("eval"))
        watch.at(step)
    assert events.watch({}, rank=1) is None          # rank 0 alone writes
    lines = path.read_text().splitlines()
    assert lines[-1] == '{"kind": "the eval", "next": [15, 20]}'
    [event] = read_events([path])
    assert (event.kind, event.first, event.second, event.recurs) == ("the eval", 5, 10, True)


def test_an_eval_seen_once_is_not_covered_by_a_stop_after_it_and_the_reason_says_so():
    from kempner_resilience.checkresume.coverage import Event, cover, covers

    once = Event("the eval", 1, None, recurs=True)
    assert not covers(once, [3, 7], 10)
    plan = cover([once], [3, 7], 10, gap=1, max_steps=300, step_s=0.01, timeout_s=120)
    assert plan.stops == ()
    [(event, why)] = plan.beyond
    assert event is once and "raise --steps past it" in why


def test_run_event_without_a_name_is_refused_naming_the_fix():
    from kempner_resilience.run import events

    with pytest.raises(ValueError, match=r"run.event\(''\): give the event a name"):
        events.event_kind("")


def test_the_default_check_on_two_ranks_also_resumes_from_a_killed_ranks_rescue(tmp_path):
    script = write_script(tmp_path, DECAYS_LR_BEFORE_ITS_STEP, "train.py")
    proc = check_resume(tmp_path, script, "--ranks", "2", "--steps", "6", "--interrupt-at",
                        "3")
    assert proc.returncode == ExitCode.OK, verdict(proc)
    out = proc.stdout.replace("\n  ", " ")
    assert ("and the run with rank 1 SIGKILLed at step(s) 3 and resumed from the survivors' "
            "rescue checkpoint, equals the uninterrupted run") in out, verdict(proc)
    log = (tmp_path / "check" / "rescued" / "logs" / "rank0.0.log").read_text()
    assert "rescue: committed step 3" in log


def test_the_default_check_with_the_rescue_off_runs_no_rescue(tmp_path):
    script = write_script(tmp_path, DECAYS_LR_BEFORE_ITS_STEP, "train.py")
    proc = check_resume(tmp_path, script, "--ranks", "2", "--steps", "6", "--interrupt-at",
                        "3", "--set", "rescue.enabled=false")
    assert proc.returncode == ExitCode.OK, verdict(proc)
    assert "SIGKILL" not in proc.stdout, verdict(proc)
    assert not (tmp_path / "check" / "rescued").exists()


def test_a_rank_killed_inside_an_accumulation_window_is_exact_and_says_a_lost_rank_is_not_rescued(
        tmp_path):
    # Rank 1 dies at step 3, inside a window of 8 no_sync steps: rank 0 trains on alone to the
    # window's all-reduce at step 8, a boundary rank 1 never reached, so no rescue can hold
    # one step of both. The script resumes exactly from its checkpoints (the signal stops
    # proved it); the report says what a lost rank costs there.
    script = write_script(tmp_path, DDP_ACCUMULATION, "train.py")
    proc = check_resume(tmp_path, script, "--ranks", "2", "--steps", "6", "--interrupt-at",
                        "3", timeout="60")
    assert proc.returncode == 0, verdict(proc)
    out = proc.stdout.replace("\n    ", " ").replace("\n  ", " ")
    assert "a lost rank is not rescued in this script: it costs the steps since the last " \
           "checkpoint (rank 1 SIGKILLed at step 3; the run said: rescue skipped:" in out, \
        verdict(proc)
