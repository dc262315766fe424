"""docs/sharded.md's "Adopting PyTorch's FSDP2 example", run exactly as written.

The "After" script (FSDP2 ``fully_shard`` on a meta-device model, Adam, gradient clipping) runs
on 2 gloo ranks, is interrupted once by a real SIGUSR1 after its first periodic save and started
again: its ``model.pt`` is bitwise equal to an uninterrupted run's. Apart from the loop body's
indentation, the change from the "Before" script is the handful of lines the page says. The test
adds only a config in ``$KEMPNER_RESILIENCE_CONFIG`` (a periodic save every 30 steps, which
tells the test that training runs).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from helpers import REPO, assert_bitwise_equal, free_port
from kempner_resilience.exitcodes import ExitCode

SECTION = "## Adopting PyTorch's FSDP2 example"
EVERY = 30


def example() -> tuple[str, str]:
    """The "Before" and "After" scripts of the page's adoption example."""
    text = (REPO / "docs" / "sharded.md").read_text()
    section = text.split(SECTION + "\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) == 2, f"expected a Before and an After block under {SECTION!r}"
    return blocks[0], blocks[1]


def start_ranks(script: Path, work: Path) -> list[subprocess.Popen]:
    port = str(free_port())
    config = work.parent / "resilience.yaml"
    config.write_text(f"checkpoint:\n  every_steps: {EVERY}\nsignals:\n  grace_s: 60\n")
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1",
                   KEMPNER_RESILIENCE_CONFIG=str(config),
                   KEMPNER_RESILIENCE_REPORT=str(work / "report.json"), PYTHONUNBUFFERED="1")
        procs.append(subprocess.Popen([sys.executable, str(script)], cwd=work, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = 180) -> list[int]:
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    codes = [p.returncode for p in procs]
    assert len(set(codes)) == 1, "\n".join(f"--- rank {r} exit {c}:\n{o[-2000:]}"
                                           for r, (c, o) in enumerate(zip(codes, outs)))
    return codes


def test_the_fsdp2_adoption_changes_three_lines_besides_the_loop_indentation():
    before, after = example()
    diff = [line for line in difflib.unified_diff([ln.strip() for ln in before.splitlines()],
                                                  [ln.strip() for ln in after.splitlines()],
                                                  lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    # + the import, + the with, - range(STEPS), + run.steps(STEPS)
    assert len(diff) == 4, "\n".join(diff)


@pytest.mark.slow
def test_the_adopted_fsdp2_example_interrupted_by_usr1_resumes_bitwise(tmp_path):
    _, after = example()
    script = tmp_path / "train.py"
    script.write_text(after)

    straight = tmp_path / "straight"
    straight.mkdir()
    assert finish(start_ranks(script, straight)) == [0, 0]

    work = tmp_path / "interrupted"
    work.mkdir()
    procs = start_ranks(script, work)
    end = time.monotonic() + 180
    while not list((work / "checkpoints").glob("step_*/MANIFEST.json")):
        assert all(p.poll() is None for p in procs), "a rank ended before the first save"
        assert time.monotonic() < end, "no periodic checkpoint within 180 s"
        time.sleep(0.005)
    for p in procs:
        os.kill(p.pid, signal.SIGUSR1)
    assert finish(procs) == [ExitCode.REQUEUE] * 2
    stop = json.loads((work / "report.json").read_text())["stop_step"]

    assert finish(start_ranks(script, work)) == [0, 0]
    assert json.loads((work / "report.json").read_text())["resumed_from"] == stop
    assert_bitwise_equal(torch.load(straight / "model.pt"), torch.load(work / "model.pt"))
