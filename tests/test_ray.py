"""Ray: a driver's Ctrl+C, a failed rollout and a forced stop, on a real local Ray (issue 30).

Each test runs tests/ray_job.py (a driver, 2 training actors in one gloo group, an asyncio
rollout actor holding 50 stand-in resources: files its episodes create and remove in
``finally``) in a session of its own, under a parent that SIGTERMs the driver when it dies on
Ctrl+C, as ``uv run`` does. Every process of a test carries a tag in its environment (Ray's
workers inherit the driver's) or works in its directory (a worker forked from the suite's
standby), so "no process left behind" is a scan of /proc.

Skipped when ray is not installed, except under CI (``CI`` set), where that is a failure:
scripts/setup.sh installs the ``ray`` extra.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from kempner_resilience.exitcodes import ExitCode
from helpers import tagged_processes
from slurm_fixtures import (multinode_cluster, require_modules, slow_death, slurm_cluster,  # noqa: F401
                            submit, wait_for, wait_job)

JOB = Path(__file__).with_name("ray_job.py")
RESOURCES = 50
pytestmark = [pytest.mark.slow, pytest.mark.ray]


@pytest.fixture(scope="module", autouse=True)
def _ray_installed() -> None:
    require_modules("ray")


class Job:
    """One run of tests/ray_job.py under its dying parent, in a session of its own."""

    def __init__(self, root: Path, ckpt: Path, *args: str, cold: bool = False) -> None:
        self.work = root / f"work-{uuid.uuid4().hex[:6]}"
        self.work.mkdir(parents=True)
        self.ckpt = ckpt
        self.tag = f"kr-ray-test-{uuid.uuid4().hex}"
        self.log = self.work / "driver.log"
        env = {**os.environ, "KR_RAY_TEST_TAG": self.tag, "RAY_DEDUP_LOGS": "0"}
        if cold:        # Ray's workers start as Ray starts them (no zygote: warm_runtime_env)
            env["KEMPNER_RESILIENCE_WARM"] = "0"
        env.pop("RANK", None)
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(JOB), "--parent", "--ckpt", str(ckpt), "--work",
                 str(self.work), *args], stdout=out, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, stdin=subprocess.DEVNULL, cwd=self.work)

    def ctrl_c(self) -> float:
        """SIGINT to the job's process group, as a terminal's Ctrl+C; when it was sent."""
        os.killpg(self.proc.pid, signal.SIGINT)
        return time.monotonic()

    def wait_training(self, step: int = 8, timeout: float = 90.0) -> None:
        """Until rank 0 passed ``step`` and all the rollout's resources are held."""
        until = time.monotonic() + timeout
        while time.monotonic() < until:
            if self.step() >= step and self.resources() == RESOURCES:
                return
            assert self.proc.poll() is None, self.text()
            time.sleep(0.2)
        raise AssertionError(f"training never reached step {step}:\n{self.text()}")

    def wait_log(self, needle: str, timeout: float = 30.0) -> None:
        until = time.monotonic() + timeout
        while needle not in self.text():
            assert time.monotonic() < until and self.proc.poll() is None, self.text()
            time.sleep(0.05)

    def wait(self, timeout: float = 90.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)

    def step(self) -> int:
        try:
            return int((self.work / "progress").read_text())
        except (OSError, ValueError):
            return -1

    def resources(self) -> int:
        return len(list((self.work / "resources").glob("sandbox*")))

    def finally_ran(self) -> list[str]:
        return sorted(p.name.removeprefix("finally.") for p in self.work.glob("finally.*"))

    def trainers(self, known: set[int] = frozenset(), timeout: float = 60.0) -> dict[int, int]:
        """Rank -> pid of the training actors that started a call, besides the ``known`` pids
        (the next incarnation's, when given the previous ones), once both ranks have one."""
        until = time.monotonic() + timeout
        while True:
            found = {int(p.name[1:p.name.index(".")]): int(p.name.split(".")[1])
                     for p in (self.work / "pids").glob("r[0-9]*.*")
                     if int(p.name.split(".")[1]) not in known}
            if len(found) == 2:
                return found
            assert time.monotonic() < until and self.proc.poll() is None, self.text()
            time.sleep(0.1)

    def rollout_pid(self, timeout: float = 60.0) -> int:
        """The pid of the rollout actor's process, once its call started."""
        until = time.monotonic() + timeout
        while not (found := list((self.work / "pids").glob("rollout.*"))):
            assert time.monotonic() < until and self.proc.poll() is None, self.text()
            time.sleep(0.1)
        return int(found[0].name.split(".")[1])

    def teardown_of(self, pid: int) -> str:
        """What the training call of actor process ``pid`` recorded in its ``finally``."""
        return next((self.work / "pids").glob(f"r[0-9]*.{pid}")).read_text()

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def processes(self, settle_s: float = 10.0) -> list[str]:
        """Processes still carrying this job's tag or working in its directory (a worker
        forked from the suite's standby), after up to ``settle_s`` for them to go."""
        return tagged_processes(f"KR_RAY_TEST_TAG={self.tag}", settle_s, cwd=self.work)


