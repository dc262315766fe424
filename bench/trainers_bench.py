"""The per-step cost of the trainer adapters: each adopted script of tests/trainer_scripts/
(Accelerate, the HF Trainer, Lightning) against the same script without the package
(``--plain``: the marked lines left out, the package not imported), on 2 gloo ranks, with a
stand-in step of ``--step-ms`` (a sleep in each step). Rank 0's median step time (end to end,
the first 10 steps dropped), both runs of a library interleaved round by round. Target: at most
1 % with a 50 ms step.

    python bench/trainers_bench.py [--steps 150] [--step-ms 50] [--rounds 3] [--only hf]

The adopted runs go under the package's launchers (``kempner-resilience accelerate launch``,
``kempner-resilience torchrun``), the plain ones under torchrun; the config is the default with
no periodic save (the loop's own cost: the stop poll, the hang watchdog's beat, the rescue's
mark), checkpoints in a temporary directory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "trainer_scripts"
LIBRARIES = ("accelerate", "hf", "lightning")


def _command(library: str, plain: bool) -> list[str]:
    script = str(SCRIPTS / f"{library}_train.py")
    if plain:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node=2", script, "--plain"]
    if library == "accelerate":
        return [sys.executable, "-m", "kempner_resilience.cli", "accelerate", "launch", "--cpu",
                "--num_processes", "2", "--main_process_port", "0", script]
    return [sys.executable, "-m", "kempner_resilience.cli", "torchrun", "--standalone",
            "--nproc-per-node=2", script]


def step_time(library: str, plain: bool, steps: int, step_ms: float) -> float:
    """Rank 0's median seconds per step in one run."""
    with tempfile.TemporaryDirectory(prefix="kr-trainers-bench-") as tmp:
        cfg = Path(tmp, "resilience.yaml")
        cfg.write_text(f"checkpoint:\n  dir: {tmp}/ckpt\n  every_steps: 0\n"
                       "  every_minutes: 0\n")
        times = Path(tmp, "times")
        env = {**os.environ, "KEMPNER_RESILIENCE_CONFIG": str(cfg), "OMP_NUM_THREADS": "1",
               "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
               "ACCELERATE_USE_CPU": "1", "PYTHONPATH": str(REPO)}
        cmd = _command(library, plain) + ["--steps", str(steps), "--step-s",
                                          str(step_ms / 1000), "--times", str(times)]
        out = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True,
                             timeout=900)
        ends = [float(t) for t in times.read_text().split()] if times.exists() else []
        # The plain scripts leave torch's process group to the interpreter's exit, where gloo
        # sometimes aborts ("terminate called without an active exception"): every step was
        # timed by then, so that run still counts.
        if out.returncode != 0 and not (plain and len(ends) >= steps):
            raise SystemExit(f"{library} ({'plain' if plain else 'adopted'}) exited "
                             f"{out.returncode}:\n{out.stdout[-2000:]}{out.stderr[-3000:]}")
    gaps = [b - a for a, b in zip(ends, ends[1:])][10:]
    return statistics.median(gaps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--step-ms", type=float, default=50.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--only", choices=LIBRARIES, action="append")
    a = p.parse_args()
    print("| library | without (rounds) | with (rounds) | median cost |")
    print("|---|---|---|---|")
    for library in a.only or LIBRARIES:
        rows = []
        for _ in range(a.rounds):      # interleaved: the same load for both
            rows.append((step_time(library, True, a.steps, a.step_ms),
                         step_time(library, False, a.steps, a.step_ms)))
        ratio = statistics.median(o / b for b, o in rows)
        base = "/".join(f"{b * 1e3:.2f}" for b, _ in rows)
        ours = "/".join(f"{o * 1e3:.2f}" for _, o in rows)
        print(f"| {library} | {base} ms | {ours} ms | {(ratio - 1) * 100:+.2f} % |",
              flush=True)


if __name__ == "__main__":
    main()
