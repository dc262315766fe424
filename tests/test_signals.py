"""Signals: seen while the main thread is stuck in C, chained, reset in children, escalated.

Every test here uses real processes and real signals (os.kill); nothing about signals is mocked.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers import rank0_with_stuck_peer, run_script, start, wait_for_file, write_script
from kempner_resilience import ShutdownHandler, load_config
from kempner_resilience.exitcodes import ExitCode

BLOCKED_IN_ALLREDUCE = """
import os, sys, time
import torch, torch.distributed as dist
import kempner_resilience as kr

rank, port, ready, grace = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
dist.init_process_group("gloo", rank=rank, world_size=2)
if rank == 1:
    time.sleep(600)  # the peer that never joins the collective
cfg = kr.load_config(overrides=[f"signals.grace_s={grace}", "watchdog.hang_timeout_s=0"])
with kr.ResilientRun(cfg) as run:
    for step in run.steps(10):
        open(ready, "w").write("entering all_reduce")
        dist.all_reduce(torch.ones(1))
"""

LOOP = """
import os, signal, sys, time
import kempner_resilience as kr

total, sleep_s = int(sys.argv[1]), float(sys.argv[2])
kill_at = {int(k): v for k, v in (a.split("=") for a in sys.argv[3:])}
cfg = kr.load_config(overrides=["signals.grace_s=30", "watchdog.hang_timeout_s=0"])
with kr.ResilientRun(cfg) as run:
    for step in run.steps(total):
        print(f"step {step}", flush=True)
        if step in kill_at:
            for name in kill_at[step].split(","):
                os.kill(os.getpid(), int(name) if name.isdigit() else getattr(signal, name))
        time.sleep(sleep_s)
print("loop finished", flush=True)
"""


def ran_steps(stdout: str) -> list[int]:
    return [int(line.split()[1]) for line in stdout.splitlines() if line.startswith("step ")]


def test_signal_while_blocked_in_gloo_allreduce_exits_at_the_deadline_with_a_stack_dump(tmp_path):
    grace = 3.0
    script, ready = write_script(tmp_path, BLOCKED_IN_ALLREDUCE), tmp_path / "ready"
    with rank0_with_stuck_peer(script, str(ready), str(grace)) as proc:
        wait_for_file(ready, timeout=120)
        time.sleep(0.5)  # let it get inside the collective
        assert proc.poll() is None
        sent = time.monotonic()
        os.kill(proc.pid, signal.SIGUSR1)
        _, err = proc.communicate(timeout=grace + 30)
        waited = time.monotonic() - sent
    assert proc.returncode == ExitCode.DEADLINE, err
    assert grace <= waited <= grace + 2.0, f"forced exit after {waited:.2f} s, grace {grace}"
    assert "all_reduce" in err
    assert "shutdown deadline passed" in err


def test_usr1_in_a_normal_loop_stops_at_the_next_step_boundary_with_the_requeue_code(tmp_path):
    proc = run_script([sys.executable, write_script(tmp_path, LOOP), "100", "0.01",
                           "5=SIGUSR1"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == ExitCode.REQUEUE, proc.stderr
    assert ran_steps(proc.stdout) == list(range(6))
    assert "loop finished" not in proc.stdout  # code after the loop must not run


def test_sigterm_stops_at_the_next_boundary_with_143(tmp_path):
    proc = run_script([sys.executable, write_script(tmp_path, LOOP), "100", "0.01",
                           "3=SIGTERM"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 143, proc.stderr
    assert ran_steps(proc.stdout)[-1] == 3


def test_a_signal_with_action_stop_exits_with_stopped(tmp_path):
    script = write_script(tmp_path, LOOP.replace('"watchdog.hang_timeout_s=0"',
                                                 '"watchdog.hang_timeout_s=0", '
                                                 '"signals.actions.SIGUSR2=stop"'))
    proc = run_script([sys.executable, script, "100", "0.01", "2=SIGUSR2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == ExitCode.STOPPED, proc.stderr


def test_single_ctrl_c_stops_gracefully_with_130_and_no_traceback(tmp_path):
    proc = run_script([sys.executable, write_script(tmp_path, LOOP), "100", "0.01",
                           "4=SIGINT"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130
    assert ran_steps(proc.stdout)[-1] == 4
    assert "Traceback" not in proc.stderr
    assert "KeyboardInterrupt" not in proc.stderr


def test_second_ctrl_c_within_a_second_exits_130_at_once(tmp_path):
    # Each step takes 60 s, so only the forced exit can end the process quickly.
    proc = start(write_script(tmp_path, LOOP), "10", "60")
    try:
        assert proc.stdout.readline().startswith("step 0")
        sent = time.monotonic()
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        waited = time.monotonic() - sent
    finally:
        proc.kill()
    assert proc.returncode == 130
    assert waited < 20, "the second Ctrl+C must not wait for the step to finish"
    assert "Traceback" not in err


def test_second_sigterm_exits_143_at_once(tmp_path):
    proc = start(write_script(tmp_path, LOOP), "10", "60")
    try:
        assert proc.stdout.readline().startswith("step 0")
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 143


def _as_torchrun_worker() -> dict[str, str]:
    """The environment `kempner-resilience torchrun` gives its workers: their parent-death
    signal is PARENT_DEATH_SIGNAL, named in the environment."""
    from kempner_resilience.stop.signals import PARENT_DEATH_ENV, PARENT_DEATH_SIGNAL

    return {PARENT_DEATH_ENV: str(PARENT_DEATH_SIGNAL)}


def test_a_parent_death_signal_repeated_by_each_exiting_thread_is_one_graceful_stop_with_143(
        tmp_path):
    # The kernel sends the parent-death signal as each thread of the dying launcher exits: three
    # deliveries, then SLURM's SIGTERM to what is left of the step. One stop at the boundary.
    from kempner_resilience.stop.signals import PARENT_DEATH_SIGNAL

    pdeath = str(PARENT_DEATH_SIGNAL)
    proc = run_script([sys.executable, write_script(tmp_path, LOOP), "100", "0.01",
                           f"3={pdeath},{pdeath},{pdeath},SIGTERM"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **_as_torchrun_worker()})
    assert proc.returncode == ExitCode.SIGTERM, proc.stderr
    assert ran_steps(proc.stdout)[-1] == 3
    assert "second SIGTERM during shutdown" not in proc.stderr
    assert proc.stderr.count("died") == 1, proc.stderr


@pytest.mark.parametrize("first", [[], ["parent death"]])
def test_a_second_sigterm_still_forces_a_torchrun_worker_out_at_once(tmp_path, first):
    from kempner_resilience.stop.signals import PARENT_DEATH_SIGNAL

    proc = start(write_script(tmp_path, LOOP), "10", "60", **_as_torchrun_worker())
    try:
        assert proc.stdout.readline().startswith("step 0")
        for _ in first:
            for _ in range(3):
                proc.send_signal(PARENT_DEATH_SIGNAL)
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)   # a graceful stop would wait for the 60 s step
    finally:
        proc.kill()
    assert proc.returncode == ExitCode.SIGTERM, err[-2000:]
    assert "second SIGTERM during shutdown" in err


NESTED = """
import os, signal, sys, time
from kempner_resilience import ShutdownHandler, load_config

