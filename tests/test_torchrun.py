"""`kempner-resilience torchrun`: torchrun's agent as a well-behaved srun task, without SLURM.

A real torchrun (torch.distributed.run, run in the wrapper's process) starts 2 real workers on
this machine. The tests deliver signals as SLURM would: to the agent only (proctrack/cgroup and
proctrack/pgid signal only the srun task, and torch starts its workers in sessions of their
own) or to every process (proctrack/linuxproc), and check what a user cares about: every worker
hears the signal once, all stop at the same step, the checkpoint is committed, and the agent
exits with the workers' code.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import agent_env, env, free_port, wait_for_file, worker_pids, write_script
from kempner_resilience.checkpoint import MANIFEST_NAME
from kempner_resilience.cli.torchrun import separate
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.supervise.torchrun.wrapper import agent_exit_code, forward_signals
from kempner_resilience.core.ledger import read_ledger

# Each rank is a single-process run (no process group, no torch): it only has to hear the
# signal and shut down; rank 0's shutdown holds a cleanup of --cleanup-s seconds.
LIGHT_WORKER = """
import argparse, os, time
import kempner_resilience as kr

ap = argparse.ArgumentParser()
ap.add_argument("--work"); ap.add_argument("--cleanup-s", type=float); ap.add_argument("--all")
args = ap.parse_args()
rank = int(os.environ["RANK"])
progress = open(f"{args.work}/progress", "a", buffering=1)
with kr.ResilientRun(kr.load_config(None, ["watchdog.hang_timeout_s=0"])) as run:
    if rank == 0 or args.all:
        run.add_cleanup(lambda: (open(f"{args.work}/cleanup.{rank}.started", "w").close(),
                                 time.sleep(args.cleanup_s),
                                 open(f"{args.work}/cleanup.{rank}.finished", "w").close()),
                        timeout_s=args.cleanup_s + 30)
    for step in run.steps(100_000):
        time.sleep(0.01)
        progress.write(f"rank {rank} step {step}\\n")
