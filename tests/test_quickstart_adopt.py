"""The quickstart's "Adopting an existing DDP script" example, run exactly as written.

The "After" script is taken from docs/quickstart.md, run on 2 gloo ranks (DDP, dropout, a
DataLoader over a shuffling DistributedSampler), interrupted once by a real SIGUSR1 in its
second epoch and started again: its ``model.pt`` is bitwise equal to an uninterrupted run's,
and the fresh and the resumed run each log nothing but their start line, on rank 0.
The change from the "Before" script is at most 10 lines. The only thing the test adds is a
config in ``$KEMPNER_RESILIENCE_CONFIG`` (a periodic save every 80 steps: the first one tells
the test that training is in its second epoch, 64 batches each).
"""

from __future__ import annotations

import difflib
import json
import os
import signal
import time

import pytest
import torch

from adopt_helpers import assert_only_the_start_line, doc_example, finish, finish_with_output, \
    start_ranks
from helpers import assert_bitwise_equal
from kempner_resilience.exitcodes import ExitCode

SECTION = "### Adopting an existing DDP script"
PER_EPOCH, EVERY = 64, 80


def example() -> tuple[str, str]:
    return doc_example('quickstart.md', SECTION, "\n#")


def test_the_adoption_example_changes_at_most_10_lines():
    before, after = example()
    diff = [line for line in difflib.unified_diff(before.splitlines(), after.splitlines(),
                                                  lineterm="", n=0)
            if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    assert 0 < len(diff) <= 10, "\n".join(diff)


@pytest.mark.slow
def test_the_adopted_example_interrupted_mid_epoch_resumes_bitwise(tmp_path):
    _, after = example()
    script = tmp_path / "train.py"
    script.write_text(after)

    straight = tmp_path / "straight"
    straight.mkdir()
    codes, outs = finish_with_output(start_ranks(script, straight, EVERY))
    assert codes == [0, 0]
    # The quickstart's lines as written say nothing but the start line, on rank 0 only: here
    # for a fresh run, below for the resumed one (they used to warn on every rank).
    assert_only_the_start_line(outs, "starting fresh")

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
    assert stop % PER_EPOCH != 0 and stop > PER_EPOCH, f"stopped at {stop}: not mid-epoch"

    codes, outs = finish_with_output(start_ranks(script, work, EVERY))
    assert codes == [0, 0]
    assert_only_the_start_line(outs, "resumed from")
    resumed = json.loads((work / "report.json").read_text())["resumed_from"]
    assert resumed == stop
    assert_bitwise_equal(torch.load(straight / "model.pt"), torch.load(work / "model.pt"))