handler = ShutdownHandler(load_config(None, []).signals).install()
# The main thread is inside one signal's handler, recording it, when the next one arrives (three
# SIGTERMs sent back to back): Python runs that one's handler right there, in the same thread.
with handler._lock:
    os.kill(os.getpid(), signal.SIGTERM)
    for _ in range(1000):
        pass
    print("recorded", handler.request.signum, flush=True)
end = time.monotonic() + 10
while not handler._deliveries and time.monotonic() < end:
    time.sleep(0.01)
print("signal thread saw", handler._deliveries, flush=True)
handler.uninstall()
"""


def test_a_signal_arriving_while_another_is_being_recorded_does_not_deadlock_the_rank(tmp_path):
    proc = start(write_script(tmp_path, NESTED))
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert "recorded 15" in out and "signal thread saw [15]" in out, (out, err[-2000:])
    assert "SIGTERM received" in err
    assert proc.returncode == 0, err[-2000:]


def test_sigterm_after_usr1_does_not_abort_the_graceful_shutdown(tmp_path):
    # The SLURM time limit: USR1 first, SIGTERM later while the checkpoint may still be written.
    # Forcing exit then would throw the checkpoint away; the step finishes and the run requeues.
    proc = run_script([sys.executable, write_script(tmp_path, LOOP), "100", "1.0",
                           "2=SIGUSR1,SIGTERM"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == ExitCode.REQUEUE, proc.stderr
    assert ran_steps(proc.stdout)[-1] == 2


def test_handler_installed_before_still_runs_and_is_restored_afterwards():
    seen = []

    def mine(signum, frame):
        seen.append(signum)

    previous = signal.signal(signal.SIGUSR2, mine)
    try:
        handler = ShutdownHandler(load_config().signals)
        with handler:
            assert signal.getsignal(signal.SIGUSR2) is not mine
            os.kill(os.getpid(), signal.SIGUSR2)
            for _ in range(100):  # the Python-level handler runs at the next bytecode
                if seen and handler.deadline.armed:
                    break
                time.sleep(0.01)
            assert handler.request is not None and handler.request.name == "SIGUSR2"
        assert not handler.deadline.armed  # the deadline ends with the handler's block
        assert seen == [signal.SIGUSR2]
        assert signal.getsignal(signal.SIGUSR2) is mine
    finally:
        signal.signal(signal.SIGUSR2, previous)


def test_default_handlers_are_restored_after_the_run(tmp_path):
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT)}
    with ShutdownHandler(load_config().signals):
        assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]
    assert {s: signal.getsignal(s) for s in before} == before


FORK = """
import os, signal, sys, time
import kempner_resilience as kr

