"""Warm torchrun workers (``supervise/torchrun/agent.py``): with ``KEMPNER_RESILIENCE_WARM=1``
each agent forks its workers from one zygote that imported torch once.

A real agent (``kempner-resilience torchrun --standalone``, 2 gloo demo workers,
``--max-restarts``) loses a worker to SIGKILL and relaunches in place from its zygote: the run
ends bitwise equal to an uninterrupted one, a warm incarnation writes the checkpoint a cold one
writes, five relaunches leave the agent and its zygote no thread or file, and a zygote that
could have run a step never forks a worker.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import agent_env, child_pids, kill_node, wait_for_file, worker_pids, write_script
from kempner_resilience.demo.compare import compare_weights
from kempner_resilience.supervise.local.warm import PRELOAD, Zygote, pristine

STEPS, EVERY = 60, 20


def _agent(work: Path, warm: bool, restarts: int = 1, steps: int = STEPS) -> subprocess.Popen:
    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "kempner_resilience.cli", "torchrun", "--standalone",
           "--nproc-per-node=2", f"--max-restarts={restarts}", "--monitor-interval=0.2",
           "--no-python", sys.executable, "-m", "kempner_resilience.demo.train",
           "--steps", str(steps), "--step-time", "0.05", "--out", str(work / "weights.pt"),
           "--progress", str(work / "progress"), "--set", f"checkpoint.dir={work / 'ckpt'}",
           "--set", f"checkpoint.every_steps={EVERY}"]
    return subprocess.Popen(cmd, stdout=open(work / "agent.out", "w"),
                            stderr=open(work / "agent.err", "w"), stdin=subprocess.DEVNULL,
                            cwd=work, start_new_session=True,
                            env=agent_env(KEMPNER_RESILIENCE_WARM="1" if warm else "0",
                                    KEMPNER_RESILIENCE_FORWARD_SIGNALS="yes",
                                    OMP_NUM_THREADS="1"))


def _kill_a_worker_at(work: Path, agent: subprocess.Popen, step: int,
                      before: set[int] = frozenset()) -> set[int]:
    """SIGKILLs rank 1's worker of the incarnation after ``before`` once it logged ``step``;
    returns that incarnation's workers."""
    wait_for_file(work / "progress", timeout=120, contains=f"rank 1 step {step}\n")
    workers = set(worker_pids(agent.pid)) - set(before)
    assert len(workers) == 2, (workers, (work / "agent.err").read_text()[-3000:])
    os.kill(max(workers), signal.SIGKILL)
    return workers


def _finish(agent: subprocess.Popen, timeout: float = 150) -> int | None:
    try:
        return agent.wait(timeout)
    except subprocess.TimeoutExpired:
        return None
    finally:
        if agent.poll() is None:
            kill_node(agent.pid)


def _footprint(agent: subprocess.Popen) -> dict[str, tuple[int, int]]:
    """Threads and open files of the agent and of its zygote (its one child)."""
    [zygote] = child_pids(agent.pid)
    return {name: (len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd")))
            for name, pid in (("agent", agent.pid), ("zygote", zygote))}


@pytest.fixture(scope="module")
def reference(reference_run) -> Path:
    """The uninterrupted run: 2 plain DDP processes, no checkpoints."""
    return reference_run(ranks=2, steps=STEPS)


def test_a_worker_killed_under_a_warm_agent_is_relaunched_warm_and_the_run_ends_bitwise(
        tmp_path, reference):
    agent = _agent(tmp_path, warm=True)
    try:
        workers = _kill_a_worker_at(tmp_path, agent, 30)
        [zygote] = child_pids(agent.pid)
        assert all(int(Path(f"/proc/{w}/stat").read_text().rsplit(")", 1)[1].split()[1])
                   == zygote for w in workers)      # forked warm, not started by the agent
        code = _finish(agent)
    finally:
        _finish(agent, timeout=0)
    err = (tmp_path / "agent.err").read_text()
    assert code == 0, err[-3000:]
    assert "workers start warm" in err and "relaunching in place" in err, err[-3000:]
    assert "warm start unavailable" not in err, err[-3000:]
    same, total, diff = compare_weights(reference, tmp_path / "weights.pt")
    assert not diff, f"{len(diff)} of {total} tensors differ"


def _files(step_dir: Path) -> dict[str, dict[str, bytes]]:
    """Each shard's records (a shard is a zip archive: its headers carry write times)."""
    import zipfile

    out = {}
    for shard in sorted(step_dir.glob("*.distcp")):
        with zipfile.ZipFile(shard) as z:
            out[shard.name] = {n: z.read(n) for n in z.namelist()}
    return out


def test_a_warm_relaunched_incarnation_writes_the_checkpoint_a_cold_one_writes(tmp_path):
    written = {}
    for mode in ("cold", "warm"):
        agent = _agent(tmp_path / mode, warm=mode == "warm")
        try:
            _kill_a_worker_at(tmp_path / mode, agent, 30)
            code = _finish(agent)
        finally:
            _finish(agent, timeout=0)
        assert code == 0, (tmp_path / mode / "agent.err").read_text()[-3000:]
        # Step 60: a periodic save of the relaunched incarnation, both ranks' shards.
        written[mode] = _files(tmp_path / mode / "ckpt" / f"step_{STEPS:09d}")
    assert len(written["cold"]) == 2 and written["warm"] == written["cold"]


def test_five_warm_relaunches_leave_the_agent_and_its_zygote_no_thread_or_file(tmp_path):
    agent = _agent(tmp_path, warm=True, restarts=5, steps=100_000)
    try:
        before: set[int] = set()
        seen = []
        for i in range(6):
            wait_for_file(tmp_path / "progress", timeout=120,
                          contains=f"rank 1 step {10 * (i + 1)}\n")
            seen.append(_footprint(agent))
            if i < 5:
                before |= _kill_a_worker_at(tmp_path, agent, 10 * (i + 1), before)
        err = (tmp_path / "agent.err").read_text()
        assert err.count("relaunching in place") == 5, err[-3000:]
        assert seen[-1] == seen[0], seen
        # The zygote never ran a step: still the one process that forked every worker.
        assert len(child_pids(agent.pid)) == 1
    finally:
        _finish(agent, timeout=0)


def test_a_process_that_loaded_the_package_is_no_zygote():
    # This test process imported kempner_resilience: a step could have run here.
    assert "kempner_resilience" in (pristine() or "")


@pytest.mark.parametrize("taint", [
    "import kempner_resilience.run\n",                     # the package, where a step runs
    "import torch.distributed as dist\n"                   # a process group
    "dist.init_process_group('gloo', init_method='file://{tmp}/pg', rank=0, world_size=1)\n",
], ids=["the package", "a process group"])
def test_a_zygote_that_could_have_run_a_step_never_forks_a_worker(tmp_path, taint):
    lib = tmp_path / "lib"
    lib.mkdir()
    write_script(lib, taint.format(tmp=tmp_path), "taint.py")
    zenv = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(lib), *filter(None, [os.environ.get("PYTHONPATH")])])}
    z = Zygote(zenv, preload=(*PRELOAD[:2], "taint"))
    try:
        with pytest.raises(OSError, match="refused to fork"):
            z.spawn([sys.executable, str(write_script(tmp_path, "print(1)\n"))], zenv, None,
                    os.devnull, os.devnull)
        assert z.proc.wait(30) == 0        # and it is gone: no later worker from it either
    finally:
        z.close()
