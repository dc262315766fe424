import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from slurm_fixtures import multinode_cluster, slurm_cluster  # noqa: E402,F401  (real clusters)

_CLUSTER_FIXTURES = {"slurm_cluster", "multinode_cluster"}


def pytest_collection_modifyitems(config, items):
    """Two serial streams under ``pytest -n 2 --dist loadgroup`` (scripts/test.sh): the tests on
    the real SLURM clusters, which mostly wait on the scheduler and on time limits, run beside
    the local ones, which keep the cores busy. Each cluster starts once, in the one worker that
    runs every test needing it; within a stream the order is the usual file order."""
    for item in items:
        needs_cluster = item.get_closest_marker("slurm") is not None or \
            bool(_CLUSTER_FIXTURES & set(getattr(item, "fixturenames", ())))
        item.add_marker(pytest.mark.xdist_group("slurm" if needs_cluster else "local"))
