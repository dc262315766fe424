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
import signal
import time

import pytest
import torch

from adopt_helpers import doc_example, finish, start_ranks
from helpers import assert_bitwise_equal
from kempner_resilience.exitcodes import ExitCode

SECTION = "## Adopting PyTorch's FSDP2 example"
EVERY = 30


def example() -> tuple[str, str]:
    return doc_example('sharded.md', SECTION, "\n## ")


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
    assert finish(start_ranks(script, straight, EVERY)) == [0, 0]

    work = tmp_path / "interrupted"
    work.mkdir()
    procs = start_ranks(script, work, EVERY)
    end = time.monotonic() + 180
    while not list((work / "checkpoints").glob("step_*/MANIFEST.json")):
        assert all(p.poll() is None for p in procs), "a rank ended before the first save"
        assert time.monotonic() < end, "no periodic checkpoint within 180 s"
        time.sleep(0.005)
    for p in procs:
        os.kill(p.pid, signal.SIGUSR1)
    assert finish(procs) == [ExitCode.REQUEUE] * 2
    stop = json.loads((work / "report.json").read_text())["stop_step"]

    assert finish(start_ranks(script, work, EVERY)) == [0, 0]
    assert json.loads((work / "report.json").read_text())["resumed_from"] == stop
    assert_bitwise_equal(torch.load(straight / "model.pt"), torch.load(work / "model.pt"))
