"""Ray, the driver-loop shape (SkyRL's trainer): the loop in the driver over a
StatefulDataLoader, rollouts by ``asyncio.run`` each step, passive worker groups (a 2-actor
policy, a 1-actor reference) saved by their actors into the driver's one checkpoint.

Each test runs tests/ray_loop_job.py on a real local Ray, gloo on CPU, 50 rollout episodes a
step, in a session of its own; every process carries a tag or works in the job's directory,
so "every actor gone" is a scan of /proc. The uninterrupted reference run is shared (module fixture). Skipped without Ray, except
under CI.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from helpers import tagged_processes
from slurm_fixtures import (require_modules, slurm_cluster, submit,  # noqa: F401
                            wait_for, wait_job)

JOB = Path(__file__).with_name("ray_loop_job.py")
STEPS = "30"
pytestmark = [pytest.mark.slow, pytest.mark.ray]


@pytest.fixture(scope="module", autouse=True)
def _ray_installed() -> None:
    require_modules("ray", "torchdata")


class Job:
    """One run of the job, in a session of its own, its processes tagged."""

    def __init__(self, root: Path, ckpt: Path, *args: str) -> None:
        self.work = root / f"work-{uuid.uuid4().hex[:6]}"
        self.work.mkdir(parents=True)
        self.ckpt, self.out = ckpt, self.work / "out.pt"
        self.tag = f"kr-ray-loop-{uuid.uuid4().hex}"
        self.log = self.work / "driver.log"
        env = {**os.environ, "KR_RAY_TEST_TAG": self.tag, "RAY_DEDUP_LOGS": "0",
               "PYTHONUNBUFFERED": "1"}
        env.pop("RANK", None)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(JOB), "--ckpt", str(ckpt), "--work", str(self.work),
                 "--steps", STEPS, "--out", str(self.out), *args], stdout=out,
                stderr=subprocess.STDOUT, env=env, start_new_session=True,
                stdin=subprocess.DEVNULL, cwd=self.work)

    def wait_step(self, step: int, timeout: float = 120.0) -> None:
        until = time.monotonic() + timeout
        while self.step() < step:
            assert time.monotonic() < until and self.proc.poll() is None, self.text()
            time.sleep(0.05)

    def step(self) -> int:
        try:
            return int((self.work / "progress").read_text())
        except (OSError, ValueError):
            return -1

    def policy_pid(self, rank: int) -> int:
        return self.pid(f"policy.r{rank}")

    def pid(self, name: str, other_than: int = 0, timeout: float = 120.0) -> int:
        """The pid in WORK/pids/<name>, once it is not ``other_than`` (a recreated actor's)."""
        until = time.monotonic() + timeout
        while True:
            try:
                pid = int((self.work / "pids" / name).read_text())
                if pid != other_than:
                    return pid
            except (OSError, ValueError):
                pass
            assert time.monotonic() < until and self.proc.poll() is None, self.text()
            time.sleep(0.05)

    def wait(self, timeout: float = 180.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def sandboxes(self) -> int:
        return len(list((self.work / "resources").glob("sandbox*")))

    def processes(self, settle_s: float = 10.0) -> list[str]:
        return tagged_processes(f"KR_RAY_TEST_TAG={self.tag}", settle_s, cwd=self.work)


def _committed(ckpt: Path) -> list[int]:
    """Steps committed with the driver's files and both groups' parts."""
    return sorted(int(d.name.removeprefix("step_")) for d in ckpt.glob("step_*")
                  if (d / "MANIFEST.json").is_file()
                  and len(list((d / "policy").glob("*.distcp"))) == 2
                  and len(list((d / "ref").glob("*.distcp"))) == 1)


def _assert_bitwise(a_path: Path, b_path: Path) -> None:
    """The policy's weights and optimizer, the data position, the counters, the driver's RNG."""
    import torch

    a, b = torch.load(a_path, weights_only=False), torch.load(b_path, weights_only=False)
    for k in a["policy"]["model"]:
        assert torch.equal(a["policy"]["model"][k], b["policy"]["model"][k]), k
    for pa, pb in zip(a["policy"]["optim"]["state"].values(),
                      b["policy"]["optim"]["state"].values()):
        assert torch.equal(pa["momentum_buffer"], pb["momentum_buffer"])
    assert torch.equal(a["rng"], b["rng"])
    assert a["counters"] == b["counters"]
    assert str(a["data"]) == str(b["data"])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("ray-loop-whole")
    job = Job(root, root / "ckpt")
    assert job.wait() == 0, job.text()
    assert _committed(job.ckpt) == [10, 20, 30]
    return job.out


def test_ctrl_c_under_a_dying_parent_stops_at_the_drivers_boundary_and_resumes_bitwise(
        reference: Path, tmp_path: Path) -> None:
    job = Job(tmp_path, tmp_path / "ckpt", "--parent", "--sleep", "0.1")
    job.wait_step(12)
    os.killpg(job.proc.pid, signal.SIGINT)      # the terminal's Ctrl+C; the parent's TERM follows
    code = job.wait()
    text = job.text()
    assert code == 130, text
    assert "second SIG" not in text and "forced:" not in text, text
    stopped = int(text.split("stopping at step ")[1].split()[0])
    assert _committed(job.ckpt)[-1] == stopped > 12, text     # the stop's step, every part
    assert job.sandboxes() == 0
    assert job.processes() == []                            # every actor, the Ray node, gone
    resumed = Job(tmp_path, job.ckpt)
    assert resumed.wait() == 0, resumed.text()
    assert f"step {stopped}" in resumed.text(), resumed.text()
    _assert_bitwise(resumed.out, reference)
    assert resumed.processes() == []


def test_an_evicted_policy_actor_an_evicted_reference_actor_and_a_killed_policy_actor_each_recreate_the_groups_once(
        reference: Path, tmp_path: Path) -> None:
    # SIGTERM to an actor's own process: Ray's kill without force, a node drain, an eviction.
    # Ray's handler exits it mid-step; to the driver that is an actor gone, as a SIGKILL's
    # (the OOM killer, a crashed node) is.
    job = Job(tmp_path, tmp_path / "ckpt", "--supervise", "--sleep", "0.1")
    job.wait_step(13)
    policy = job.policy_pid(1)
    os.kill(policy, signal.SIGTERM)
    job.pid("policy.r1", other_than=policy)             # the recreated groups
    job.wait_step(22)                                   # past their commit of step 20
    ref = job.pid("ref.r0")
    os.kill(ref, signal.SIGTERM)
    job.pid("ref.r0", other_than=ref)
    job.wait_step(25)
    os.kill(job.policy_pid(0), signal.SIGKILL)
    assert job.wait() == 0, job.text()                  # completed: never 1, never 0 unfinished
    text = job.text()
    said = [line for line in text.splitlines() if "step(s) to redo" in line]
    assert len(said) == 3, text                         # one line for each loss
    assert all("[ray driver]" in line for line in said), said
    assert "policy rank 1 is gone" in said[0] and "resumes from step 10" in said[0], said
    assert "ref rank 0 is gone" in said[1] and "resumes from step 20" in said[1], said
    assert "policy rank 0 is gone" in said[2], said
    _assert_bitwise(job.out, reference)
    assert job.sandboxes() == 0
    assert job.processes() == []


def _started_at(pid: int) -> float:
    """When process ``pid`` started (seconds since the epoch)."""
    ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    boot = next(float(x.split()[1]) for x in Path("/proc/stat").read_text().splitlines()
                if x.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def test_a_killed_policy_actor_is_replaced_by_the_spare_and_the_survivors_come_back_warm_bitwise(
        reference: Path, tmp_path: Path) -> None:
    job = Job(tmp_path, tmp_path / "ckpt", "--supervise", "--spares", "1", "--sleep", "0.1")
    job.wait_step(13)
    survivor, ref, killed = job.policy_pid(0), job.pid("ref.r0"), job.policy_pid(1)
    killed_at = time.time()
    os.kill(killed, signal.SIGKILL)
    spare = job.pid("policy.r1", other_than=killed)
    started = _started_at(spare)                                # while it runs
    assert job.wait() == 0, job.text()
    text = job.text()
    assert "recreated" in text, text
    assert job.policy_pid(0) == survivor and job.pid("ref.r0") == ref   # reborn, not new
    assert started < killed_at, text                            # made before it was needed
    _assert_bitwise(job.out, reference)
    assert job.sandboxes() == 0
    assert job.processes() == []


@pytest.mark.slurm
def test_usr1_through_the_ray_template_stops_the_driver_loop_requeues_and_resumes_bitwise(
        slurm_cluster, reference: Path, tmp_path: Path) -> None:
    from kempner_resilience.slurm import render_sbatch

    work, ckpt, out, log = tmp_path / "work", tmp_path / "ckpt", tmp_path / "out.pt", \
        tmp_path / "job.out"
    (work / "resources").mkdir(parents=True)
    script = tmp_path / "ray.sbatch"
    script.write_text(render_sbatch(
        template="ray", nodes=1, time="00:10:00", job_name="rayloop", output=str(log),
        extra={"cpus-per-task": 3},
        command=[sys.executable, str(JOB), "--ckpt", str(ckpt), "--work", str(work),
                 "--steps", STEPS, "--sleep", "0.1", "--out", str(out)]))
    tag = f"kr-ray-loop-{uuid.uuid4().hex}"
    env = {**os.environ, "KR_RAY_TEST_TAG": tag, "RAY_DEDUP_LOGS": "0",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("RANK", None)
    job_id = submit(str(script), cwd=tmp_path, env=env)
    progress = work / "progress"
    wait_for(lambda: progress.is_file() and int(progress.read_text() or -1) >= 8, timeout=120,
             what="the first run past step 8")
    subprocess.run(["scancel", "--batch", "--signal=USR1", job_id], check=True, timeout=30)
    info = wait_job(job_id, timeout=240)
    text = log.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text[-4000:]
    assert info["Restarts"] == "1", text[-4000:]
    assert "driver exited with 75" in text and "driver exited with 0" in text, text[-4000:]
    stopped = int(text.split("stopping at step ")[1].split()[0])
    assert stopped in _committed(ckpt), text[-4000:]       # the driver's files, every part
    assert f"step {stopped}" in text.split("driver exited with 75")[1], text[-4000:]
    _assert_bitwise(out, reference)
