"""Ctrl+C at a terminal running the local launcher: one graceful stop for every rank.

The terminal sends SIGINT to its whole foreground process group. The launcher runs the ranks in
sessions of their own and forwards exactly one SIGINT to each: every rank commits the
checkpoint and exits 130. A second Ctrl+C forces every rank out at once. Real processes, real
signals, 2 gloo ranks.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

from helpers import env, wait_for_file, write_script

RANK = """
import argparse, os, sys, time
import kempner_resilience as kr
import torch, torch.distributed as dist
from torch import nn

ap = argparse.ArgumentParser()
ap.add_argument("--dir"); ap.add_argument("--progress"); ap.add_argument("--slow-cleanup")
args = ap.parse_args()
rank = int(os.environ["RANK"])
dist.init_process_group("gloo", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
model = nn.parallel.DistributedDataParallel(nn.Linear(32, 32))
optim = torch.optim.SGD(model.parameters(), lr=1e-3)
progress = open(args.progress, "a", buffering=1)
with kr.ResilientRun(kr.load_config(None, [f"checkpoint.dir={args.dir}"]),
                     state={"model": model, "optim": optim}) as run:
    if args.slow_cleanup:      # runs after the commit and would hold the shutdown for a minute
        run.add_cleanup(lambda: (open(f"{args.slow_cleanup}.{rank}.started", "w").close(),
                                 time.sleep(60),
                                 open(f"{args.slow_cleanup}.{rank}.finished", "w").close()),
                        timeout_s=90)
    for step in run.steps(100_000):
        optim.zero_grad()
        model(torch.randn(4, 32)).sum().backward()
        optim.step()
        time.sleep(0.02)
        progress.write(f"rank {rank} step {step}\\n")
"""

# The same delivery without torch: each rank is a single-process run (no state) that only has to
# see exactly one SIGINT per Ctrl+C and stop gracefully; cheap enough to repeat many times.
LIGHT_RANK = """
import argparse, os, sys, time
import kempner_resilience as kr

ap = argparse.ArgumentParser()
ap.add_argument("--dir"); ap.add_argument("--progress")
args = ap.parse_args()
rank = int(os.environ["RANK"])
progress = open(args.progress, "a", buffering=1)
with kr.ResilientRun(kr.load_config(None, ["watchdog.hang_timeout_s=0"])) as run:
    for step in run.steps(100_000):
        time.sleep(0.01)
        progress.write(f"rank {rank} step {step}\\n")
"""

LAUNCHER = """
import json, sys
from pathlib import Path
from kempner_resilience.demo.launcher import LocalLauncher

rank_script, work, *extra = sys.argv[1:]
cmd = [sys.executable, rank_script, "--dir", str(Path(work) / "ckpt"), *extra]
launch = LocalLauncher(cmd, ranks=2, workdir=Path(work), max_launches=1).run()[-1]
print(json.dumps({"exit_codes": launch.exit_codes, "interrupted": launch.interrupted,
                  "killed": launch.killed}))
"""


def _run_launcher(tmp_path, *ctrl_c_after: tuple[str, str | tuple[str, ...] | None],
                  extra: tuple[str, ...] = (), rank_script: str = RANK) -> dict:
    """Start the launcher as a terminal's foreground job and press Ctrl+C (SIGINT to its
    process group) once each ``(file, text)`` of ``ctrl_c_after`` appeared in the work dir."""
    tmp_path.mkdir(exist_ok=True)
    rank = write_script(tmp_path, rank_script, "rank.py")
    launcher = write_script(tmp_path, LAUNCHER, "launcher.py")
    work = tmp_path / "work"
    work.mkdir()
    proc = subprocess.Popen([sys.executable, str(launcher), str(rank), str(work), *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env(), start_new_session=True)
    try:
        for name, texts in ctrl_c_after:
            for text in texts if isinstance(texts, tuple) else (texts,):
                wait_for_file(work / name, timeout=120, contains=text)
            os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err
    result = json.loads(out.strip().splitlines()[-1])
    result["work"] = work
    return result


def _emergency_checkpoints(work) -> list[str]:
    return [p.name for p in (work / "ckpt").glob("step_*")
            if '"reason":"emergency"' in (p / "MANIFEST.json").read_text()]


def test_ctrl_c_commits_a_checkpoint_and_every_rank_exits_130(tmp_path):
    # Once: the repetition that catches a lost or doubled SIGINT is the light test below, whose
    # ranks need no torch; this one is about the checkpoint and the exit codes.
    result = _run_launcher(tmp_path, ("progress.0", "rank 0 step 2\n"))
    assert result["exit_codes"] == [130, 130], result
    assert result["interrupted"] and not result["killed"]
    assert len(_emergency_checkpoints(result["work"])) == 1


# Rounds of the light test in the suite: each round is three fresh processes, and the suite's
# time is spent on process starts. The soak (20 rounds and more, as this test ran before) is
# bench/ctrl_c_bench.py, which sets KR_CTRL_C_ROUNDS.
ROUNDS = int(os.environ.get("KR_CTRL_C_ROUNDS", "5"))


def test_one_ctrl_c_is_one_graceful_stop_for_every_rank_round_after_round(tmp_path):
    for attempt in range(ROUNDS):
        # These ranks share no collective: wait until both run (a Ctrl+C while a rank still
        # imports is Python's KeyboardInterrupt, before any handler of ours exists).
        result = _run_launcher(tmp_path / str(attempt),
                               ("progress.0", ("rank 0 step 2\n", "rank 1 step 2\n")),
                               rank_script=LIGHT_RANK)
        # 130 after a graceful stop at a step boundary; a second SIGINT would also give 130
        # but at once, mid-step: the logs tell them apart.
        assert result["exit_codes"] == [130, 130], (attempt, result)
        logs = [(result["work"] / f"rank{r}.0.log").read_text() for r in (0, 1)]
        assert all("stopping at step" in log and "second SIGINT" not in log for log in logs), \
            (attempt, logs)


def test_a_second_ctrl_c_forces_every_rank_out_at_once(tmp_path):
    result = _run_launcher(tmp_path, ("progress.0", "rank 0 step 2\n"),
                           ("cleanup.0.started", None), extra=("--slow-cleanup", "cleanup"))
    assert result["exit_codes"] == [130, 130] and not result["killed"]
    # nobody waited for the minute-long cleanup
    assert not list(result["work"].glob("cleanup.*.finished"))
    assert len(_emergency_checkpoints(result["work"])) == 1
