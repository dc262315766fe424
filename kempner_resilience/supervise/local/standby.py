"""A machine's standby for local launches: one zygote (``warm.py --listen NAME``) that outlives
the launches, named by ``$KEMPNER_RESILIENCE_STANDBY``. A launch that finds one forks its ranks
at once; its own ``warm.Zygote`` would import torch first (2-3 s of CPU each launch).

A rank of the standby is one unix connection with the launcher's files as its streams. When
the connection drops with the launcher, the standby SIGTERMs the rank, as the death of a
launch's own zygote would. A standby that imported torch with other values than a rank would
(``_AT_IMPORT``: PYTHONPATH, TORCH_*, ...) is not used.
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Mapping, Sequence

from kempner_resilience.supervise.local.warm import (_READY_S, WarmProcess, Zygote,
                                                     listen_command, parent_death)

__all__ = ["NodeStandby", "StandbyRank", "standby_or_zygote", "start", "STANDBY_ENV"]

#: The standby's abstract socket name.
STANDBY_ENV = "KEMPNER_RESILIENCE_STANDBY"
# What Python or torch may read at start-up or import (a rank of a standby shares its values);
# a standby whose values differ is not used.
_AT_IMPORT = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "CUDA", "NVIDIA", "LD_",
              "GLIBC", "MALLOC")
# Of those, what is read only when used: the thread count (set again in each rank), and two
# that Lightning sets in its importer's environment (torch reads them when it checks for CUDA or
# compiles a kernel), so a process that imported Lightning once does not lose its standby.
_AFTER_IMPORT = ("OMP_NUM_THREADS", "PYTORCH_NVML_BASED_CUDA_CHECK", "TORCHINDUCTOR_CACHE_DIR")


class NodeStandby:
    """A standby that outlives the launches (``warm.py --listen NAME``, named by
    ``$KEMPNER_RESILIENCE_STANDBY``): one zygote a machine keeps for all its launches, so a
    launch pays no import at all (its own ``Zygote`` pays one per launch). The same methods as
    a ``Zygote``; ``close`` leaves the standby running. Each rank is one connection, with the
    launcher's files as its streams; when the connection drops with the launcher, the standby
    SIGTERMs the rank, as an own zygote's death would."""

    def __init__(self, name: str) -> None:
        self.name = name

    @classmethod
    def for_env(cls, env: dict[str, str]) -> "NodeStandby | None":
        """The standby ``$KEMPNER_RESILIENCE_STANDBY`` names, when it answers, runs this
        Python, belongs to the SLURM job of ``env`` (or to none, as ``env``), and imported
        torch with what a rank of ``env`` would import it with (``_AT_IMPORT``); else None
        (the launcher starts its own zygote)."""
        name = os.environ.get(STANDBY_ENV, "").strip()
        if not name:
            return None
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
                probe.connect("\0" + name)
                creds = probe.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                         socket.CMSG_LEN(12))
            pid = int.from_bytes(creds[0:4], sys.byteorder)
            if not os.path.samefile(f"/proc/{pid}/exe", sys.executable):
                return None
            with open(f"/proc/{pid}/environ", "rb") as f:
                pairs = [e.decode(errors="replace").partition("=") for e in f.read().split(b"\0")
                         if e]
        except OSError:
            return None
        theirs = {k: v for k, _, v in pairs}
        # Inside a SLURM job, only a standby of that job: the ranks of one outside it would
        # live outside the allocation (no --signal, no cgroup, no cleanup by slurmd).
        if theirs.get("SLURM_JOB_ID") != env.get("SLURM_JOB_ID"):
            return None
        return cls(name) if _at_import(theirs) == _at_import(env) else None

    def spawn(self, argv: Sequence[str], env: dict[str, str], cwd: str | None,
              stdout: str | None, stderr: str | None,
              death_signal: int = signal.SIGTERM, append: bool = False) -> "StandbyRank":
        """As ``Zygote.spawn``: a rank forked by the standby, or OSError."""
        mode = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
        opened: dict[str, int] = {}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            for where in {stdout, stderr} - {None}:
                opened[where] = os.open(where, mode, 0o644)
            fds = [0, opened.get(stdout, 1), opened.get(stderr, 2)]
            conn.settimeout(_READY_S)
            conn.connect("\0" + self.name)
            request = json.dumps({"argv": list(argv), "env": env, "cwd": cwd,
                                  "death_signal": int(death_signal),
                                  "orphan_signal": int(signal.SIGTERM)}).encode() + b"\n"
            conn.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
            answers = conn.makefile("rb")
            first = json.loads(answers.readline() or b"{}")
        except (OSError, ValueError) as e:
            conn.close()
            raise OSError(f"the standby {self.name} did not answer ({e})") from None
        finally:
            for fd in opened.values():
                os.close(fd)        # the rank holds its own copies
        if "pid" not in first:
            conn.close()
            raise OSError(f"the standby {self.name} refused to fork: "
                          f"{first.get('refused', 'no answer')}")
        conn.settimeout(None)       # the rank runs as long as it runs
        return StandbyRank(int(first["pid"]), conn, answers)

    def close(self) -> None:
        """Nothing: the standby is not the launcher's to end."""


class StandbyRank(WarmProcess):
    """A rank a ``NodeStandby`` forked: its exit comes over its own connection."""

    def __init__(self, pid: int, conn: socket.socket, answers: Any) -> None:
        self.pid = pid
        self._code: int | None = None
        self._ended = threading.Event()
        self._conn = conn
        threading.Thread(target=self._read, args=(answers,), name="kempner-standby-rank",
                         daemon=True).start()

    def _read(self, answers: Any) -> None:
        try:
            last = json.loads(answers.readline() or b"{}")
        except (OSError, ValueError):
            last = {}
        # No answer: the standby died, and its ranks with it (their parent-death signal).
        self._code = int(last.get("code", -int(signal.SIGKILL)))
        self._conn.close()
        self._ended.set()

    @property
    def returncode(self) -> int | None:
        return self._code

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
        assert self._code is not None
        return self._code


def start(name: str, env: Mapping[str, str], *, die_with_caller: bool = False
          ) -> subprocess.Popen[bytes]:
    """A standby behind ``name``, started with ``env`` as a launch's ranks see it (unbuffered
    streams), in a session of its own; returns once its socket answers (within ``_READY_S``).
    ``die_with_caller``: SIGKILLed when the calling thread ends, even by a signal."""
    proc = subprocess.Popen(listen_command(name), env={**env, "PYTHONUNBUFFERED": "1"},
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True,
                            preexec_fn=parent_death(signal.SIGKILL) if die_with_caller else None)
    deadline = time.monotonic() + _READY_S      # bound once its Python has started
    while proc.poll() is None and time.monotonic() < deadline:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            if probe.connect_ex("\0" + name) == 0:
                break
        time.sleep(0.02)
    return proc


def standby_or_zygote(env: dict[str, str]) -> "Zygote | NodeStandby":
    """The machine's standby when one fits ``env`` (``NodeStandby.for_env``), else a zygote
    of the caller's own started with ``env``."""
    return NodeStandby.for_env(env) or Zygote(env)


def _at_import(env: Mapping[str, str]) -> dict[str, str]:
    """What of ``env`` torch or Python may read before a rank's own code runs."""
    return {k: v for k, v in env.items() if k.startswith(_AT_IMPORT) and k not in _AFTER_IMPORT}