with kr.ResilientRun(kr.load_config(overrides=["watchdog.hang_timeout_s=0"])) as run:
    pid = os.fork()
    if pid == 0:
        ok = signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL
        ok = ok and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        ok = ok and signal.set_wakeup_fd(-1) == -1
        print("child handlers reset" if ok else "child inherited handlers", flush=True)
        os.kill(os.getpid(), signal.SIGTERM)  # default action: the child dies of it
        time.sleep(10)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    print("child killed by", os.WTERMSIG(status) if os.WIFSIGNALED(status) else None)
    time.sleep(0.2)
    print("parent request", run.shutdown_request)
"""


def test_forked_child_does_not_inherit_the_handlers(tmp_path):
    proc = subprocess.run([sys.executable, write_script(tmp_path, FORK)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "child handlers reset" in proc.stdout
    assert f"child killed by {int(signal.SIGTERM)}" in proc.stdout
    assert "parent request None" in proc.stdout  # the child's signal did not reach the parent


def test_install_off_the_main_thread_is_a_clear_error():
    import threading

    box = []
    t = threading.Thread(target=lambda: box.append(_try_install()))
    t.start()
    t.join()
    assert "main thread" in box[0]


def _try_install() -> str:
    try:
        ShutdownHandler(load_config().signals).install()
    except RuntimeError as e:
        return str(e)
    return "installed"


BLOCKED_ON_MUTEX = """
import ctypes, os, signal, sys, threading, time
import kempner_resilience as kr

out, name = sys.argv[1], sys.argv[2]
cfg = kr.load_config(overrides=["signals.grace_s=2", "signals.grace_per_signal_s.SIGTERM=2",
                                "watchdog.hang_timeout_s=0"])
with kr.ResilientRun(cfg) as run:
    sent = []
    run._handler.add_listener(
        lambda req: open(out, "w").write(f"{time.monotonic() - sent[0]:.6f}"))

    def send():
        sent.append(time.monotonic())
        os.kill(os.getpid(), getattr(signal, name))

    threading.Timer(0.3, send).start()
    # A C call that blocks forever with the GIL released and that no signal interrupts
    # (a self-deadlock on a pthread mutex): Python-level handlers never run here.
    libc = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)
    libc.pthread_mutex_init(mutex, None)
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)
"""


@pytest.mark.parametrize("name", ["SIGUSR1", "SIGTERM"])
def test_signal_is_observed_within_100ms_while_the_main_thread_blocks_in_c(tmp_path, name):
    out = tmp_path / "latency"
    proc = run_script([sys.executable, write_script(tmp_path, BLOCKED_ON_MUTEX), str(out),
                           name], capture_output=True, text=True, timeout=60)
    assert proc.returncode == ExitCode.DEADLINE, proc.stderr
    assert float(out.read_text()) < 0.1
    assert "shutdown deadline passed" in proc.stderr


EARLY = """
import os, signal, sys, time
os.environ["SLURM_JOB_ID"] = "999999999"  # as inside a SLURM job (one that does not exist)
import kempner_resilience as kr
os.kill(os.getpid(), signal.SIGUSR1)  # the warning lands while the model is still being built
time.sleep(0.2)
print("survived", flush=True)
cfg = kr.load_config(overrides=["watchdog.hang_timeout_s=0", "requeue.enabled=false"])
with kr.ResilientRun(cfg) as run:
    for step in run.steps(100):
        print("step", step, flush=True)
"""


def test_a_signal_during_start_up_under_slurm_is_handled_once_the_run_starts(tmp_path):
    env = dict(os.environ, SLURM_JOB_ID="999999999")
    env.pop("SLURM_PROCID", None)
    proc = subprocess.run([sys.executable, write_script(tmp_path, EARLY)], capture_output=True,
                          text=True, timeout=60, env=env)
    assert "survived" in proc.stdout
    assert "step 0" not in proc.stdout  # stopped at the very first boundary
    assert "before the run started" in proc.stderr
    # requeue.enabled is off (the job id is made up): the run stops without requeueing.
    assert proc.returncode == ExitCode.STOPPED, proc.stderr


def test_a_run_used_in_process_by_a_test_runner_does_not_kill_it_later():
    # pytest catches SystemExit and goes on; the exit deadline must not fire in its process.
    import kempner_resilience as kr

    seen = []
    previous = signal.signal(signal.SIGUSR1, lambda s, f: seen.append(s))
    try:
        with pytest.raises(SystemExit) as exc:
            cfg = kr.load_config(overrides=["watchdog.exit_timeout_s=0.5",
                                            "watchdog.hang_timeout_s=0"])
            with kr.ResilientRun(cfg) as run:
                os.kill(os.getpid(), signal.SIGUSR1)
                for _ in run.steps(10):
                    pass
        assert exc.value.code == ExitCode.REQUEUE
        assert seen == [signal.SIGUSR1]  # chained
        assert signal.getsignal(signal.SIGUSR1) is not None and not run._handler.deadline.armed
        time.sleep(1.5)  # past exit_timeout_s: still alive
    finally:
        signal.signal(signal.SIGUSR1, previous)
