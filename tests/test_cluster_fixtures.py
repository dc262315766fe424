"""The SLURM cluster fixtures never skip silently under CI.

A cluster that cannot start (here: a start script failing the way slurmctld does on another
install's state) fails every test that needs it when ``CI`` is set, with the script's own
message; outside CI the tests skip with that message. Either way the start is tried once per
session, not once per test. Runs pytest in a subprocess on a fixture built like the real ones
(tests/slurm_fixtures.py), so no SLURM is needed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


def _session(tmp_path: Path, ci: str | None) -> tuple[subprocess.CompletedProcess[str], int]:
    calls = tmp_path / "calls"
    script = tmp_path / "cluster.sh"
    script.write_text(f'#!/bin/bash\necho "$1" >> {calls}\n[ "$1" = status ] && exit 1\n'
                      'echo "slurmctld: fatal: CLUSTER NAME MISMATCH" >&2\nexit 1\n')
    module = tmp_path / "test_needs_cluster.py"
    module.write_text(f"""
from pathlib import Path
import pytest
import slurm_fixtures as sf

shared = sf._SharedCluster(Path({str(script)!r}), "fake cluster", Path({str(tmp_path / 'lock')!r}),
                           Path({str(tmp_path / 'started')!r}), lambda seconds, started: object())

@pytest.fixture(scope="session")
def cluster():
    yield shared.acquire()
    shared.release()

def test_one(cluster):
    pass

def test_two(cluster):
    pass
""")
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "KR_SLURM_SKIP")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), str(ROOT), env.get("PYTHONPATH", "")])
    if ci is not None:
        env["CI"] = ci
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
                           str(module)], capture_output=True, text=True, timeout=120, env=env,
                          cwd=tmp_path)
    starts = calls.read_text().split().count("start") if calls.exists() else 0
    return proc, starts


def test_cluster_that_cannot_start_fails_the_tests_under_ci(tmp_path):
    proc, starts = _session(tmp_path, ci="true")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "2 errors" in out and "skipped" not in out, out
    assert "CLUSTER NAME MISMATCH" in out and "CI is set" in out
    assert starts == 1


def test_cluster_that_cannot_start_skips_with_the_reason_outside_ci(tmp_path):
    proc, starts = _session(tmp_path, ci=None)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "2 skipped" in out and "CLUSTER NAME MISMATCH" in out
    assert starts == 1
