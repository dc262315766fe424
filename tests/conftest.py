import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from slurm_fixtures import multinode_cluster, slurm_cluster  # noqa: E402,F401  (real clusters)

import os  # noqa: E402

import pytest  # noqa: E402

# The local launcher's ranks fork from a process that imported torch once
# (supervise/local/warm.py): the suite launches hundreds of ranks, each of which would pay Python's
# and torch's start-up again (half the CPU of the non-SLURM shard). Tests of the cold path, the
# default for users, set it to 0 themselves.
os.environ.setdefault("KEMPNER_RESILIENCE_WARM", "1")

# scripts/test.sh runs the suite as two pytest processes side by side: one for the tests that use
# the real SLURM clusters (kept serial, they share the clusters' nodes and queues) and one for the
# rest. A test belongs to the SLURM shard if it is marked `slurm` or needs a cluster fixture,
# directly or through another fixture; the Ray tests (marked `ray`) run there too: that shard's
# time is mostly spent waiting on the scheduler, the other one's on the CPUs.
_CLUSTER_FIXTURES = {"slurm_cluster", "multinode_cluster"}


def _needs_slurm(item: pytest.Item) -> bool:
    return (item.get_closest_marker("slurm") is not None
            or item.get_closest_marker("ray") is not None
            or bool(_CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ()))))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    shard = os.environ.get("KR_TEST_SHARD", "")
    if shard not in ("slurm", "local"):
        return
    keep, drop = [], []
    for item in items:
        (keep if _needs_slurm(item) == (shard == "slurm") else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture
def mount_tmpfs(tmp_path: Path):
    """Mount small tmpfs file systems (a full disk, inodes used up, a read-only one; needs
    root): ``mount(name, options)`` returns the mount point. Where mounting is not permitted
    the test skips with the reason, and fails under CI, which runs as root: a disk test that
    cannot run is a hidden failure there."""
    import subprocess

    from slurm_fixtures import in_ci

    mounted: list[Path] = []

    def mount(name: str, options: str) -> Path:
        path = tmp_path / name
        path.mkdir()
        r = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                           capture_output=True, text=True)
        if r.returncode != 0:
            why = f"cannot mount tmpfs here ({r.stderr.strip()})"
            if in_ci():
                pytest.fail(f"{why} [CI is set: a disk test that cannot run fails]",
                            pytrace=False)
            pytest.skip(why)
        mounted.append(path)
        return path

    yield mount
    for path in reversed(mounted):
        subprocess.run(["umount", "-l", str(path)], capture_output=True)
