"""Pytest fixtures and helpers for tests against real SLURM clusters on this machine.

Use from ``tests/conftest.py``::

    from slurm_fixtures import slurm_cluster, multinode_cluster  # noqa: F401  (session fixtures)

and in tests ``from slurm_fixtures import submit, wait_job, job_info``.

``slurm_cluster`` starts the single-node cluster with ``tests/cluster/slurm_cluster.sh start``
once per session (installing slurm with apt-get when missing); ``multinode_cluster`` starts the
multi-node one (``tests/cluster/multinode_cluster.sh``: a slurmd per network namespace, its own
config, reached through ``SLURM_CONF``; pass ``env=cluster.env`` to the helpers here). Each is
stopped at the end of the session, unless it was started by hand before (then it is left
alone), another pytest session still uses it, or ``KR_SLURM_KEEP=1`` is set.

Where a cluster cannot be installed or started (not root, apt-get failing, no network
namespaces), its tests skip with the reason -- except under CI (``CI`` set, as ``.ci/run``
does), where they fail with it: a skipped end-to-end test is a hidden failure.
``KR_SLURM_SKIP=1`` skips them on purpose, CI or not.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, NoReturn

import pytest

from kempner_resilience.slurm.scontrol import parse_show_job

__all__ = ["slurm_cluster", "multinode_cluster", "slow_death", "submit", "wait_job", "job_info", "wait_for",
           "SlurmCluster", "MultiNodeCluster", "CLUSTER_SCRIPT", "MULTINODE_SCRIPT",
           "TERMINAL_STATES", "in_ci"]

CLUSTER_SCRIPT = Path(__file__).resolve().parent / "cluster" / "slurm_cluster.sh"
MULTINODE_SCRIPT = Path(__file__).resolve().parent / "cluster" / "multinode_cluster.sh"
TERMINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL",
                             "PREEMPTED", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE"})


@dataclass(frozen=True)
class SlurmCluster:
    """The running cluster: ``start_seconds`` is how long the start took (0.x when reused)."""

    script: Path
    start_seconds: float
    started_here: bool
    partitions: tuple[str, ...] = ("low", "high")


@dataclass(frozen=True)
class MultiNodeCluster:
    """The running multi-node cluster: ``nodes`` (``krnode1``...) in partition ``mn``.

    Its clients need ``SLURM_CONF=conf``: ``env`` is this process's environment with it, for
    ``submit``/``job_info``/``wait_job`` and for any SLURM command a test runs.
    """

    script: Path
    conf: str
    nodes: tuple[str, ...]
    start_seconds: float
    started_here: bool

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, SLURM_CONF=self.conf)

    def kill_node(self, node: str) -> None:
        """Every process of ``node`` (slurmd, slurmstepd, the job's tasks) stopped, then
        SIGKILLed: the node is dead for SLURM and for its peers."""
        res = _run(["bash", str(self.script), "kill-node", self._number(node)], 60,
                   self._script_env())
        if res.returncode != 0:
            raise RuntimeError(f"kill-node {node} failed: {res.stderr.strip()}")

    def restart_node(self, node: str) -> None:
        """Start ``node``'s slurmd again and wait until the node is idle."""
        res = _run(["bash", str(self.script), "restart-node", self._number(node)], 90,
                   self._script_env())
        if res.returncode != 0:
            raise RuntimeError(f"restart-node {node} failed: {res.stderr.strip()}")

    def node_pids(self, node: str) -> list[int]:
        """The pids of every process in ``node``'s network namespace (``ip netns pids``)."""
        res = _run(["ip", "netns", "pids", node], 15)
        return [int(p) for p in res.stdout.split() if p.isdigit()]

    def torchrun_workers(self, job: Any, nodes: list[str]) -> dict[int, str]:
        """A torchrun job's workers on ``nodes``: {RANK: node}, from the pids the workers wrote
        (``DemoJob.worker_ranks``: a warm worker's /proc shows its zygote's command line and
        environment)."""
        ranks = job.worker_ranks()
        return {ranks[pid]: node for node in nodes for pid in self.node_pids(node)
                if pid in ranks}

    def trainers(self, workdir: Path, nodes: list[str]) -> dict[int, tuple[str, int]]:
        """The python processes on ``nodes`` whose command line names ``workdir`` (a job's
        trainers): {SLURM_PROCID: (node, pid)}."""
        found = {}
        for node in nodes:
            for pid in self.node_pids(node):
                try:
                    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                if not argv[0].endswith(b"python") or \
                        str(workdir).encode() not in b" ".join(argv):
                    continue
                for var in environ:
                    if var.startswith(b"SLURM_PROCID="):
                        found[int(var.split(b"=", 1)[1])] = (node, pid)
        return found

    def _script_env(self) -> dict[str, str]:
        # The script's node-number check follows KR_MN_NODES: this cluster's size.
        return dict(os.environ, KR_MN_NODES=str(len(self.nodes)))

    def _number(self, node: str) -> str:
        if node not in self.nodes:
            raise ValueError(f"{node!r} is not one of {self.nodes}")
        return node.removeprefix("krnode")


def _run(args: list[str], timeout: float, env: dict[str, str] | None = None
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, env=env)


def in_ci() -> bool:
    """True under CI (``CI`` set to anything but empty/0/false, as CI services and .ci/run do)."""
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def require_modules(*names: str) -> None:
    """Skip the test when a module it needs is not installed; under CI fail it instead (a Ray
    test that cannot run is a hidden failure there)."""
    import importlib.util

    missing = [n for n in names if importlib.util.find_spec(n) is None]
    if missing:
        why = (f"{', '.join(missing)} not installed (pip install -e '.[ray]', as "
               "scripts/setup.sh does)")
        if in_ci():
            pytest.fail(f"{why} [CI is set: a Ray test that cannot run fails]", pytrace=False)
        pytest.skip(why)


def _unavailable(reason: str) -> NoReturn:
    """Skip the test with ``reason``; under CI fail it instead."""
    if in_ci():
        pytest.fail(f"{reason} [CI is set: a SLURM test that cannot run fails instead of "
                    "skipping]", pytrace=False)
    pytest.skip(reason)


@contextlib.contextmanager
def _daemons_lock(folder: Path) -> Iterator[None]:
    """Held while a cluster starts or stops: the two clusters may be used side by side (one
    pytest shard each), and share apt-get's installation and munged."""
    with open(folder / "kempner_slurm_daemons.lock", "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


class _SharedCluster:
    """One cluster started by a script, shared by every test of the session and by concurrent
    pytest sessions.

    The fixture may be registered twice (tests/conftest.py and a test module importing it): both
    registrations share this object, so the cluster starts once and stops after the last user.
    Several pytest sessions (engineers working side by side) may share the cluster: each holds a
    shared lock while it runs, and only the last one out stops the cluster -- and only if a
    fixture started it (the marker file), never a cluster someone started by hand.
    """

    def __init__(self, script: Path, name: str, lock_file: Path, marker: Path,
                 make: Callable[[float, bool], object]) -> None:
        self.script, self.name, self.lock_file, self.marker = script, name, lock_file, marker
        self.make = make
        self.cluster: object | None = None
        self.users = 0
        self.lock = None
        self.failure: BaseException | None = None

    def acquire(self) -> object:
        if self.cluster is None:
            if self.failure is not None:  # no second 600 s attempt per test
                raise self.failure
            try:
                self.cluster = self._start()
            except (pytest.fail.Exception, pytest.skip.Exception) as e:
                self.failure = e
                raise
        self.users += 1
        return self.cluster

    def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            self.cluster = None
            self._release()

    def _start(self) -> object:
        if os.environ.get("KR_SLURM_SKIP") == "1":
            pytest.skip("KR_SLURM_SKIP=1")
        if os.geteuid() != 0:
            _unavailable(f"the {self.name} needs root to install and start slurmctld/slurmd")
        lock = open(self.lock_file, "a+")
        fcntl.flock(lock, fcntl.LOCK_SH)
        self.lock = lock
        was_up = _run(["bash", str(self.script), "status"], 30).returncode == 0
        t0 = time.monotonic()
        try:
            with _daemons_lock(self.lock_file.parent):
                res = _run(["bash", str(self.script), "start"], 600)
        except subprocess.TimeoutExpired:
            self._release()
            _unavailable(f"the {self.name} did not start within 600 s (apt-get or daemons "
                         f"hung): {self.script} start")
        if res.returncode != 0:
            self._release()
            tail = "\n".join((res.stderr or res.stdout).strip().splitlines()[-5:])
            _unavailable(f"the {self.name} could not be installed/started ({self.script} "
                         f"start exited {res.returncode}): {tail}")
        if not was_up:
            self.marker.touch()
        return self.make(time.monotonic() - t0, not was_up)

    def _release(self) -> None:
        lock = self.lock
        self.lock = None
        if lock is None:
            return
        try:
            fcntl.flock(lock, fcntl.LOCK_UN)
            if os.environ.get("KR_SLURM_KEEP") == "1" or not self.marker.exists():
                return
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return  # another session still uses the cluster; it stops it when done
            self.marker.unlink(missing_ok=True)
            with _daemons_lock(self.lock_file.parent):
                _run(["bash", str(self.script), "stop"], 120)
        finally:
            lock.close()


def _make_single(seconds: float, started: bool) -> SlurmCluster:
    return SlurmCluster(CLUSTER_SCRIPT, seconds, started)


def _make_multi(seconds: float, started: bool) -> MultiNodeCluster:
    env = _run(["bash", str(MULTINODE_SCRIPT), "env"], 30).stdout.strip()
    conf = env.removeprefix("export SLURM_CONF=")
    res = _run(["sinfo", "-h", "-N", "-o", "%N"], 30, dict(os.environ, SLURM_CONF=conf))
    nodes = tuple(sorted(set(res.stdout.split())))
    return MultiNodeCluster(MULTINODE_SCRIPT, conf, nodes, seconds, started)


_single = _SharedCluster(CLUSTER_SCRIPT, "single-node SLURM cluster",
                         Path("/run/kempner_slurm_fixture.lock"),
                         Path("/run/kempner_slurm_fixture.started"), _make_single)
_multi = _SharedCluster(MULTINODE_SCRIPT, "multi-node SLURM cluster",
                        Path("/run/kempner_multinode_fixture.lock"),
                        Path("/run/kempner_multinode_fixture.started"), _make_multi)


@pytest.fixture(scope="session")
def slurm_cluster() -> SlurmCluster:
    """The running single-node cluster (partitions ``low`` default, ``high`` preempts it).
    Set ``KR_SLURM_KEEP=1`` to leave it running after the session."""
    cluster = _single.acquire()
    assert isinstance(cluster, SlurmCluster)
    yield cluster
    _single.release()


@pytest.fixture(scope="session")
def multinode_cluster() -> MultiNodeCluster:
    """The running multi-node cluster (3 nodes ``krnode1..3``, partition ``mn``; clients need
    ``env=cluster.env``). Set ``KR_SLURM_KEEP=1`` to leave it running after the session."""
    cluster = _multi.acquire()
    assert isinstance(cluster, MultiNodeCluster)
    yield cluster
    _multi.release()


@pytest.fixture
def multinode_jobs(multinode_cluster):
    """``(jobs, dead_nodes)``: lists a multi-node test appends the demo jobs it submits and the
    nodes it kills to; afterwards whatever a failed test left running is cancelled and the
    killed nodes are brought back."""
    made: list = []
    dead: list[str] = []
    yield made, dead
    for job in made:
        if job.job_id and job.info().get("JobState") not in (None, "COMPLETED", "FAILED",
                                                            "CANCELLED"):
            job.cancel()
    for node in dead:
        multinode_cluster.restart_node(node)


def cluster_with(slurmd_timeout: int | None = None, nodes: int | None = None) -> None:
    """(Re)start the multi-node cluster's daemons with this SlurmdTimeout and node count (a
    changed config restarts them); None: the suite's own (``KR_MN_*``, else the script's)."""
    env = dict(os.environ)
    if slurmd_timeout is not None:
        env["KR_MN_SLURMD_TIMEOUT"] = str(slurmd_timeout)
    if nodes is not None:
        env["KR_MN_NODES"] = str(nodes)
    res = subprocess.run(["bash", str(MULTINODE_SCRIPT), "start"], capture_output=True,
                         text=True, timeout=300, env=env, stdin=subprocess.DEVNULL)
    assert res.returncode == 0, res.stderr[-2000:]


@pytest.fixture
def slow_death(multinode_cluster):
    """The multi-node cluster with production's SlurmdTimeout=300: a dead node stays "up" for
    SLURM for five minutes. The default (5 s) comes back afterwards."""
    cluster_with(300)
    yield multinode_cluster
    cluster_with(5)


def submit(script: str | os.PathLike[str], *args: str, cwd: str | os.PathLike[str] | None = None,
           env: dict[str, str] | None = None) -> str:
    """``sbatch --parsable [args] script`` -> job id. ``script`` is a path or the script text
    (text is written to a temporary file first). Raises with sbatch's message on failure.
    ``env``: sbatch's environment (``MultiNodeCluster.env`` for the multi-node cluster)."""
    text = str(script)
    if isinstance(script, str) and (script.startswith("#!") or "\n" in script):
        fd, path = tempfile.mkstemp(prefix="kr_job_", suffix=".sbatch",
                                    dir=str(cwd) if cwd else None)
        with os.fdopen(fd, "w") as f:
            f.write(script)
        text = path
    res = _run(["sbatch", "--parsable", *args, text], 30, env)
    if res.returncode != 0:
        raise RuntimeError(f"sbatch failed ({res.returncode}): {res.stderr.strip()}")
    job_id = res.stdout.strip().split(";")[0]
    if not re.fullmatch(r"\d+", job_id):
        raise RuntimeError(f"sbatch printed no job id: {res.stdout!r} {res.stderr!r}")
    return job_id


def job_info(job_id: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """``scontrol show -o job <id>`` as a dict ({} when slurmctld no longer knows the job).
    For an array's parent id the first task's record is returned."""
    res = _run(["scontrol", "show", "-o", "job", str(job_id)], 15, env)
    if res.returncode != 0:
        return {}
    jobs = parse_show_job(res.stdout)
    return jobs[0] if jobs else {}


def wait_job(job_id: str, states: set[str] | frozenset[str] = TERMINAL_STATES,
             timeout: float = 60.0, poll: float = 0.25, env: dict[str, str] | None = None
             ) -> dict[str, str]:
    """Poll ``scontrol show job`` until JobState is in ``states``; returns the job's dict.
    Raises TimeoutError with the last state seen."""
    deadline = time.monotonic() + timeout
    info: dict[str, str] = {}
    while time.monotonic() < deadline:
        info = job_info(job_id, env)
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
