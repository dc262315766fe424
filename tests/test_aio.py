"""kempner_resilience.run.aio.run: signals cancel the main task and every task's cleanup runs."""

import signal
import sys

from helpers import run_script, start, wait_for_file, write_script

FIFTY_TASKS = """
import asyncio, socket, sys
from kempner_resilience.run import aio

log_path, ready, fail = sys.argv[1], sys.argv[2], sys.argv[3] == "fail"
released = open(log_path, "w", buffering=1)
opened = 0

async def worker(i):
    global opened
    sock = socket.socket()           # a real resource held across an await
    opened += 1
    try:
        if opened == 50:
            open(ready, "w").write("50 open")
        await asyncio.sleep(3600)
    finally:
        sock.close()
        released.write(f"released {i}\\n")

async def crasher():
    while opened < 50:
        await asyncio.sleep(0.01)
    raise RuntimeError("one task failed")

async def main():
    async with asyncio.TaskGroup() as tg:
        for i in range(50):
            tg.create_task(worker(i))
        if fail:
            tg.create_task(crasher())

aio.run(main())
"""


def released(path) -> set[str]:
    return {line for line in path.read_text().splitlines() if line.startswith("released")}


def signal_when_all_open(tmp_path, sig):
    log, ready = tmp_path / "log", tmp_path / "ready"
    proc = start(write_script(tmp_path, FIFTY_TASKS), str(log), str(ready), "ok")
    try:
        wait_for_file(ready, timeout=60)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    return proc.returncode, err, released(log)


def test_sigterm_cancels_all_fifty_tasks_and_releases_their_resources(tmp_path):
    code, err, freed = signal_when_all_open(tmp_path, signal.SIGTERM)
    assert code == 143, err
    assert len(freed) == 50
    assert "Traceback" not in err


def test_sigint_cancels_all_tasks_and_exits_130_without_traceback(tmp_path):
    code, err, freed = signal_when_all_open(tmp_path, signal.SIGINT)
    assert code == 130, err
    assert len(freed) == 50
    assert "KeyboardInterrupt" not in err


def test_one_task_raising_releases_all_fifty(tmp_path):
    log, ready = tmp_path / "log", tmp_path / "ready"
    proc = run_script([sys.executable, write_script(tmp_path, FIFTY_TASKS), str(log),
                           str(ready), "fail"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert "one task failed" in proc.stderr
    assert len(released(log)) == 50


def test_result_of_the_coroutine_is_returned():
    from kempner_resilience.run import aio

    async def main():
        return 42

    assert aio.run(main()) == 42
