"""A lost worker group comes back warm: its live actors are parked and reborn, not new processes
(supervise/ray/parking.py). Real local Ray, gloo on CPU, real processes: tests/ray_warm_job.py.
The whole job with a spare is in tests/test_ray_loop.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import env, tagged_processes
from slurm_fixtures import require_modules

JOB = Path(__file__).with_name("ray_warm_job.py")
pytestmark = [pytest.mark.slow, pytest.mark.ray]


@pytest.fixture(scope="module", autouse=True)
def _ray_installed() -> None:
    require_modules("ray")


def _run(*args: str) -> dict:
    e = env()
    e.pop("RANK", None)
    proc = subprocess.run([sys.executable, str(JOB), *args], capture_output=True, text=True,
                          timeout=300, env=e)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


def test_five_rebirths_keep_the_processes_and_leave_no_thread_descriptor_or_state_behind():
    out = _run("cycles", "6")
    seen = out["censuses"]
    pids = [[c["pid"] for c in group] for group in seen]
    assert all(p == pids[0] for p in pids), pids                  # the same two processes
    for group in seen:
        for c in group:
            assert c["calls"] == 1                     # a new object each time, not the old one
            assert c["weight"] == out["cold_weight"]   # as a new actor's __init__ builds it
            assert c["world"] == 2
    # After the first incarnation, five more leave the threads and descriptors as they were.
    first, last = seen[0], seen[-1]
    for a, b in zip(sorted(first, key=lambda c: c["pid"]), sorted(last, key=lambda c: c["pid"])):
        assert (b["threads"], b["fds"]) == (a["threads"], a["fds"]), (first, last)
    assert out["left_after_the_loop"] == []      # the parked actors went with the loop


def test_an_actor_whose_call_never_ended_is_never_reused_and_a_new_process_takes_its_rank():
    out = _run("hang")
    assert out["lost"] and "did not answer" in out["lost"], out
    before = {c["rank"]: c["pid"] for c in out["before"]}
    after = {c["rank"]: c["pid"] for c in out["after"]}
    assert before[0] in after.values()               # the rank whose call ended: reused
    assert before[1] not in after.values()           # the hung one: killed, replaced
    with pytest.raises(ProcessLookupError):
        os.kill(before[1], 0)


def test_a_rank_stuck_in_a_collective_with_a_hung_peer_is_never_reused_either():
    # NCCL's case after a peer's death: the survivor waits in the collective, its
    # communicator cannot be trusted again.
    out = _run("hang-in-collective")
    assert out["lost"] and "did not answer" in out["lost"], out
    before = {c["pid"] for c in out["before"]}
    after = {c["pid"] for c in out["after"]}
    assert not before & after, (before, after)


WARM_WORKERS = """
import json, os, sys, time
import ray
import kempner_resilience.ray as krr

ray.init(num_cpus=2, include_dashboard=False, runtime_env=krr.warm_runtime_env())

@ray.remote(num_cpus=1)
class Probe:
    def info(self):
        return {"torch_at_start": "torch._dynamo" in sys.modules,
                "parent": open(f"/proc/{os.getppid()}/cmdline", "rb").read().decode(),
                "pid": os.getpid()}

first = Probe.remote()
seen = [ray.get(first.info.remote())]
ray.kill(first)
seen.append(ray.get(Probe.remote().info.remote()))      # the one that replaces it
ray.shutdown()
print("RESULT " + json.dumps(seen), flush=True)
"""


def test_ray_workers_on_the_drivers_node_fork_warm_and_leave_nothing_behind(tmp_path):
    """An actor, and the one that replaces it, starts in a process that imported torch
    already (forked by the driver's zygote, through Ray's py_executable); once the driver
    is gone, no process of its zygote is left."""
    script = tmp_path / "driver.py"
    script.write_text(WARM_WORKERS)
    e = env(KEMPNER_RESILIENCE_WARM="1", KR_WARM_RAY_TAG=str(tmp_path))
    e.pop("RANK", None)
    e.pop("KEMPNER_RESILIENCE_STANDBY", None)     # the driver's own zygote, found by the tag
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env=e, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seen = json.loads(proc.stdout.split("RESULT ", 1)[1])
    assert [s["torch_at_start"] for s in seen] == [True, True]
    assert all("supervise/local/warm.py" in s["parent"] for s in seen)
    assert seen[0]["pid"] != seen[1]["pid"]
    assert tagged_processes(f"KR_WARM_RAY_TAG={tmp_path}", settle_s=10.0) == []
