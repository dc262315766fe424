"""Teardown: cleanups run newest first, each bounded, isolated from the others' failures."""

import sys
import threading
import time

from helpers import run_script, write_script
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.stop.teardown import TeardownStack


def test_cleanups_run_newest_first():
    order = []
    stack = TeardownStack()
    stack.add(lambda: order.append("logger"), name="logger")
    stack.add(lambda: order.append("executor"), name="executor")
    stack.run()
    assert order == ["executor", "logger"]


def test_a_hanging_cleanup_is_abandoned_after_its_timeout_and_the_others_still_run():
    order = []
    never = threading.Event()
    stack = TeardownStack()
    stack.add(lambda: order.append("first registered"), name="first")
    stack.add(never.wait, name="stuck server", timeout_s=0.3)
    stack.add(lambda: order.append("last registered"), name="last")
    results = {r.name: r for r in stack.run()}
    assert order == ["last registered", "first registered"]
    assert not results["stuck server"].ok
    assert "timed out" in results["stuck server"].error
    never.set()


def test_a_failing_cleanup_does_not_stop_the_others():
    order = []
    stack = TeardownStack()
    stack.add(lambda: order.append("ran"), name="ok")
    stack.add(lambda: 1 / 0, name="broken")
    results = stack.run()
    assert order == ["ran"]
    assert [r.ok for r in results] == [False, True]
    assert "ZeroDivisionError" in results[0].error


def test_each_cleanup_runs_once():
    calls = []
    stack = TeardownStack()
    stack.add(lambda: calls.append(1))
    stack.run()
    stack.run()
    assert calls == [1]


EXECUTOR = """
import concurrent.futures, os, signal, threading, time
import kempner_resilience as kr

cfg = kr.load_config(overrides=["watchdog.hang_timeout_s=0", "watchdog.exit_timeout_s=2",
                                "watchdog.cleanup_timeout_s=1"])
with kr.ResilientRun(cfg) as run:
    pool = run.add_executor(concurrent.futures.ThreadPoolExecutor(2))
    pool.submit(threading.Event().wait)          # runs forever
    queued = [pool.submit(time.sleep, 1) for _ in range(20)]
    run.add_cleanup(lambda: print("user cleanup ran", flush=True), name="user")
    for step in run.steps(100):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
"""


def test_an_executor_with_a_stuck_task_does_not_keep_the_process_alive(tmp_path):
    proc = run_script([sys.executable, write_script(tmp_path, EXECUTOR)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == ExitCode.SIGTERM, proc.stderr
    assert "user cleanup ran" in proc.stdout
    assert "did not finish" in proc.stderr  # the executor shutdown was abandoned, logged


def test_teardown_time_is_bounded_by_the_deadline():
    stack = TeardownStack(default_timeout_s=30)
    stack.add(threading.Event().wait, name="stuck")
    t0 = time.monotonic()
    results = stack.run(deadline=time.monotonic() + 0.2)
    assert not results[0].ok
    assert time.monotonic() - t0 < 10
