import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from slurm_fixtures import multinode_cluster, slurm_cluster  # noqa: E402,F401  (real clusters)

import os  # noqa: E402
import subprocess  # noqa: E402

import pytest  # noqa: E402

# The local launcher's ranks fork from a process that imported torch once
# (supervise/local/warm.py): the suite launches hundreds of ranks, each of which would pay Python's
# and torch's start-up again (half the CPU of the non-SLURM shard). Tests of the cold path, the
# default for users, set it to 0 themselves.
os.environ.setdefault("KEMPNER_RESILIENCE_WARM", "1")

# One intra-op thread per process, as torchrun and `kempner-resilience launch` give ranks that
# share a machine: the suite runs several ranks per core, and torch's threads (one per core
# each) spin against each other (a sixth of the CPU of the tests that launch ranks). A test of
# thread counts sets its own.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Ray starts one Python worker per CPU without a runtime environment when its first driver
# connects; the suite's Ray jobs run theirs in a warm one (krr.warm_runtime_env), so those
# workers only cost their start (about 1 s of CPU per Ray instance here).
os.environ.setdefault("RAY_prestart_worker_first_driver", "0")

# The non-SLURM shard also keeps one standby for all its launches (supervise/local/standby.py):
# a launch then forks its ranks at once, where its own zygote would import torch first (2-3 s
# of CPU, hundreds of times). A launch whose ranks would import torch with other values
# (PYTHONPATH, TORCH_*) starts its own zygote as before. The tests' own scripts fork from it
# too (helpers.spawn_script, run_script). Not in the SLURM shard: a job's launcher must not
# reach a process outside its allocation.
_standby: "subprocess.Popen[bytes] | None" = None

# The trainer adapters' ranks import transformers' Trainer or Lightning (1.6-1.8 s of CPU each
# rank): the standby imports them once (warm.IMPORTS_ENV). Set empty, it imports torch alone.
# The Hugging Face variables the trainer tests' ranks run with are the whole suite's, so the
# standby, which imported transformers with them, fits those ranks.
_STANDBY_IMPORTS = ("transformers.trainer", "pytorch_lightning")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config: pytest.Config) -> None:
    global _standby
    from kempner_resilience.supervise.local import standby, warm

    if os.environ.get("KR_TEST_SHARD") != "local" or not warm.warm_on() \
            or os.environ.get(standby.STANDBY_ENV):
        return
    name = f"kempner-resilience-test-standby-{os.getpid()}"
    imports = os.environ.get(warm.IMPORTS_ENV)
    if imports is None:
        imports = ",".join(m for m in _STANDBY_IMPORTS if warm.installed(m))
    # It ends with this session even when pytest is killed (no unconfigure then).
    _standby = standby.start(name, {**os.environ, warm.IMPORTS_ENV: imports},
                             die_with_caller=True)
    os.environ[standby.STANDBY_ENV] = name


def pytest_unconfigure(config: pytest.Config) -> None:
    if _standby is not None:
        _standby.kill()
        _standby.wait()

# scripts/test.sh runs the suite as three pytest processes side by side. The tests that use the
# real SLURM clusters stay serial on each cluster (they share its nodes and queues), and the two
# clusters are independent: one shard for the multi-node cluster's tests (`multinode`), one for
# the single-node cluster's (`slurm`), one for the rest (`local`, on two workers). A test belongs
# to a SLURM shard if it is marked `slurm` or needs a cluster fixture, directly or through
# another fixture. Ray tests without SLURM are local: each starts a Ray instance of its own and
# finds its processes by a tag, so two can run at once. `KR_TEST_SHARD=slurm+multinode` runs
# every SLURM test in one process. The quickstart's install into an empty virtualenv needs no
# cluster but runs in the single-node SLURM shard all the same: it is mostly pip's downloads and
# unzipping, 1.5 minutes on one core, and that shard, which waits on its scheduler, ends first.
_CLUSTER_FIXTURES = {"slurm_cluster", "multinode_cluster"}
_SHARDS = ("slurm", "multinode", "local", "slurm+multinode")
_BESIDE_SLURM = ("test_quickstart.py",)


def _shard_of(item: pytest.Item) -> str:
    fixtures = set(getattr(item, "fixturenames", ()))
    if "multinode_cluster" in fixtures:
        return "multinode"
    if item.get_closest_marker("slurm") is not None or _CLUSTER_FIXTURES & fixtures \
            or item.path.name in _BESIDE_SLURM:
        return "slurm"
    return "local"


# The local shard's slowest files (seconds on two workers, CI of 2026-12-01) go first: its two
# workers take a file at a time (scripts/test.sh: --dist loadfile, in this order), so the last
# ones are short and both workers end together. A file not named keeps its place after them.
_SLOWEST_FIRST = ("test_ray.py", "test_torchrun_spares.py", "test_check_resume.py",
                  "test_trainers_check_resume.py", "test_ray_loop.py", "test_torchrun_warm.py",
                  "test_ray_warm.py", "test_trainers_lightning.py", "test_submitit.py",
                  "test_torchrun.py", "test_trainers_hf.py", "test_warm.py",
                  "test_trainers_accelerate.py", "test_time_limit.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    shard = os.environ.get("KR_TEST_SHARD", "")
    if shard not in _SHARDS:
        return
    keep, drop = [], []
    for item in items:
        (keep if _shard_of(item) in shard.split("+") else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    if shard == "local":
        rank = {name: i for i, name in enumerate(_SLOWEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.path.name, len(rank)))   # stable


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


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """The demo's uninterrupted run (``run_reference``): its weights' path by its arguments,
    computed once per pytest process. Several modules compare their runs with the same run,
    and each computation is one cold process per rank."""
    from kempner_resilience.demo.slurm_demo import run_reference

    cache: dict[tuple, Path] = {}

    def get(*, ranks: int, steps: int, train_args: tuple[str, ...] = ()) -> Path:
        key = (ranks, steps, tuple(train_args))
        if key not in cache:
            cache[key] = run_reference(tmp_path_factory.mktemp("reference"), ranks=ranks,
                                       steps=steps, train_args=train_args)
        return cache[key]
    return get
