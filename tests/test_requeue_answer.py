"""SLURM answers a requeue with a SIGTERM to every process of the job, often twice where a batch
shell passes signals on (the Ray template). That answer never replaces the code the run
decided (75) with a forced or default 143. Real processes and real signals; the `scontrol` on
PATH is a fake that plays SLURM's part: it SIGTERMs the rank that called it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from helpers import env, run_script, spawn_script, write_script
from kempner_resilience.exitcodes import ExitCode
from slurm_fixtures import require_modules

# Two SIGTERMs to the rank (scontrol's parent) when asked to requeue, as slurmstepd and the
# Ray template's trap send them; the rest of what a rank asks SLURM, answered plainly.
FAKE_SCONTROL = """#!/bin/bash
case "$1" in
  requeue) kill -TERM $PPID; sleep 0.05; kill -TERM $PPID; exit 0 ;;
  show) [ "$2" = "-o" ] && echo "JobId=5 JobName=t JobState=RUNNING Requeue=1 Restarts=0 \
TimeLimit=00:10:00 EndTime=2030-01-01T00:00:00 Partition=low"; exit 0 ;;
  *) exit 1 ;;
esac
"""

TRAIN = """
import atexit, os, signal, sys, time
import torch
import kempner_resilience as kr

cfg = kr.load_config(overrides=[f"checkpoint.dir={sys.argv[1]}", "watchdog.hang_timeout_s=0",
                                "requeue.time_limit_stop=false", "watchdog.exit_mode=exit"])
if sys.argv[2] == "at-exit":
    # A library's exit hook (ray.shutdown) still running when SLURM's SIGTERM comes.
    atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(0.3)))
with kr.ResilientRun(cfg, state={"model": torch.nn.Linear(4, 4)}) as run:
    for step in run.steps(100):
        if step == 3:
            os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.01)
"""


def _rank_of_job_5(tmp_path: Path, when: str) -> subprocess.CompletedProcess:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "scontrol").write_text(FAKE_SCONTROL)
    (bindir / "scontrol").chmod(0o755)
    e = {k: v for k, v in env().items() if not k.startswith("SLURM")}
    e |= {"PATH": f"{bindir}:/usr/bin:/bin", "SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0",
          "SLURM_PROCID": "0", "SLURM_NTASKS": "1", "SLURM_OPEN_MODE": "a"}
    script = write_script(tmp_path, TRAIN)
    return run_script([sys.executable, str(script), str(tmp_path / "ckpt"), when],
                          capture_output=True, text=True, timeout=120, env=e)


def test_a_rank_whose_requeue_is_answered_by_two_sigterms_leaves_with_75(tmp_path):
    proc = _rank_of_job_5(tmp_path, "at-requeue")
    assert proc.returncode == ExitCode.REQUEUE, proc.stderr[-3000:]
    assert "second SIGTERM" not in proc.stderr
    assert any(p.name.startswith("step_") for p in (tmp_path / "ckpt").iterdir())


def test_a_sigterm_during_the_interpreter_exit_after_a_requeue_keeps_the_code_75(tmp_path):
    proc = _rank_of_job_5(tmp_path, "at-exit")
    assert proc.returncode == ExitCode.REQUEUE, proc.stderr[-3000:]


# A Ray driver leaving after a stop (`RayRun`, raise mode) keeps its code through the handlers
# that replace the run's; SIGTERMs keep coming until the process is gone.
KEEPS_THE_CODE = """
import sys, time
from kempner_resilience.run.ray_run import _keep_the_stop_code

_keep_the_stop_code(75)
open(sys.argv[1], "w").close()
time.sleep(0.5)
sys.exit(75)
"""


def _under_sigterms(tmp_path, source: str, environ: dict[str, str], pause: str = ":",
                    timeout: float = 60) -> tuple[int, str]:
    """Run ``source`` (it creates the file named by its first argument once its handlers are in
    place) with SIGTERMs back to back from then to its end; its exit code and stderr."""
    ready = tmp_path / "ready"
    script = write_script(tmp_path, source)
    driver = spawn_script([sys.executable, str(script), str(ready)], env=environ,
                          stderr=subprocess.PIPE, text=True)
    storm = subprocess.Popen(["bash", "-c", f"until [ -e {ready} ]; do sleep 0.01; done; "
                              f"while kill -TERM {driver.pid} 2>/dev/null; do {pause}; done"])
    try:
        _, err = driver.communicate(timeout=timeout)
    finally:
        storm.kill()
        storm.wait()
    return driver.returncode, err


def test_a_ray_driver_leaving_after_a_stop_keeps_its_code_under_sigterms_until_it_is_gone(
        tmp_path):
    code, err = _under_sigterms(tmp_path, KEEPS_THE_CODE, env())
    assert code == 75, err[-2000:]
    assert "SIGTERM after the stop: the driver still leaves with 75" in err


# The same through Ray's own shutdown, which the driver's script calls after the stop: SIGTERMs
# back to back while Ray's core worker shuts down (it used to set SIGTERM's action back to the
# default a moment in, for a second or more).
THROUGH_RAY_SHUTDOWN = """
import sys
import ray
from kempner_resilience.run.ray_run import _keep_the_stop_code
from kempner_resilience.supervise.ray.driver import clear_ray_handlers

ray.init(num_cpus=1, include_dashboard=False)
clear_ray_handlers([])              # what entering a RayRun or a RayDriver does
_keep_the_stop_code(130)
open(sys.argv[1], "w").close()
ray.shutdown()
sys.exit(130)
"""


@pytest.mark.ray
def test_a_ray_driver_keeps_its_stop_code_under_sigterms_during_ray_shutdown(tmp_path):
    require_modules("ray")
    e = env()
    e.pop("RANK", None)
    code, err = _under_sigterms(tmp_path, THROUGH_RAY_SHUTDOWN, e, pause="sleep 0.005",
                                timeout=120)
    assert code == 130, err[-2000:]


# Ray's shutdown sets SIGTERM back to the default action behind Python's back (its core
# worker's failure-signal handler goes); the package's shutdown puts the handler back.
AFTER_RAY = """
import os, signal, sys, time
import ray
from kempner_resilience.supervise.ray.driver import shutdown_ray

ray.init(num_cpus=1, include_dashboard=False)
signal.signal(signal.SIGTERM, lambda *a: print("handled", flush=True))
shutdown_ray()
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(0.5)
print("alive", flush=True)
"""


@pytest.mark.ray
def test_after_ray_shuts_down_a_sigterm_still_meets_the_handler_python_names(tmp_path):
    require_modules("ray")
    e = env()
    e.pop("RANK", None)
    proc = run_script([sys.executable, str(write_script(tmp_path, AFTER_RAY))],
                          capture_output=True, text=True, timeout=120, env=e)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "handled" in proc.stdout and "alive" in proc.stdout
