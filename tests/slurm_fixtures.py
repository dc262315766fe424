"""Pytest fixtures and helpers for tests against a real single-node SLURM cluster.

Use from ``tests/conftest.py``::

    from slurm_fixtures import slurm_cluster  # noqa: F401  (session fixture)

and in tests ``from slurm_fixtures import submit, wait_job, job_info``.

``slurm_cluster`` starts the cluster with ``tests/cluster/slurm_cluster.sh start`` once per
session (installing slurm with apt-get when missing) and stops it at the end, unless it was
started by hand before (then it is left alone), another pytest session still uses it, or
``KR_SLURM_KEEP=1`` is set. It skips, with the reason, where the cluster cannot be installed or
started (not root, apt-get failing).
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from kempner_resilience.slurm.scontrol import parse_show_job

__all__ = ["slurm_cluster", "submit", "wait_job", "job_info", "wait_for", "SlurmCluster",
           "CLUSTER_SCRIPT", "TERMINAL_STATES"]

CLUSTER_SCRIPT = Path(__file__).resolve().parent / "cluster" / "slurm_cluster.sh"
TERMINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                             "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})


@dataclass(frozen=True)
class SlurmCluster:
    """The running cluster: ``start_seconds`` is how long the start took (0.x when reused)."""

    script: Path
    start_seconds: float
    started_here: bool
    partitions: tuple[str, ...] = ("low", "high")


def _run(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


# The fixture may be registered twice (tests/conftest.py and a test module importing it): both
# registrations share this state, so the cluster starts once and stops after the last user.
_state: dict[str, object] = {"cluster": None, "users": 0, "lock": None}

# Several pytest sessions (engineers working side by side) may share the one cluster: each holds
# a shared lock while it runs, and only the last one out stops the cluster -- and only if a
# fixture started it (the marker file), never a cluster someone started by hand.
LOCK_FILE = Path("/run/kempner_slurm_fixture.lock")
STARTED_MARKER = Path("/run/kempner_slurm_fixture.started")


def _start_cluster() -> SlurmCluster:
    if os.geteuid() != 0:
        pytest.skip("SLURM tests need root to install and start slurmctld/slurmd")
    if os.environ.get("KR_SLURM_SKIP") == "1":
        pytest.skip("KR_SLURM_SKIP=1")
    lock = open(LOCK_FILE, "a+")
    fcntl.flock(lock, fcntl.LOCK_SH)
    _state["lock"] = lock
    was_up = _run(["bash", str(CLUSTER_SCRIPT), "status"], 30).returncode == 0
    t0 = time.monotonic()
    try:
        res = _run(["bash", str(CLUSTER_SCRIPT), "start"], 600)
    except subprocess.TimeoutExpired:
        pytest.skip("SLURM cluster did not start within 600 s (apt-get or daemons hung)")
    if res.returncode != 0:
        tail = "\n".join((res.stderr or res.stdout).strip().splitlines()[-5:])
        pytest.skip(f"SLURM cluster could not be installed/started: {tail}")
    if not was_up:
        STARTED_MARKER.touch()
    return SlurmCluster(CLUSTER_SCRIPT, time.monotonic() - t0, not was_up)


def _release_cluster() -> None:
    lock = _state["lock"]
    _state["lock"] = None
    if lock is None:
        return
    try:
        fcntl.flock(lock, fcntl.LOCK_UN)
        if os.environ.get("KR_SLURM_KEEP") == "1" or not STARTED_MARKER.exists():
            return
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return  # another session still uses the cluster; it stops it when done
        STARTED_MARKER.unlink(missing_ok=True)
        _run(["bash", str(CLUSTER_SCRIPT), "stop"], 120)
    finally:
        lock.close()


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    """The running single-node cluster (partitions ``low`` default, ``high`` preempts it).
    Set ``KR_SLURM_KEEP=1`` to leave it running after the session."""
    if _state["cluster"] is None:
        _state["cluster"] = _start_cluster()
    cluster = _state["cluster"]
    assert isinstance(cluster, SlurmCluster)
    _state["users"] = int(_state["users"]) + 1  # type: ignore[call-overload]
    yield cluster
    _state["users"] = int(_state["users"]) - 1  # type: ignore[call-overload]
    if _state["users"] == 0:
        _state["cluster"] = None
        _release_cluster()


def submit(script: str | os.PathLike[str], *args: str, cwd: str | os.PathLike[str] | None = None
           ) -> str:
    """``sbatch --parsable [args] script`` -> job id. ``script`` is a path or the script text
    (text is written to a temporary file first). Raises with sbatch's message on failure."""
    text = str(script)
    if isinstance(script, str) and (script.startswith("#!") or "\n" in script):
        fd, path = tempfile.mkstemp(prefix="kr_job_", suffix=".sbatch",
                                    dir=str(cwd) if cwd else None)
        with os.fdopen(fd, "w") as f:
            f.write(script)
        text = path
    res = _run(["sbatch", "--parsable", *args, text], 30)
    if res.returncode != 0:
        raise RuntimeError(f"sbatch failed ({res.returncode}): {res.stderr.strip()}")
    job_id = res.stdout.strip().split(";")[0]
    if not re.fullmatch(r"\d+", job_id):
        raise RuntimeError(f"sbatch printed no job id: {res.stdout!r} {res.stderr!r}")
    return job_id


def job_info(job_id: str) -> dict[str, str]:
    """``scontrol show -o job <id>`` as a dict ({} when slurmctld no longer knows the job).
    For an array's parent id the first task's record is returned."""
    res = _run(["scontrol", "show", "-o", "job", str(job_id)], 15)
    if res.returncode != 0:
        return {}
    jobs = parse_show_job(res.stdout)
    return jobs[0] if jobs else {}


def wait_job(job_id: str, states: set[str] | frozenset[str] = TERMINAL_STATES,
             timeout: float = 60.0, poll: float = 0.25) -> dict[str, str]:
    """Poll ``scontrol show job`` until JobState is in ``states``; returns the job's dict.
    Raises TimeoutError with the last state seen."""
    deadline = time.monotonic() + timeout
    info: dict[str, str] = {}
    while time.monotonic() < deadline:
        info = job_info(job_id)
        if info.get("JobState") in states:
            return info
        time.sleep(poll)
    raise TimeoutError(f"job {job_id} not in {sorted(states)} after {timeout}s; last: "
                       f"{info.get('JobState')} {info.get('Reason', '')}")


def wait_for(predicate, timeout: float = 30.0, poll: float = 0.1, what: str = "condition"):
    """Poll ``predicate()`` until it returns something truthy; returns that value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll)
    raise TimeoutError(f"{what} not met within {timeout}s")
