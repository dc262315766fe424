"""How a run that ended leaves: `exit` ends the process within its bound, `raise` leaves the
caller alive, `auto` picks `raise` in a notebook kernel. Real processes, a real signal."""

from __future__ import annotations

import subprocess
import sys

import pytest

from helpers import env, run_script, write_script
from kempner_resilience.exitcodes import ExitCode

EXIT_TIMEOUT_S = 1.0

# A caller that catches the SystemExit of a requeue-stop and goes on working for a while.
CATCHES_SYSTEM_EXIT = """
import os, signal, sys, time
import kempner_resilience as kr

cfg = kr.load_config(overrides=["watchdog.exit_timeout_s=%s", "watchdog.hang_timeout_s=0",
                                f"watchdog.exit_mode={sys.argv[1]}"])
try:
    with kr.ResilientRun(cfg) as run:
        for step in run.steps(100):
            if step == 2:
                os.kill(os.getpid(), signal.SIGUSR1)
except SystemExit as e:
    print("caught", e.code, "mode", run.exit_mode.value, flush=True)
time.sleep(%s)            # well past exit_timeout_s
print("still alive", flush=True)
""" % (EXIT_TIMEOUT_S, 4 * EXIT_TIMEOUT_S)


def _run(tmp_path, mode: str, **extra_env: str) -> subprocess.CompletedProcess:
    script = write_script(tmp_path, CATCHES_SYSTEM_EXIT)
    e = env(**extra_env)
    for k in ("SLURM_JOB_ID", "RANK"):
        if k not in extra_env:
            e.pop(k, None)
    return run_script([sys.executable, str(script), mode], capture_output=True, text=True,
                          timeout=120, env=e)


def test_raise_mode_leaves_a_caller_that_catches_system_exit_alive_and_its_exit_code_alone(
        tmp_path):
    proc = _run(tmp_path, "raise")
    assert f"caught {int(ExitCode.REQUEUE)} mode raise" in proc.stdout, proc.stderr
    assert "still alive" in proc.stdout
    assert proc.returncode == 0


# A test runner that ran a run in its own process, then exits slowly with its own code.
SLOW_CALLER_EXIT = """
import atexit, os, signal, sys, time
import torch.nn as nn
import kempner_resilience as kr

cfg = kr.load_config(overrides=["watchdog.exit_timeout_s=%s", "watchdog.hang_timeout_s=0",
                                "watchdog.exit_mode=raise", f"checkpoint.dir={sys.argv[1]}"])
try:
    with kr.ResilientRun(cfg, state={"model": nn.Linear(4, 4)}) as run:
        for step in run.steps(100):
            if step == 2:
                os.kill(os.getpid(), signal.SIGUSR1)
except SystemExit:
    pass
atexit.register(time.sleep, %s)     # the caller's own slow finalisation
sys.exit(3)                          # and its own verdict, e.g. a failed test
""" % (EXIT_TIMEOUT_S, 4 * EXIT_TIMEOUT_S)


def test_raise_mode_never_bounds_or_recodes_the_callers_later_slow_exit(tmp_path):
    script = write_script(tmp_path, SLOW_CALLER_EXIT)
    e = env()
    for k in ("SLURM_JOB_ID", "RANK"):
        e.pop(k, None)
    proc = run_script([sys.executable, str(script), str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=120, env=e)
    assert proc.returncode == 3, proc.stderr


# A plain script (raise mode: no RANK, no SLURM) whose run's SystemExit reaches its top level.
# The state's finalizer runs only in the interpreter's finalisation.
# A script that catches the run's SystemExit at its top level and exits with its own code.
REPLACES_THE_CODE = """
import os, signal
import kempner_resilience as kr

cfg = kr.load_config(overrides=["watchdog.hang_timeout_s=0"])
try:
    with kr.ResilientRun(cfg) as run:
        for step in run.steps(100):
            if step == 2:
                os.kill(os.getpid(), signal.SIGUSR1)
except SystemExit:
    raise SystemExit(3)
"""


def test_a_script_that_replaces_the_runs_system_exit_at_its_top_level_exits_with_its_own_code(
        tmp_path):
    """Module-level ``except SystemExit: raise SystemExit(3)`` (as submitit's local task turns
    75 into 144): the run's exception is dropped at the top level as the new one's context, and
    the process must still exit 3, not with the run's 75."""
    script = write_script(tmp_path, REPLACES_THE_CODE)
    e = env()
    for k in ("SLURM_JOB_ID", "RANK"):
        e.pop(k, None)
    proc = run_script([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, env=e)
    assert proc.returncode == 3, proc.stderr


def test_exit_mode_ends_the_process_with_the_run_code_within_exit_timeout(tmp_path):
    proc = _run(tmp_path, "exit")
    assert f"caught {int(ExitCode.REQUEUE)} mode exit" in proc.stdout, proc.stderr
    assert "still alive" not in proc.stdout
    assert proc.returncode == ExitCode.REQUEUE


@pytest.mark.parametrize("variables, mode", [({}, "raise"), ({"RANK": "0"}, "exit")])
def test_auto_mode_exits_in_a_launched_rank_and_raises_otherwise(tmp_path, variables, mode):
    proc = _run(tmp_path, "auto", **variables)
    assert f"mode {mode}" in proc.stdout, proc.stderr
    assert ("still alive" in proc.stdout) == (mode == "raise")


def test_auto_mode_in_a_notebook_kernel_raises_and_the_kernel_lives_on(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    cells = [
        "import os, signal\nimport kempner_resilience as kr\n"
        f"cfg = kr.load_config(overrides=['watchdog.exit_timeout_s={EXIT_TIMEOUT_S}',"
        " 'watchdog.hang_timeout_s=0'])\n"
        "try:\n"
        "    with kr.ResilientRun(cfg) as run:\n"
        "        for step in run.steps(100):\n"
        "            if step == 2:\n"
        "                os.kill(os.getpid(), signal.SIGUSR1)\n"
        "except SystemExit as e:\n"
        "    print('caught', e.code, 'mode', run.exit_mode.value)",
        f"import time\ntime.sleep({4 * EXIT_TIMEOUT_S})\nprint('kernel still alive')",
    ]
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c) for c in cells])
    e = env()
    for k in ("SLURM_JOB_ID", "RANK"):
        e.pop(k, None)
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=e)
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert f"caught {int(ExitCode.REQUEUE)} mode raise" in text
    assert "kernel still alive" in text