"""


def _start(work: Path, worker: list[str], forward: str) -> subprocess.Popen:
    """The wrapper with 2 workers on this machine (torchrun --standalone)."""
    return subprocess.Popen(
        [sys.executable, "-m", "kempner_resilience.cli", "torchrun", "--standalone",
         "--nproc-per-node=2", "--no-python", sys.executable, *worker],
        stdout=open(work / "agent.out", "w"), stderr=open(work / "agent.err", "w"),
        stdin=subprocess.DEVNULL, cwd=work, start_new_session=True,
        env=env(KEMPNER_RESILIENCE_FORWARD_SIGNALS=forward, OMP_NUM_THREADS="1"))


def _workers(agent: subprocess.Popen) -> list[int]:
    return worker_pids(agent.pid)


def _wait(agent: subprocess.Popen, timeout: float = 120) -> int:
    try:
        return agent.wait(timeout)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)


def _running(work: Path, step: int = 2) -> None:
    for rank in (0, 1):
        wait_for_file(work / "progress", timeout=120, contains=f"rank {rank} step {step}\n")


def _last_steps(progress: Path) -> dict[int, int]:
    last: dict[int, int] = {}
    for rank, step in re.findall(r"^rank (\d+) step (\d+)$", progress.read_text(), re.M):
        last[int(rank)] = max(last.get(int(rank), -1), int(step))
    return last


@pytest.mark.parametrize("delivery,forward", [
    ("agent", "yes"),        # proctrack/cgroup or pgid: SLURM signals only the srun task
    ("everyone", "no"),      # proctrack/linuxproc: SLURM signals the whole process tree
])
def test_usr1_reaches_each_worker_once_all_stop_at_one_step_commit_and_the_agent_exits_75(
        tmp_path, delivery, forward):
    ckpt = tmp_path / "ckpt"
    agent = _start(tmp_path, ["-m", "kempner_resilience.demo.train", "--steps", "100000",
                              "--step-time", "0.05", "--no-ddp", "--quiet",
                              "--progress", str(tmp_path / "progress"),
                              "--set", f"checkpoint.dir={ckpt}"], forward)
    _running(tmp_path)
    targets = [agent.pid] + (_workers(agent) if delivery == "everyone" else [])
    assert len(targets) == (3 if delivery == "everyone" else 1)
    for pid in targets:
        os.kill(pid, signal.SIGUSR1)
    code = _wait(agent)
    log = (tmp_path / "agent.err").read_text()
    assert code == ExitCode.REQUEUE, log[-3000:]
    for rank in (0, 1):
        assert len(re.findall(rf"\[rank {rank}\] SIGUSR1 received", log)) == 1, log[-3000:]
    assert "during shutdown" not in log         # no second delivery tightened a deadline
    last = _last_steps(tmp_path / "progress")
    assert last[0] == last[1]
    committed = [p for p in ckpt.glob("step_*") if (p / MANIFEST_NAME).exists()]
    assert [int(p.name.split("_")[1]) for p in committed] == [last[0] + 1]
    assert {int(p.name.split("_")[2]) for p in committed[0].glob("__*_*.distcp")} == {0, 1}


def _agent_last_line(log: str) -> str:
    lines = [ln for ln in log.splitlines() if "workers exited with" in ln]
    assert len(lines) == 1, log[-3000:]
    return lines[0]


def test_after_a_requeue_the_agent_names_the_committed_checkpoint_and_calls_torchs_failure_the_requeue(
        tmp_path):
    ckpt = tmp_path / "ckpt"
    agent = _start(tmp_path, ["-m", "kempner_resilience.demo.train", "--steps", "100000",
                              "--step-time", "0.05", "--no-ddp", "--quiet",
                              "--progress", str(tmp_path / "progress"),
                              "--set", f"checkpoint.dir={ckpt}"], "yes")
    agent_start = _process_start(agent.pid)
    _running(tmp_path)
    os.kill(agent.pid, signal.SIGUSR1)
    code = _wait(agent)
    log = (tmp_path / "agent.err").read_text()
    assert code == ExitCode.REQUEUE, log[-3000:]
    assert "failed (exitcode: 75)" in log         # torch's own report of the exit...
    line = _agent_last_line(log)                  # ...and ours after it, which says what it is
    assert "is this requeue, not an error" in line, line
    step = _last_steps(tmp_path / "progress")[0] + 1
    assert f"newest checkpoint this run committed: step {step} ({ckpt}" in line, line
    # The agent's start-up (torch's import, the rendezvous) is this attempt's, not the queue's:
    # the ledger's attempt starts when the agent did, not when the workers did.
    start = [e for e in read_ledger(ckpt / "ledger.jsonl") if e["ev"] == "start"]
    assert len(start) == 1 and abs(start[0]["t0"] - agent_start) < 0.1, (start, agent_start)


def _process_start(pid: int) -> float:
    """``pid``'s start time (epoch seconds), as the ledger computes its own."""
    ticks = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK")
    return time.time() - age


