"""check-resume on the scripts of tests/test_check_resume.py: each case's verdict, exit code,
wall time and disk use, as a markdown table for docs/benchmarks.md.

    python bench/check_resume_bench.py [CASE ...]

The scripts are small but shaped like the public ones (nanoGPT's train.py, pytorch/examples'
mnist, the README's and the quickstart's examples). The truth column is what each script does
by construction (a prefetched batch not in state: a resumed run trains on another batch).
Each case runs the verb as a user would (a subprocess, its own work directory, kept), one
after the other; times on a shared 2-core machine vary by tens of percent between runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import test_check_resume as cases  # noqa: E402  (the scripts, as the tests run them)
from adopt_helpers import doc_example  # noqa: E402

# name -> (script, truth, check-resume arguments)
CASES = {
    "quickstart DDP, 2 ranks": (None, "exact", ["--ranks", "2", "--steps", "6",
                                                "--interrupt-at", "3"]),
    "quickstart DDP, rank 1 killed": (None, "exact", ["--ranks", "2", "--steps", "6",
                                                      "--interrupt-at", "3", "--kill-rank", "1"]),
    "nanoGPT-shaped, prefetched batch": (cases.NANOGPT_SHAPED, "inexact (the carried batch)",
                                         ["--steps", "6", "--interrupt-at", "3"]),
    "LR scheduler left out": (cases.SCHEDULER_LEFT_OUT, "inexact (the scheduler)",
                              ["--steps", "6", "--interrupt-at", "3"]),
    "accumulation, 1 rank": (cases.GRAD_ACCUMULATION, "exact",
                             ["--steps", "10", "--interrupt-at", "6"]),
    "DDP accumulation over 8 run steps, 2 ranks": (cases.DDP_ACCUMULATION, "exact",
                                                   ["--ranks", "2", "--steps", "6",
                                                    "--interrupt-at", "3"]),
    "lr *= 0.99 before the step, rank 1 killed": (cases.DECAYS_LR_BEFORE_ITS_STEP, "exact",
                                                  ["--ranks", "2", "--steps", "6",
                                                   "--interrupt-at", "3", "--kill-rank", "1"]),
    "reads KEMPNER_RESTART_COUNT": (cases.READS_RESTART_COUNT, "inexact (the restart count)",
                                    ["--steps", "4", "--interrupt-at", "2"]),
    "mnist-shaped, unseeded": (cases.UNSEEDED, "not deterministic",
                               ["--steps", "4", "--interrupt-at", "2"]),
    "README example, its own checkpoint.dir": (cases.README_EXAMPLE, "must not be touched",
                                               ["--steps", "4", "--interrupt-at", "2"]),
    "lr annealed at the epoch end (12 steps), defaults": (
        cases.ANNEALS_AT_EPOCH_END, "inexact after the first epoch end", []),
    "the same, --max-steps 20": (cases.ANNEALS_AT_EPOCH_END, "inexact after the first epoch end",
                                 ["--max-steps", "20"]),
    "persistent-worker eval loader at the epoch end (6 steps), defaults": (
        cases.PERSISTENT_EVAL_LOADER, "inexact from the second eval after a resume", []),
    "mnist-shaped, persistent workers, loader's own generator (6-step epoch)": (
        cases.PERSISTENT_SEEDED_LOADER, "exact", ["--steps", "6", "--interrupt-at", "3"]),
    "quickstart DDP, 2 ranks, rescue off (no rescued run)": (
        None, "exact", ["--ranks", "2", "--steps", "6", "--interrupt-at", "3",
                        "--set", "rescue.enabled=false"]),
    "eval every 5 steps, best_val_loss left out, defaults": (
        cases.EVAL_BEST_LEFT_OUT, "inexact from the second eval after a resume", []),
    "eval every 5 steps, best_val_loss in state, defaults": (
        cases.EVAL_BEST_IN_STATE, "exact", []),
    "noise from a torch.Generator left out of state": (
        cases.NOISE_GENERATOR_LEFT_OUT, "inexact (the generator)",
        ["--steps", "6", "--interrupt-at", "3"]),
}


def run(name: str, work: Path) -> str:
    script, truth, args = CASES[name]
    if script is None:
        _, script = doc_example("quickstart.md", "### Adopting an existing DDP script", "\n#")
    work.mkdir(parents=True)
    real = work / "real_run"
    (work / "train.py").write_text(script.replace("REAL_RUN", str(real)))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("KEMPNER_RESILIENCE_CONFIG", None)
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "kempner_resilience.cli", "check-resume",
                           "--workdir", str(work / "check"), *args, "--", sys.executable,
                           "train.py"], cwd=work, env=env, capture_output=True, text=True)
    wall = time.monotonic() - t0
    first = proc.stdout.split("\n", 1)[0]
    head = first.split(".", 1)[0].split(":", 2)[1].strip() if ":" in first else first
    disk = next((line.split(":", 1)[1].split("(")[0].strip()
                 for line in proc.stdout.splitlines() if "disk used:" in line), "?")
    if name.startswith("README"):
        head += f"; real run {'untouched' if not real.exists() else 'WRITTEN'}"
    return f"| {name} | {truth} | {head} ({proc.returncode}) | {wall:.0f} s | {disk} |"


def main() -> None:
    names = sys.argv[1:] or list(CASES)
    root = Path(tempfile.mkdtemp(prefix="check-resume-bench-"))
    print("| case | truth | verdict (exit) | time | disk |")
    print("| --- | --- | --- | --- | --- |")
    for i, name in enumerate(names):
        print(run(name, root / f"case{i}"), flush=True)


if __name__ == "__main__":
    main()
