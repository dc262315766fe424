"""Every exit path is bounded: an error that ends the loop never leaves the process behind.

Each rank registers an executor whose task never finishes (as a data-loading or CUDA-work pool
can): at interpreter exit Python would join its threads forever. Real processes, real SIGKILL.
"""

from __future__ import annotations

import subprocess
import sys

from helpers import (communicate_or_stacks, env, free_port, run_script, spawn_script,
                     wait_for_file, write_script)
from kempner_resilience.exitcodes import ExitCode

EXIT_TIMEOUT_S = 3
# cleanups, then the interpreter's exit, plus process start-up slack: far below "forever"
BOUND_S = 2 * EXIT_TIMEOUT_S + 30

SCRIPT = """
import os, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
import kempner_resilience as kr
import torch, torch.distributed as dist
from torch import nn

rank, world, fail_at = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(sys.argv[2])
if world > 1:
    dist.init_process_group("gloo", rank=rank, world_size=world)
model = nn.Linear(16, 16)
cfg = kr.load_config(None, ["watchdog.exit_timeout_s=%d" % EXIT_TIMEOUT_S,
                            "watchdog.cleanup_timeout_s=1", "signals.grace_s=10"])
progress = open(sys.argv[1] + f".{rank}", "a", buffering=1)
with kr.ResilientRun(cfg) as run:
    pool = run.add_executor(ThreadPoolExecutor(2))
    pool.submit(threading.Event().wait)           # never finishes
    for step in run.steps(100_000):
        out = model(torch.randn(4, 16))
        if world > 1:
            dist.all_reduce(out.detach())
        if step == fail_at:
            raise ValueError("a bug in the training step")
        time.sleep(0.02)
        progress.write(f"step {step}\\n")
""".replace("EXIT_TIMEOUT_S", str(EXIT_TIMEOUT_S))


def _start(tmp_path, rank: int, world: int, port: str, fail_at: int = -1):
    script = write_script(tmp_path, SCRIPT)
    return spawn_script([sys.executable, str(script), str(tmp_path / "progress"),
                             str(fail_at)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env(RANK=str(rank), WORLD_SIZE=str(world),
                                               MASTER_ADDR="127.0.0.1", MASTER_PORT=port))


def test_a_rank_whose_peer_is_killed_exits_peer_lost_despite_executors_that_never_finish(
        tmp_path):
    port = str(free_port())
    procs = [_start(tmp_path, r, 2, port) for r in (0, 1)]
    try:
        wait_for_file(tmp_path / "progress.1", contains="step 5\n")
        procs[0].kill()
        _, err = communicate_or_stacks(procs[1], BOUND_S)
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == ExitCode.PEER_LOST, err[-3000:]
    assert "a peer rank is gone" in err and "Traceback" not in err


def test_an_exception_in_the_loop_exits_1_with_its_traceback_despite_executors(tmp_path):
    proc = _start(tmp_path, 0, 1, str(free_port()), fail_at=3)
    try:
        _, err = proc.communicate(timeout=BOUND_S)
    finally:
        proc.kill()
    assert proc.returncode == ExitCode.ERROR
    assert "ValueError: a bug in the training step" in err and "Traceback" in err


GLOO_WORKER_AT_EXIT = """
import ctypes, sys, threading, time
import kempner_resilience
import torch.distributed

def worker():
    # Named as torch names gloo's workers; busy past the script's end, as a worker that still
    # drops a finished collective is. A thread that needs the GIL once finalisation began
    # never gets it: without the wait, "dropped" is never written.
    ctypes.CDLL(None).prctl(15, b"pt_gloo_runloop", 0, 0, 0)
    end = time.monotonic() + 0.2
    while time.monotonic() < end:
        pass
    open(sys.argv[1], "w").write("dropped")
    time.sleep(3600)

threading.Thread(target=worker, daemon=True).start()
time.sleep(0.05)
"""


def test_the_interpreter_exit_waits_for_a_busy_gloo_worker_to_finish_what_it_holds(tmp_path):
    script = tmp_path / "gloo_worker.py"
    script.write_text(GLOO_WORKER_AT_EXIT)
    out = run_script([sys.executable, str(script), str(tmp_path / "dropped")], env=env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "dropped").read_text() == "dropped"