def test_a_worker_that_finishes_its_shutdown_first_does_not_get_the_other_killed(tmp_path):
    # SIGTERM (preemption) to the agent: rank 1 is done at once, rank 0 still runs a 3 s
    # cleanup. Stock torchrun would SIGTERM rank 0 when rank 1 exits: a second SIGTERM, which
    # forces it out on the spot.
    script = write_script(tmp_path, LIGHT_WORKER, "worker.py")
    agent = _start(tmp_path, [str(script), "--work", str(tmp_path), "--cleanup-s", "3"], "yes")
    _running(tmp_path)
    os.kill(agent.pid, signal.SIGTERM)
    code = _wait(agent)
    log = (tmp_path / "agent.err").read_text()
    assert code == 128 + signal.SIGTERM, log[-3000:]
    assert (tmp_path / "cleanup.0.finished").exists(), log[-3000:]
    assert "second SIGTERM during shutdown" not in log


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_second_sigint_or_sigterm_at_the_agent_forces_every_worker_out(tmp_path, signum):
    # SIGTERM too: the workers' parent-death signal (which may repeat) must not have changed
    # what a user's second SIGTERM means.
    script = write_script(tmp_path, LIGHT_WORKER, "worker.py")
    agent = _start(tmp_path, [str(script), "--work", str(tmp_path), "--cleanup-s", "60",
                              "--all", "1"], "yes")
    _running(tmp_path)
    os.kill(agent.pid, signum)                  # Ctrl+C: a graceful stop, minute-long cleanups
    for rank in (0, 1):
        wait_for_file(tmp_path / f"cleanup.{rank}.started", timeout=60)
    os.kill(agent.pid, signum)                  # again: the user insists
    code = _wait(agent, timeout=60)
    log = (tmp_path / "agent.err").read_text()
    name = signal.Signals(signum).name
    assert code == 128 + signum, log[-3000:]
    assert len(re.findall(rf"second {name} during shutdown", log)) == 2, log[-3000:]
    assert not list(tmp_path.glob("cleanup.*.finished"))
    # Forced out, nothing was saved: the agent must not say a checkpoint was committed.
    assert "checkpoint committed" not in log, log[-3000:]
    last = _agent_last_line(log)      # rank 0's report says none, or there is no report
    assert "committed no checkpoint" in last or "no checkpoint is claimed" in last, last


def test_a_sigterm_before_the_workers_start_ends_the_agent_with_143_without_starting_them(
        tmp_path):
    # --nnodes=2 with one agent: it waits in the rendezvous for a second node that never comes.
    agent = subprocess.Popen(
        [sys.executable, "-m", "kempner_resilience.cli", "torchrun", "--nnodes=2",
         "--nproc-per-node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
         "--no-python", "touch", str(tmp_path / "worker.started")],
        stderr=open(tmp_path / "agent.err", "w"), stdin=subprocess.DEVNULL, cwd=tmp_path,
        start_new_session=True, env=env())
    wait_for_file(tmp_path / "agent.err", timeout=120, contains="signals are forwarded")
    os.kill(agent.pid, signal.SIGTERM)
    assert _wait(agent, timeout=60) == 128 + signal.SIGTERM
    assert not (tmp_path / "worker.started").exists()


