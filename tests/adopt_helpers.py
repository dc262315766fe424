"""What the adoption tests share: a doc page's Before/After scripts, and the After script run
on 2 gloo ranks as a user would start it (RANK/WORLD_SIZE, a config in
``$KEMPNER_RESILIENCE_CONFIG`` with a periodic save every ``every`` steps)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from helpers import REPO, free_port, spawn_script


def doc_example(page: str, section: str, stop: str) -> tuple[str, str]:
    """The "Before" and "After" python blocks under ``section`` of docs/``page`` (the section
    ends at the next line starting with ``stop``)."""
    text = (REPO / "docs" / page).read_text()
    body = text.split(section + "\n", 1)[1].split(stop, 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", body, re.S)
    assert len(blocks) == 2, f"expected a Before and an After block under {section!r}"
    return blocks[0], blocks[1]


def start_ranks(script: Path, work: Path, every: int) -> list[subprocess.Popen]:
    port = str(free_port())
    config = work.parent / "resilience.yaml"
    config.write_text(f"checkpoint:\n  every_steps: {every}\nsignals:\n  grace_s: 60\n")
    procs = []
    for rank in range(2):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=port, OMP_NUM_THREADS="1",
                   KEMPNER_RESILIENCE_CONFIG=str(config),
                   KEMPNER_RESILIENCE_REPORT=str(work / "report.json"), PYTHONUNBUFFERED="1")
        procs.append(spawn_script([sys.executable, str(script)], cwd=work, env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = 180) -> list[int]:
    """Every rank's exit code (all alike, else the assertion shows each rank's output)."""
    return finish_with_output(procs, timeout)[0]


def finish_with_output(procs: list[subprocess.Popen],
                       timeout: float = 180) -> tuple[list[int], list[str]]:
    """Every rank's exit code (all alike, as ``finish``) and its output (stdout and stderr)."""
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
    return codes, outs


def assert_only_the_start_line(outs: list[str], start_words: str) -> None:
    """Of the 2 ranks' outputs, rank 0 logged one line of this package, the start line holding
    ``start_words``; rank 1 logged none; neither printed a traceback."""
    lines = [line for line in outs[0].splitlines() if "[rank 0]" in line]
    assert len(lines) == 1 and start_words in lines[0], outs[0]
    assert [line for line in outs[1].splitlines() if "[rank 1]" in line] == [], outs[1]
    assert "Traceback" not in outs[0] + outs[1]
