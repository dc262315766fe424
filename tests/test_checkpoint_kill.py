"""SIGKILL at random moments during resume, save, commit and retention (60 real processes):
the next start always resumes from a committed checkpoint whose contents are exactly what was
saved at that step, never from an older one than the newest reported commit, and every
directory that looks committed verifies byte for byte."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from helpers import run_script

HELPER = Path(__file__).resolve().parent / "checkpoint_helpers" / "kill_torture.py"


def test_sigkill_at_random_moments_never_loses_a_committed_checkpoint(tmp_path: Path) -> None:
    out = run_script([sys.executable, str(HELPER), str(tmp_path / "ckpt"), "60", "20240"],
                         capture_output=True, text=True, timeout=170)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(report["trials"]) == 61
    assert report["bad"] == [], "a resumed state differed from what was saved at that step"
    assert report["lost"] == [], "a restart resumed from older than the newest commit"
    assert report["broken"] == [], "a directory that looks committed does not verify"
    assert report["best"] > 30, "too few saves happened for the kills to mean much"
    final = report["trials"][-1]
    assert final["resumed"] is not None and final["resumed"] >= report["best"]
    # keep_last=2 held despite the kills (a leftover .trash-* or partial dir is allowed).
    assert report["committed_dirs"] <= 3
