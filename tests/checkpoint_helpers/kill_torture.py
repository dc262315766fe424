"""SIGKILL a checkpointing process at random moments, many times, and report what each restart saw.

    python kill_torture.py DIR TRIALS SEED   -> one JSON object on stdout

Imports torch/DCP once, then per trial forks a child (a real process; fork skips the seconds an
import costs here) that resumes from DIR, checks that what it loaded is exactly the state saved
at that step, then saves step after step (sync, or async on odd trials; keep_last=2, so
retention deletes on every save) and reports each commit. The parent SIGKILLs it after a random
delay, which lands in resume, planning, writing, fsync, commit or retention.
"""

from __future__ import annotations

import json
import os
import random
import select
import signal
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from kempner_resilience.checkpoint import CheckpointManager, layout  # noqa: E402
from kempner_resilience.config import CheckpointConfig  # noqa: E402
from kempner_resilience.core.runpaths import RunPaths


# The kill window (0.02-0.4 s) was chosen where a child reached its first commit within
# about 0.1 s of its fork (0.16-0.17 s measured on a slow day of the 2-core CI machine, idle).
IDLE_FIRST_COMMIT_S = 0.1


class Counter:
    def __init__(self) -> None:
        self.value = 0

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, sd: dict) -> None:
        self.value = sd["value"]


def make_state() -> dict:
    model = torch.nn.Linear(64, 64)
    optim = torch.optim.Adam(model.parameters())
    model(torch.ones(1, 64)).sum().backward()
    optim.step()
    return {"model": model, "optim": optim, "counter": Counter()}


def set_state(state: dict, step: int) -> None:
    """The state that a checkpoint of ``step`` must contain."""
    with torch.no_grad():
        for p in state["model"].parameters():
            p.fill_(step)
        for st in state["optim"].state.values():
            st["exp_avg"].fill_(step)
    state["counter"].value = step


def state_is(state: dict, step: int) -> bool:
    return (all(bool((p == step).all()) for p in state["model"].parameters())
            and all(bool((st["exp_avg"] == step).all()) for st in state["optim"].state.values())
            and state["counter"].value == step)


def child(root: str, use_async: bool, w: int) -> None:
    def say(msg: str) -> None:
        os.write(w, (msg + "\n").encode())

    state = make_state()
    set_state(state, -1)
    cfg = CheckpointConfig(dir=root, keep_last=2, every_steps=1, io_threads=2,
                           **{"async_": use_async})
    mgr = CheckpointManager(cfg, state)
    info = mgr.resume()
    step = info.step if info else 0
    if info is not None and not state_is(state, step):
        say(f"BAD {step}")
        return
    say(f"resumed {step}")
    while True:
        step += 1
        set_state(state, step)
        if use_async:
            mgr.maybe_save(step)
            mgr.wait()
        else:
            mgr.save(step)
        say(f"committed {step}")


def fork_child(root: str, use_async: bool) -> tuple[int, int]:
    """A child saving into ``root``; its pid and the read end of its report pipe."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            child(root, use_async, w)
        finally:
            os._exit(0)
    os.close(w)
    return pid, r


def read_until(r: int, deadline: float, done: Callable[[bytes], bool]) -> bytes:
    """What the child reported until ``deadline``, ``done(buf)`` or its pipe's end."""
    buf = b""
    while not done(buf):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready, _, _ = select.select([r], [], [], left)
        if ready:
            chunk = os.read(r, 4096)
            if not chunk:
                break
            buf += chunk
    return buf


def first_commit_s(scratch: str) -> float:
    """How long a child takes from its fork to its first commit on this machine now."""
    t0 = time.monotonic()
    pid, r = fork_child(scratch, False)
    read_until(r, t0 + 30, lambda buf: b"committed" in buf)
    took = time.monotonic() - t0
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    os.close(r)
    return took


def main() -> None:
    root, trials, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    make_state()          # warm lazy imports (autograd, Adam) once, not in every child
    rng = random.Random(seed)
    best = 0              # newest step a child reported as committed
    # A child starved of CPU (a busy CI machine) is slower, not safer: the kill window
    # stretches by how much slower, so the kills land in saves, commits and retention as
    # often, not mostly in the child's set-up. At most 4 times: the load may go as it came, and
    # 60 trials must still end well within the test's timeout.
    stretch = min(max(1.0, first_commit_s(root + ".calibration") / IDLE_FIRST_COMMIT_S), 4.0)
    report = {"trials": [], "lost": [], "bad": [], "killed_after": [],
              "stretch": round(stretch, 2)}
    for trial in range(trials + 1):
        last = trial == trials              # a final child only resumes: the end state
        pid, r = fork_child(root, trial % 2 == 1)
        delay = rng.uniform(0.02, 0.4) * stretch
        deadline = time.monotonic() + (30 if last else delay)
        buf = read_until(r, deadline,
                         lambda buf: b"BAD" in buf or (last and b"resumed" in buf))
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        while chunk := os.read(r, 4096):
            buf += chunk
        os.close(r)
        lines = buf.decode().split()
        resumed = None
        for i in range(0, len(lines) - 1, 2):
            word, step = lines[i], int(lines[i + 1])
            if word == "resumed":
                resumed = step
                if step < best:
                    report["lost"].append({"trial": trial, "resumed": step, "had": best})
            elif word == "committed":
                best = max(best, step)
            elif word == "BAD":
                report["bad"].append({"trial": trial, "step": step})
        report["trials"].append({"trial": trial, "delay": round(delay, 3), "resumed": resumed,
                                 "best": best})
    # Every directory that looks committed must be complete and verify byte for byte.
    broken = []
    committed = 0
    for e in layout.scan(RunPaths(Path(root))):
        if e.committed:
            committed += 1
            try:
                layout.validate(e, False)
                layout.verify_files(e.path, e.manifest or {})
            except Exception as ex:  # noqa: BLE001 - reported to the test
                broken.append(f"{e.path}: {ex}")
    report.update(broken=broken, committed_dirs=committed, best=best,
                  leftovers=sorted(os.listdir(root)))
    print(json.dumps(report))


if __name__ == "__main__":
    main()