def _tagged(tag: str) -> list[str]:
    return tagged_processes(f"KR_RAY_TEST_TAG={tag}")


def _gone(pid: int, within_s: float) -> bool:
    """Whether process ``pid`` is gone (or a zombie) within ``within_s`` seconds."""
    until = time.monotonic() + within_s
    while time.monotonic() < until:
        try:
            if Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"):
                return True
        except OSError:
            return True
        time.sleep(0.1)
    return False


def _same_weights(a_path: Path, b_path: Path) -> bool:
    import torch

    a, b = torch.load(a_path), torch.load(b_path)
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _committed(ckpt: Path) -> list[int]:
    """Steps of the committed checkpoints: manifest, DCP metadata and shard files on disk."""
    return sorted(int(d.name.removeprefix("step_")) for d in ckpt.glob("step_*")
                  if (d / "MANIFEST.json").is_file() and (d / ".metadata").is_file()
                  and len(list(d.glob("*.distcp"))) == 2)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The weights of the job's 60 steps run without a stop, its workers started cold: every
    job below forks its workers warm, and ends bitwise equal to this one."""
    root = tmp_path_factory.mktemp("ray-whole")
    whole = Job(root, root / "ckpt", "--steps", "60", "--sleep", "0",
                "--out", str(root / "whole.pt"), cold=True)
    assert whole.wait() == 0, whole.text()
    assert whole.processes() == []
    return root / "whole.pt"


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Job, int, float]:
    """One job stopped by Ctrl+C mid-training: (job, exit code, seconds from Ctrl+C to exit)."""
    root = tmp_path_factory.mktemp("ray")
    job = Job(root, root / "ckpt", "--steps", "60")
    job.wait_training()
    sent = job.ctrl_c()
    code = job.wait()
    return job, code, time.monotonic() - sent


def test_ctrl_c_under_a_dying_parent_is_one_graceful_stop_that_commits_and_leaks_nothing(
        interrupted: tuple[Job, int, float]) -> None:
    job, code, took = interrupted
    text = job.text()
    assert code == 130, text
    # The parent's TERM and the terminal's INT make one stop, whichever reaches the driver
    # first: the TERM joined the stop, or began it and the INT joined (the code says INT).
    driver = [line for line in text.splitlines() if line.startswith("[ray driver]")]
    assert any("SIGTERM during shutdown" in line or "SIGTERM received" in line
               for line in driver), text
    assert "second SIG" not in text and "forced: killing" not in text, text
    assert len(_committed(job.ckpt)) == 1, text
    assert job.finally_ran() == ["rollout", "trainer0", "trainer1"]
    assert job.resources() == 0
    assert job.processes() == []
    assert took < 25, took


def test_a_failed_rollout_episode_cancels_its_siblings_and_stops_the_training(
        tmp_path: Path) -> None:
    job = Job(tmp_path, tmp_path / "ckpt", "--steps", "400", "--fail-at-step", "8")
    code = job.wait()
    text = job.text()
    assert code == 1, text
    assert "episode 7 failed" in text
    assert len(_committed(job.ckpt)) == 1, text      # the training stopped with a checkpoint
    assert job.finally_ran() == ["rollout", "trainer0", "trainer1"]
    assert job.resources() == 0
    assert job.processes() == []


def test_a_second_ctrl_c_forces_and_leaves_no_process_behind(tmp_path: Path) -> None:
    # Long steps: the trainers reach their boundary seconds after the stop, so the second
    # Ctrl+C lands while the first stop waits for them.
    job = Job(tmp_path, tmp_path / "ckpt", "--steps", "400", "--sleep", "3")
    job.wait_training(step=1)
    job.ctrl_c()
    job.wait_log("stopping every actor")
    sent = job.ctrl_c()
    code = job.wait(timeout=30)
    took = time.monotonic() - sent
    assert code == 130, job.text()
    assert "second SIGINT during shutdown" in job.text()
    assert took < 5, took
    assert job.processes(settle_s=5) == []


def test_the_next_run_resumes_from_the_stop_and_ends_bitwise_equal_to_an_uninterrupted_run(
        interrupted: tuple[Job, int, float], uninterrupted: Path, tmp_path: Path) -> None:
    job, _, _ = interrupted
    stopped_at = _committed(job.ckpt)[-1]
    resumed = Job(tmp_path, job.ckpt, "--steps", "60", "--out", str(tmp_path / "resumed.pt"))
    assert resumed.wait() == 0, resumed.text()
    assert f"step {stopped_at}" in resumed.text(), resumed.text()   # rank 0's resume line
    assert _same_weights(tmp_path / "resumed.pt", uninterrupted)
    assert resumed.processes() == []


def test_sigterm_to_one_training_actor_tears_it_down_within_its_grace_and_the_next_group_resumes(
        uninterrupted: Path, tmp_path: Path) -> None:
    # Ray's kill without force, a node drain, an eviction: SIGTERM to the actor's process.
    job = Job(tmp_path, tmp_path / "ckpt", "--supervise", "--steps", "60",
              "--out", str(tmp_path / "resumed.pt"))
    job.wait_training()
    first = job.trainers()
    os.kill(first[1], signal.SIGTERM)
    assert _gone(first[1], within_s=25.0), job.text()     # signals.grace_per_signal_s SIGTERM
    assert job.teardown_of(first[1]) == "group destroyed"
    second = job.trainers(known=set(first.values()))      # the next incarnation, new processes
    assert job.wait() == 0, job.text()
    text = job.text()
    stopped_at = _committed(job.ckpt)[0]                  # the stop's emergency checkpoint
    assert f"step {stopped_at}" in text, text             # the next group resumed from it
    assert all(_gone(pid, within_s=5.0) for pid in first.values())
    assert set(second.values()).isdisjoint(first.values())
    assert _same_weights(tmp_path / "resumed.pt", uninterrupted)
    assert job.finally_ran() == ["rollout", "trainer0", "trainer1"]
    assert job.resources() == 0
    assert job.processes() == []


def test_sigkill_of_one_training_actor_is_rescued_and_its_group_recreated_losing_at_most_a_step(
        uninterrupted: Path, tmp_path: Path) -> None:
    # Periodic saves every 10 steps; the kill lands between them (after step 13).
    job = Job(tmp_path, tmp_path / "ckpt", "--supervise", "--steps", "60", "--every", "10",
              "--out", str(tmp_path / "resumed.pt"))
    job.wait_training(step=13)
    first = job.trainers()
    reached = job.step()
    os.kill(first[1], signal.SIGKILL)
    job.trainers(known=set(first.values()))               # the recreated group
    assert job.wait() == 0, job.text()
    text = job.text()
    rescued = int(text.split("rescue: committed step ")[1].split()[0])
    assert rescued >= reached - 1 and rescued % 10, text   # the rescue, not the periodic save
    assert f"(step {rescued})" in text, text               # the next group resumed from it
    assert _same_weights(tmp_path / "resumed.pt", uninterrupted)
    assert job.resources() == 0
    assert job.processes() == []


def test_with_warm_the_survivor_of_a_sigkilled_actor_trains_on_in_its_own_process_bitwise(
        uninterrupted: Path, tmp_path: Path) -> None:
    job = Job(tmp_path, tmp_path / "ckpt", "--supervise", "--warm", "--steps", "60",
              "--every", "10", "--out", str(tmp_path / "resumed.pt"))
    job.wait_training(step=13)
    first = job.trainers()
    os.kill(first[1], signal.SIGKILL)
    assert job.wait() == 0, job.text()
    text = job.text()
    assert "rescue: committed step " in text, text
    # Every call of the run in a process: the survivor's in its own, and one new process.
    used = {int(p.name.split(".")[1]) for p in (job.work / "pids").glob("r[0-9]*.*")}
    assert len(used) == 3 and first[0] in used, sorted(used)
    assert _same_weights(tmp_path / "resumed.pt", uninterrupted)
    assert job.resources() == 0
    assert job.processes() == []


def test_an_actor_dying_in_a_long_post_step_phase_is_said_one_boundary_behind_in_one_line(
        uninterrupted: Path, tmp_path: Path) -> None:
    # Rank 1 dies after its step's all-reduce, in a long post-step phase (a weight sync, an
    # eval): rank 0 reached the step's boundary, rank 1's last boundary (held by its buddy) is
    # the one before. docs/ray.md promises no rescue (never a checkpoint of mixed steps), one
    # line that says so, and the group back from the periodic save.
    job = Job(tmp_path, tmp_path / "ckpt", "--supervise", "--steps", "60", "--every", "10",
              "--post-step", "13", "--out", str(tmp_path / "resumed.pt"))
    job.wait_training(step=13)
    while not (job.work / "post-step").exists():
        assert job.proc.poll() is None, job.text()
        time.sleep(0.05)
    first = job.trainers()
    os.kill(first[1], signal.SIGKILL)
    assert job.wait() == 0, job.text()
    text = job.text()
    said = re.findall(r"rescue skipped: no state of step (\d+) from rank\(s\) \[1\]: rank 1 is "
                      r"one boundary behind, at step (\d+)", text)
    assert len(said) == 1, text
    assert int(said[0][1]) == int(said[0][0]) - 1, said
    assert "rescue: committed step" not in text, text
    assert "(step 10, reason periodic)" in text, text     # the next group resumed from it
    assert _same_weights(tmp_path / "resumed.pt", uninterrupted)
    assert job.resources() == 0
    assert job.processes() == []


@pytest.mark.parametrize("shape", ["get", "supervise"])
def test_sigterm_to_the_asyncio_rollout_actor_cancels_every_episode_and_the_job_runs_again(
        tmp_path: Path, shape: str) -> None:
    # Ray's kill without force, a node drain, an eviction of the rollout actor: SIGTERM to its
    # own process, whose event loop runs in a thread the signal's handler does not run on. The
    # training cannot go on without it: it stops with a checkpoint and asks to run again.
    job = Job(tmp_path, tmp_path / "ckpt", "--steps", "400",
              *(["--supervise"] if shape == "supervise" else []))
    job.wait_training()
    rollout = job.rollout_pid()
    os.kill(rollout, signal.SIGTERM)
    assert _gone(rollout, within_s=25.0), job.text()      # signals.grace_per_signal_s SIGTERM
    assert "rollout" in job.finally_ran(), job.text()
    assert job.resources() == 0, job.text()               # every episode's finally ran
    code = job.wait()
    text = job.text()
    assert code == ExitCode.REQUEUE, text                 # never 0, never 1
    assert "a rollout or helper actor was stopped" in text, text
    assert "Traceback" not in text, text
    assert len(_committed(job.ckpt)) == 1, text
    assert job.processes() == []


def test_sigterm_to_a_training_actor_of_the_plain_job_ends_the_driver_with_75_not_0(
        tmp_path: Path) -> None:
    # docs/ray.md's plain shape (driver.get on the training calls): the actor's eviction stops
    # its group at one boundary with a checkpoint; the driver must not report the job done.
    job = Job(tmp_path, tmp_path / "ckpt", "--steps", "400")
    job.wait_training()
    os.kill(job.trainers()[1], signal.SIGTERM)
    code = job.wait()
    text = job.text()
    assert code == ExitCode.REQUEUE, text
    assert "trained" not in text, text                    # the script's own "done" line
    assert len(_committed(job.ckpt)) == 1, text
    assert job.resources() == 0
    assert job.processes() == []


@pytest.mark.slurm
def test_usr1_to_the_ray_template_stops_every_actor_at_one_step_requeues_and_resumes_bitwise(
        slurm_cluster, uninterrupted: Path, tmp_path: Path) -> None:
    from kempner_resilience.slurm import render_sbatch

    work, ckpt, out, log = tmp_path / "work", tmp_path / "ckpt", tmp_path / "out.pt", \
        tmp_path / "job.out"
    (work / "resources").mkdir(parents=True)
    tag = f"kr-ray-test-{uuid.uuid4().hex}"
    script = tmp_path / "ray.sbatch"
    script.write_text(render_sbatch(
        template="ray", nodes=1, time="00:10:00", job_name="raytest", output=str(log),
        extra={"cpus-per-task": 3},
        command=[sys.executable, str(JOB), "--supervise", "--ckpt", str(ckpt), "--work",
                 str(work), "--steps", "60", "--out", str(out)]))
    env = {**os.environ, "KR_RAY_TEST_TAG": tag, "RAY_DEDUP_LOGS": "0",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}   # `ray` for the script
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
    # Both actors stopped at one step boundary, and their checkpoint of it was committed.
    stops = [int(f.read_text()) for f in (work / "steps").iterdir()]
    stops = [s for s in stops if s < 60]                  # the first run's; the second ends at 60
    assert len(stops) == 2 and len(set(stops)) == 1, (stops, text[-4000:])
    stopped_at = stops[0]
    assert stopped_at in _committed(ckpt)
    assert f"(step {stopped_at}, reason emergency)" in text, text[-4000:]   # the requeued run
    assert _same_weights(out, uninterrupted)
    assert wait_for(lambda: _tagged(tag) == [], timeout=30, what="no process of the job left")


@pytest.mark.slurm
def test_the_ray_template_spans_the_allocation_with_one_ray_node_per_slurm_node(
        multinode_cluster, uninterrupted: Path, tmp_path: Path) -> None:
    from kempner_resilience.slurm import render_sbatch

    work, out, log = tmp_path / "work", tmp_path / "out.pt", tmp_path / "job.out"
    (work / "resources").mkdir(parents=True)
    tag = f"kr-ray-test-{uuid.uuid4().hex}"
    script = tmp_path / "ray.sbatch"
    # One CPU for Ray on each node, one training actor each: rank 1 waits for the second node.
    script.write_text(render_sbatch(
        template="ray", nodes=2, time="00:10:00", job_name="raymn", output=str(log),
        extra={"cpus-per-task": 1, "partition": "mn"},
        command=[sys.executable, str(JOB), "--supervise", "--ckpt", str(tmp_path / "ckpt"),
                 "--work", str(work), "--steps", "60", "--sleep", "0", "--resources", "5",
                 "--out", str(out)]))
    env = {**multinode_cluster.env, "KR_RAY_TEST_TAG": tag, "RAY_DEDUP_LOGS": "0",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("RANK", None)
    job_id = submit(str(script), cwd=tmp_path, env=env)
    info = wait_job(job_id, timeout=240, env=multinode_cluster.env)
    text = log.read_text(errors="replace")
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text[-4000:]
    hosts = {(work / "pids" / f"host.r{r}").read_text() for r in (0, 1)}
    assert len(hosts) == 2, text[-4000:]            # the actors ran on both nodes
    assert _same_weights(out, uninterrupted)
    assert wait_for(lambda: _tagged(tag) == [], timeout=30, what="no process of the job left")


@pytest.mark.slurm
def test_a_ray_node_dying_under_an_actor_is_rescued_and_the_job_requeued_without_that_node(
        slow_death, uninterrupted: Path, tmp_path: Path) -> None:
    # slow_death: SLURM's production SlurmdTimeout (300 s), so that SLURM does not notice the
    # dead node (and requeue the job itself) before the driver does.
    import json

    from kempner_resilience.slurm import render_sbatch

    cluster = slow_death
    work, ckpt, out, log = tmp_path / "work", tmp_path / "ckpt", tmp_path / "out.pt", \
        tmp_path / "job.out"
    (work / "resources").mkdir(parents=True)
    tag = f"kr-ray-test-{uuid.uuid4().hex}"
    script = tmp_path / "ray.sbatch"
    script.write_text(render_sbatch(
        template="ray", nodes=2, time="00:10:00", job_name="raydeath", output=str(log),
        extra={"cpus-per-task": 1, "partition": "mn"},
        command=[sys.executable, str(JOB), "--supervise", "--ckpt", str(ckpt), "--work",
                 str(work), "--steps", "60", "--every", "10", "--resources", "5",
                 "--out", str(out)]))
    env = {**cluster.env, "KR_RAY_TEST_TAG": tag, "RAY_DEDUP_LOGS": "0",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env.pop("RANK", None)
    job_id = submit(str(script), cwd=tmp_path, env=env)
    killed = None
    try:
        progress = work / "progress"
        wait_for(lambda: progress.is_file() and int(progress.read_text() or -1) >= 13,
                 timeout=180, what="the first run past step 13")
        batch_host = wait_job(job_id, {"RUNNING"}, env=cluster.env)["BatchHost"]
        hosts = {r: (work / "pids" / f"host.r{r}").read_text() for r in (0, 1)}
        killed = next(h for h in hosts.values() if h != batch_host)   # not the driver's node
        cluster.kill_node(killed)
        wait_for(lambda: f"job {job_id} requeued" in log.read_text(errors="replace"),
                 timeout=150, what="the driver's requeue")
        # The old job's processes on the dead node never report their end: SLURM keeps the job
        # COMPLETING until SlurmdTimeout marks the node DOWN. Marked DOWN now instead, as that
        # timeout (or a node health check) would.
        subprocess.run(["scontrol", "update", f"NodeName={killed}", "State=DOWN",
                        "Reason=kr-ray-test"], env=cluster.env, check=True, timeout=30)
        info = wait_job(job_id, timeout=240, env=cluster.env)
        text = log.read_text(errors="replace")
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", text[-4000:]
        assert info["Restarts"] == "1", text[-4000:]
        assert killed in info.get("ExcNodeList", ""), info      # the driver's requeue kept it out
        assert killed in json.loads((ckpt / "bad-nodes.json").read_text())["nodes"]
        if "rescue: committed step " in text:
            rescued = int(text.split("rescue: committed step ")[1].split()[0])
            assert rescued >= 13 and rescued % 10, text[-4000:]
            assert f"(step {rescued}, reason rescue)" in text, text[-4000:]   # the requeued run
        else:
            # The documented fallback (docs/design.md, "Never a checkpoint that mixes steps"):
            # the dead node's rank died after the step's all-reduce but before its boundary, so
            # nobody holds its RNG and data position at the survivor's step. Said, and the
            # requeued run resumes from the periodic save.
            assert re.search(r"rescue skipped: no state of step \d+ from rank\(s\) \[1\]",
                             text), text[-4000:]
            assert re.search(r"\(step \d+0, reason periodic\)", text), text[-4000:]
        assert killed not in {(work / "pids" / f"host.r{r}").read_text() for r in (0, 1)}
        assert _same_weights(out, uninterrupted)
    finally:
        subprocess.run(["scancel", job_id], env=cluster.env, timeout=30)
        if killed is not None:
            subprocess.run(["scontrol", "update", f"NodeName={killed}", "State=RESUME"],
                           env=cluster.env, timeout=30)
            cluster.restart_node(killed)