def test_a_worker_still_running_at_the_agents_deadline_is_killed_with_its_children(tmp_path):
    from kempner_resilience.config import ResilienceConfig
    from kempner_resilience.supervise.torchrun.agent import Agent as _Agent

    # A worker that ignores the signal, with a child of its own (a DataLoader worker, say).
    stuck = subprocess.Popen([sys.executable, "-c", (
        "import signal, subprocess, sys, time; signal.signal(signal.SIGUSR1, signal.SIG_IGN); "
        "c = subprocess.Popen(['sleep', '120']); print(c.pid, flush=True); time.sleep(120)")],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(stuck.stdout.readline())
    agent = _Agent(ResilienceConfig(), forward=True)
    agent.add_worker(stuck)
    agent.on_signal(signal.SIGUSR1, None)
    assert stuck.poll() is None                   # the signal is the worker's to handle
    agent._arm(time.monotonic())                  # its deadline has come
    assert stuck.wait(30) == -signal.SIGKILL
    end = time.monotonic() + 30
    while _alive(child) and time.monotonic() < end:
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def test_the_agent_exits_with_the_policys_job_code_over_its_workers_codes():
    # supervise/policy.py's one rule: a requeue (75) beats a peer's stop (143) or death; a
    # rank's own code beats its peers' PEER_LOST; a killed worker beside survivors that
    # rescued is a rescued failure; a death alone is 128 + N, as a shell reports it.
    assert agent_exit_code({0: 0, 1: 0}) == 0
    assert agent_exit_code({3: 75, 1: 143, 2: 0}) == ExitCode.REQUEUE
    assert agent_exit_code({0: -signal.SIGKILL, 1: 75}) == ExitCode.REQUEUE
    assert agent_exit_code({0: 81, 1: -signal.SIGKILL}) == ExitCode.PEER_LOST
    assert agent_exit_code({0: 81, 1: 1}) == ExitCode.ERROR
    assert agent_exit_code({1: -signal.SIGKILL}) == 128 + signal.SIGKILL


def _fake_scontrol(tmp_path: Path, config: str) -> dict[str, str]:
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    exe = bindir / "scontrol"
    exe.write_text(f"#!/bin/bash\n[ \"$1 $2\" = 'show config' ] && cat <<'EOF'\n{config}\nEOF\n")
    exe.chmod(0o755)
    return {"PATH": f"{bindir}:/usr/bin:/bin", "SLURM_JOB_ID": "5", "SLURM_STEP_ID": "0"}


@pytest.mark.parametrize("config,forward", [
    ("ProctrackType           = proctrack/cgroup", True),
    ("ProctrackType           = proctrack/pgid", True),
    ("ProctrackType           = proctrack/linuxproc", False),
    ("ProctrackType           = proctrack/cgroup\nSignalChildrenProcesses = yes", False),
    ("no such key", True),
])
def test_the_agent_forwards_unless_slurm_signals_every_process_of_the_step(tmp_path, config,
                                                                           forward):
    assert forward_signals(_fake_scontrol(tmp_path, config))[0] is forward


def test_forwarding_outside_slurm_and_by_override():
    assert forward_signals({})[0] is True
    assert forward_signals({"KEMPNER_RESILIENCE_FORWARD_SIGNALS": "no"})[0] is False
    assert forward_signals({"KEMPNER_RESILIENCE_FORWARD_SIGNALS": "yes", "SLURM_JOB_ID": "5",
                            "SLURM_STEP_ID": "0", "PATH": ""})[0] is True
    with pytest.raises(ValueError, match="yes, no or auto"):
        forward_signals({"KEMPNER_RESILIENCE_FORWARD_SIGNALS": "maybe"})


def test_torchruns_arguments_start_at_the_first_option_that_is_not_ours():
    assert separate(["torchrun", "--config", "c.yaml", "--set=a=1", "--nnodes=2", "t.py",
                     "--config", "x"]) == \
        ["torchrun", "--config", "c.yaml", "--set=a=1", "--", "--nnodes=2", "t.py", "--config",
         "x"]
    assert separate(["-v", "torchrun", "t.py"]) == ["-v", "torchrun", "--", "t.py"]
    assert separate(["torchrun", "--", "--nnodes=2"]) == ["torchrun", "--", "--nnodes=2"]
    assert separate(["sbatch", "--nodes", "2"]) == ["sbatch", "--nodes", "2"]


def test_torchrun_without_a_script_or_with_a_bad_forwarding_choice_is_one_line_exit_2():
    cli = [sys.executable, "-m", "kempner_resilience.cli", "torchrun"]
    proc = subprocess.run(cli, capture_output=True, text=True, timeout=60, env=env())
    assert proc.returncode == 2 and "training script" in proc.stderr
    proc = subprocess.run([*cli, "t.py"], capture_output=True, text=True, timeout=60,
                          env=env(KEMPNER_RESILIENCE_FORWARD_SIGNALS="maybe"))
    assert proc.returncode == 2 and "yes, no or auto" in proc.stderr
    assert "Traceback" not in proc.stderr


# A stand-in for what outlives the agent (slurmstepd, an init): a child subreaper, so the
# workers orphaned by the agent's death become its children and it learns their exit codes.
# It starts the wrapper, then reaps every process until none is left and writes
# {pid: code} (a death by signal N as -N) as JSON.
SUBREAPER = """
import ctypes, json, os, subprocess, sys
ctypes.CDLL(None, use_errno=True).prctl(36, 1)   # PR_SET_CHILD_SUBREAPER
out, cmd = sys.argv[1], sys.argv[2:]
agent = subprocess.Popen(cmd, stdout=open("agent.out", "w"), stderr=open("agent.err", "w"),
                         stdin=subprocess.DEVNULL)
open("agent.pid", "w").write(str(agent.pid))
codes = {}
while True:
    try:
        pid, status = os.wait()
    except ChildProcessError:
        break
    codes[pid] = os.waitstatus_to_exitcode(status)
json.dump(codes, open(out, "w"))
"""


def _train(work: Path, ckpt: Path, steps: int) -> list[str]:
    """The wrapper's command line: 2 DDP (gloo) workers of the demo job."""
    return [sys.executable, "-m", "kempner_resilience.cli", "torchrun", "--standalone",
            "--nproc-per-node=2", "--no-python", sys.executable, "-m",
            "kempner_resilience.demo.train", "--steps", str(steps), "--step-time", "0.05",
            "--quiet", "--progress", str(work / "progress"), "--set", f"checkpoint.dir={ckpt}"]


def test_an_agent_killed_outright_leaves_an_emergency_checkpoint_143_on_every_worker_and_a_resume(
        tmp_path):
    # The agent is multi-threaded: the kernel sends a worker's parent-death signal as each of
    # its threads exits, several times within milliseconds. That must count as one stop, not
    # as "a second SIGTERM" that forces the worker out without its checkpoint.
    from kempner_resilience.core.ledger import read_ledger
    from kempner_resilience.core.runpaths import RunPaths

    ckpt = tmp_path / "ckpt"
    reaper_py = write_script(tmp_path, SUBREAPER, "subreaper.py")
    reaper = subprocess.Popen(
        [sys.executable, str(reaper_py), str(tmp_path / "codes.json"),
         *_train(tmp_path, ckpt, 100_000)],
        cwd=tmp_path, stdin=subprocess.DEVNULL, start_new_session=True,
        env=agent_env(KEMPNER_RESILIENCE_FORWARD_SIGNALS="yes", OMP_NUM_THREADS="1"))
    try:
        _running(tmp_path)
        agent = int((tmp_path / "agent.pid").read_text())
        workers = worker_pids(agent)
        assert len(workers) == 2
        os.kill(agent, signal.SIGKILL)
        reaper.wait(120)
    finally:
        if reaper.poll() is None:
            os.killpg(reaper.pid, signal.SIGKILL)
    log = (tmp_path / "agent.err").read_text()
    codes = {int(pid): code for pid, code in
             json.loads((tmp_path / "codes.json").read_text()).items()}
    assert [codes[pid] for pid in workers] == [ExitCode.SIGTERM] * 2, log[-3000:]
    assert "second SIGTERM during shutdown" not in log
    last = _last_steps(tmp_path / "progress")
    assert last[0] == last[1]
    committed = [p for p in ckpt.glob("step_*") if (p / MANIFEST_NAME).exists()]
    assert [int(p.name.split("_")[1]) for p in committed] == [last[0] + 1]
    exits = [e for e in read_ledger(RunPaths(ckpt).ledger) if e["ev"] == "exit"]
    assert [e["code"] for e in exits] == [ExitCode.SIGTERM]

    # The next attempt resumes from it and finishes.
    resumed_at = last[0] + 1
    (tmp_path / "progress").unlink()
    again = subprocess.run(_train(tmp_path, ckpt, resumed_at + 3), cwd=tmp_path,
                           stdin=subprocess.DEVNULL, capture_output=True, text=True,
                           timeout=180, env=env(OMP_NUM_THREADS="1"))
    assert again.returncode == 0, again.stderr[-3000:]
    steps = [int(s) for s in re.findall(r"^rank 0 step (\d+)$",
                                        (tmp_path / "progress").read_text(), re.M)]
    assert steps == [resumed_at, resumed_at + 1, resumed_at + 2]

