"""Trackers continue across requeues: W&B sees one run, preempted at each requeue and finished at
the end, never "crashed".

Real training processes under ResilientRun with ``integrations.wandb: true``, W&B in offline
mode (no network, everything under tmp_path), a real SIGUSR1 sent with os.kill: outside SLURM
the requeue is the REQUEUE exit (75) a launcher reruns. What W&B recorded is read back from its
offline run files (``run-<id>.wandb``: the protobuf records ``wandb sync`` would upload, in a
LevelDB-style log): a record saying the run is preempting, and the exit record with its code.
"""

from __future__ import annotations

import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

from helpers import env, require, spawn_script, write_script
from kempner_resilience.exitcodes import ExitCode

TRAIN = """
import sys, time
from pathlib import Path
import torch
import wandb
import kempner_resilience as kr

ckpt, progress, steps, wandb_on = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
cfg = kr.load_config(overrides=[f"checkpoint.dir={ckpt}", f"integrations.wandb={wandb_on}",
                                "signals.grace_s=60", "watchdog.hang_timeout_s=0"])
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
with kr.ResilientRun(cfg, state={"model": model}) as run:
    wandb.init(project="kr-tests", id=run.run_id, resume="allow")
    for step in run.steps(steps):
        wandb.log({"out": float(model(torch.ones(8)).detach())}, step=step)
        progress.write_text(f"{step}\\n")
        time.sleep(0.02)
"""


def wandb_env(tmp_path: Path) -> dict[str, str]:
    wb = tmp_path / "wb"
    return env(WANDB_MODE="offline", WANDB_DIR=str(wb), WANDB_CONFIG_DIR=str(wb / "config"),
               WANDB_CACHE_DIR=str(wb / "cache"), WANDB_DATA_DIR=str(wb / "data"),
               WANDB_SILENT="true", WANDB_CONSOLE="off", WANDB_DISABLE_GIT="true",
               WANDB_DISABLE_CODE="true", WANDB_START_METHOD="thread")


def records(path: Path) -> list[tuple[str, object]]:
    """(kind, record) of every record in a W&B run file: a 7-byte header (``:W&B``, magic
    0xBEE1, version), then 32 KiB blocks of chunks (crc32, length, type: full/first/middle/
    last), each record a serialized ``wandb_internal_pb2.Record``."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    ident, magic, _ = struct.unpack("<4sHB", data[:7])
    assert ident == b":W&B" and magic == 0xBEE1, f"{path} is not a W&B run file"
    out, pos, buf = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:                  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(buf)
            out.append((rec.WhichOneof("record_type"), rec))
    return out


def attempt(tmp_path: Path, steps: int, *, wandb_on: bool = True,
            interrupt_at: int | None = None) -> int:
    """One attempt of the job; with ``interrupt_at``, SIGUSR1 once that step has run."""
    script = write_script(tmp_path, TRAIN, "train.py")
    progress = tmp_path / "progress"
    progress.unlink(missing_ok=True)
    proc = spawn_script([sys.executable, str(script), str(tmp_path / "ckpt"), str(progress),
                             str(steps), str(wandb_on).lower()], env=wandb_env(tmp_path),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if interrupt_at is not None:
        deadline = time.monotonic() + 120
        while not (progress.exists() and f"{interrupt_at}\n" in progress.read_text()):
            assert proc.poll() is None, f"exited {proc.returncode}: {proc.stderr.read()}"
            assert time.monotonic() < deadline, f"step {interrupt_at} not reached in 120 s"
            time.sleep(0.01)
        os.kill(proc.pid, signal.SIGUSR1)
    out, err = proc.communicate(timeout=120)
    assert "Traceback" not in err, err
    return proc.returncode


def run_files(tmp_path: Path) -> list[Path]:
    """The W&B run files of the attempts, oldest first (one offline run directory each)."""
    return sorted((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))


def test_a_requeue_marks_the_wandb_run_preempting_and_the_last_attempt_finishes_it(tmp_path):
    require("wandb")
    assert attempt(tmp_path, 40, interrupt_at=5) == ExitCode.REQUEUE
    assert attempt(tmp_path, 40) == 0
    run_id = (tmp_path / "ckpt" / "run.json").read_text().split('"run_id"')[1].split('"')[1]
    first, last = run_files(tmp_path)
    assert first.name == last.name == f"run-{run_id}.wandb", "one W&B run, resumed by id"

    kinds = [k for k, _ in records(first)]
    assert "preempting" in kinds and "exit" in kinds, "requeued: preempting, not crashed"
    assert kinds.index("preempting") < kinds.index("exit")
    [exit_] = [r for k, r in records(first) if k == "exit"]
    assert exit_.exit.exit_code == ExitCode.REQUEUE

    [exit_] = [r for k, r in records(last) if k == "exit"]
    assert exit_.exit.exit_code == 0 and "preempting" not in [k for k, _ in records(last)]


def test_without_the_integration_a_requeued_wandb_run_is_not_marked_preempting(tmp_path):
    require("wandb")
    assert attempt(tmp_path, 40, wandb_on=False, interrupt_at=5) == ExitCode.REQUEUE
    [first] = run_files(tmp_path)
    assert "preempting" not in [k for k, _ in records(first)]
