"""Hang watchdog: a stuck step ends the process with HANG and every thread's stack.

Two kinds of hang: one that releases the GIL (a gloo collective whose peer never arrives), where
a Python thread can act, and one that holds it (a C call that never returns, made through
ctypes.PyDLL), where only the kernel-timer backstop can. A catastrophic regex would not do for
the second: the `re` engine checks for signals, so a SIGALRM-based watchdog would wrongly pass.
"""

import sys
import time

from helpers import rank0_with_stuck_peer, run_script, wait_for_file, write_script
from kempner_resilience.exitcodes import ExitCode

HANG_IN_ALLREDUCE = """
import os, sys, time
import torch, torch.distributed as dist
import kempner_resilience as kr

rank, port, stamp, timeout = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=2)
if rank == 1:
    for _ in range(3):
        dist.all_reduce(torch.ones(1))
    time.sleep(600)  # then never joins again
cfg = kr.load_config(overrides=[f"watchdog.hang_timeout_s={timeout}"])
with kr.ResilientRun(cfg) as run:
    for step in run.steps(10):
        open(stamp, "w").write(repr(time.monotonic()))
        dist.all_reduce(torch.ones(1))
"""

HANG_HOLDING_THE_GIL = """
import ctypes, sys, time
import kempner_resilience as kr

stamp, timeout = sys.argv[1], sys.argv[2]
cfg = kr.load_config(overrides=[f"watchdog.hang_timeout_s={timeout}"])
with kr.ResilientRun(cfg) as run:
    for step in run.steps(10):
        time.sleep(0.05)
        if step == 3:
            open(stamp, "w").write(repr(time.monotonic()))
            # PyDLL keeps the GIL across the call: no Python thread can run any more.
            lib = ctypes.PyDLL(None)
            mutex = ctypes.create_string_buffer(64)
            lib.pthread_mutex_init(mutex, None)
            lib.pthread_mutex_lock(mutex)
            lib.pthread_mutex_lock(mutex)
"""


def test_hang_in_a_gloo_collective_exits_with_hang_code_and_stacks(tmp_path):
    timeout = 3.0
    script, stamp = write_script(tmp_path, HANG_IN_ALLREDUCE), tmp_path / "stamp"
    with rank0_with_stuck_peer(script, str(stamp), str(timeout)) as proc:
        _, err = proc.communicate(timeout=120)
        ended = time.monotonic()
    assert proc.returncode == ExitCode.HANG, err
    # CLOCK_MONOTONIC is system-wide on Linux: the child's stamp compares with our clock.
    stuck_for = ended - float(stamp.read_text())
    assert timeout <= stuck_for <= timeout + 2.0, f"exited {stuck_for:.2f} s after the last step"
    assert "hang detected" in err
    assert "all_reduce" in err


def test_hang_that_holds_the_gil_still_exits_with_hang_code_and_stacks(tmp_path):
    timeout = 2.0
    stamp = tmp_path / "stamp"
    script = write_script(tmp_path, HANG_HOLDING_THE_GIL)
    proc = run_script([sys.executable, script, str(stamp), str(timeout)],
                          capture_output=True, text=True, timeout=120)
    ended = time.monotonic()
    assert proc.returncode == ExitCode.HANG, proc.stderr
    stuck_for = ended - float(stamp.read_text())
    assert timeout <= stuck_for <= timeout + 2.0, f"exited {stuck_for:.2f} s after the last step"
    assert "Current thread" in proc.stderr or "Thread 0x" in proc.stderr  # faulthandler's dump
    assert "script.py" in proc.stderr


def test_steady_progress_is_not_a_hang(tmp_path):
    script = write_script(tmp_path, """
        import time
        import kempner_resilience as kr
        cfg = kr.load_config(overrides=["watchdog.hang_timeout_s=0.5"])
        with kr.ResilientRun(cfg) as run:
            for step in run.steps(40):
                time.sleep(0.05)   # 2 s in all, each step well inside the budget
        print("done")
    """)
    proc = run_script([sys.executable, script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "done" in proc.stdout


def test_stamp_file_helper_waits(tmp_path):
    (tmp_path / "x").write_text("ok")
    assert wait_for_file(tmp_path / "x") == "ok"


SLOW_SAVE = """
import sys, time
import kempner_resilience as kr

class SlowToSave:
    # Stands in for a large state: writing its checkpoint takes longer than the hang timeout.
    def state_dict(self):
        time.sleep(3.0)
        return {"x": 1}

    def load_state_dict(self, sd):
        pass

cfg = kr.load_config(overrides=[f"checkpoint.dir={sys.argv[1]}", "checkpoint.every_steps=3",
                                "watchdog.hang_timeout_s=1.5",
                                "watchdog.checkpoint_timeout_s=60"])
with kr.ResilientRun(cfg, state={"slow": SlowToSave()}) as run:
    for step in run.steps(4):
        time.sleep(0.05)
print("finished", flush=True)
"""


def test_a_checkpoint_save_longer_than_the_hang_timeout_is_not_a_hang(tmp_path):
    script = write_script(tmp_path, SLOW_SAVE)
    proc = run_script([sys.executable, script, str(tmp_path / "ckpt")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "finished" in proc.stdout
    assert (tmp_path / "ckpt" / "step_000000003").is_dir()
