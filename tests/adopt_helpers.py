"""What the adoption tests share: a doc page's Before/After scripts, and the After script run
on 2 gloo ranks as a user would start it (RANK/WORLD_SIZE, a config in
``$KEMPNER_RESILIENCE_CONFIG`` with a periodic save every ``every`` steps)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from helpers import REPO, free_port


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
        procs.append(subprocess.Popen([sys.executable, str(script)], cwd=work, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    return procs


def finish(procs: list[subprocess.Popen], timeout: float = 180) -> list[int]:
    """Every rank's exit code (all alike, else the assertion shows each rank's output)."""
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
