"""Warm ranks: forked from a parent (a zygote) that imported torch once, single-threaded and
never touching CUDA, so a launch or a relaunch does not pay Python's and torch's start-up again
(seconds of CPU per rank). The child becomes the rank as a cold start would be.

Opt-in (``KEMPNER_RESILIENCE_WARM=1``, ``launch --warm``): a child cannot have another
interpreter or other flags, and a library that read an environment variable at import read
the zygote's (so does the rank's ``/proc/<pid>/environ``). Any command other than ``<this
python> script.py`` or ``-m module`` starts cold.

A zygote listens on an abstract unix socket (``_listen``): one connection per rank, its request
with its standard streams, answered with ``{"pid"}`` (or ``{"refused"}``), then ``{"exit",
"code"}``. It never runs a rank's code and checks that before every fork (``pristine``); one that
fails refuses and exits, and ranks start cold from then on: a rank in an untrusted state is never
the parent of the next incarnation.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import gc
import json
import os
import secrets
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

__all__ = ["Zygote", "Forker", "WarmProcess", "start", "warm_command", "listen_command", "warm_on",
           "pristine", "parent_death", "warm_imports", "installed", "WARM_ENV", "IMPORTS_ENV", "PRELOAD",
           "STEP_SIGNALS", "UNBUFFERED"]

WARM_ENV = "KEMPNER_RESILIENCE_WARM"
#: What the zygote imports before it forks: what every rank of ours imports anyway.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.optim",
           "torch._dynamo")
#: The script's own heavy imports, comma-separated (``transformers.trainer,pytorch_lightning``):
#: the zygote imports them after ``PRELOAD``, so a warm rank of a Trainer or Lightning script
#: skips them too (1.6-1.8 s of CPU each on these cores).
IMPORTS_ENV = "KEMPNER_RESILIENCE_WARM_IMPORTS"
#: What SLURM may send to every process of a step: a zygote ignores them (its ranks decide).
STEP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
#: The one interpreter flag a warm rank can have: unbuffered streams (torchrun adds it).
UNBUFFERED = "-u"
_PR_SET_PDEATHSIG = 1
_READY_S = 120.0        # the zygote's imports, on a loaded machine
# The package's own top-level name: a zygote that imported it may have run a step.
_PACKAGE = "kempner_resilience"


def warm_on() -> bool:
    """Whether ``$KEMPNER_RESILIENCE_WARM`` asks for warm starts."""
    return os.environ.get(WARM_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def warm_imports(env: Mapping[str, str]) -> tuple[str, ...]:
    """The modules ``$KEMPNER_RESILIENCE_WARM_IMPORTS`` of ``env`` names, in its order."""
    return tuple(n.strip() for n in env.get(IMPORTS_ENV, "").split(",") if n.strip())


def warm_command(command: Sequence[str], flags: Sequence[str] = ()) -> bool:
    """Whether ``command`` can start warm: ``<this python> script.py`` or ``-m module``, with
    at most ``UNBUFFERED`` among ``flags`` (any other flag would have to be the zygote's)."""
    if not warm_on():
        return False
    command = [command[0], *_strip_flags(list(command[1:]), flags)] if command else []
    if len(command) < 2:
        return False
    exe = command[0]
    try:
        # Not on the PATH: samefile("") raises FileNotFoundError.
        if not os.path.samefile(exe if os.sep in exe else shutil.which(exe) or "", sys.executable):
            return False
    except (OSError, TypeError):
        return False
    if command[1] == "-m":
        return len(command) >= 3
    return not command[1].startswith("-") and command[1].endswith(".py")


def listen_command(name: str, *, preload: Sequence[str] = PRELOAD,
                   ignore: Sequence[int] = ()) -> list[str]:
    """The command of a standby zygote behind the abstract socket ``name`` (``_listen``), run as
    a file: ``ignore``, the signals it does not die of (its ranks decide)."""
    return [sys.executable, os.path.abspath(__file__), "--listen", name,
            json.dumps({"preload": list(preload), "ignore": [int(s) for s in ignore]})]


def _strip_flags(args: list[str], flags: Sequence[str]) -> list[str]:
    if set(flags) - {UNBUFFERED}:
        raise ValueError(f"a warm rank can have only the {UNBUFFERED} flag, not {list(flags)}")
    while args and args[0] in flags:
        args = args[1:]
    return args


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _cuda_driver_loaded() -> bool:
    """Whether the CUDA driver library is mapped in this process: the CUDA runtime loads it
    at its first call, which ``import torch`` never makes."""
    try:
        with open("/proc/self/maps", "rb") as maps:
            return any(b"/libcuda.so" in line for line in maps)
    except OSError:
        return False


def pristine(threads: int = 1) -> str | None:
    """None when this process may be a zygote (it never ran a rank's code); else why not.
    ``threads``: its count after torch's imports (``import torch`` starts a native one)."""
    if any(m == _PACKAGE or m.startswith(_PACKAGE + ".") for m in sys.modules):
        return f"it imported {_PACKAGE}, where a training step runs"
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return "it holds a process group"
    # A forked CUDA context is unusable in the child; an import may have made one. So is a
    # driver that ``torch.cuda.is_available()`` initialised without torch's lazy init: the
    # child's first CUDA call would fail with an initialisation error.
    cuda = sys.modules.get("torch.cuda")
    if cuda is not None and cuda.is_initialized():
        return "it initialised CUDA"
    if _cuda_driver_loaded():
        return ("it loaded the CUDA driver (an import called torch.cuda.is_available(); with "
                "PYTORCH_NVML_BASED_CUDA_CHECK=1 it asks NVML, which a fork survives)")
    import __main__

    if os.path.abspath(getattr(__main__, "__file__", None) or "") != os.path.abspath(__file__):
        return "a script of its own ran as __main__"
    if threading.active_count() != 1 or _threads() > threads:
        return f"it runs {_threads()} threads, {threads} after torch's imports"
    return None


def parent_death(signum: int) -> Callable[[], Any] | None:
    """A ``preexec_fn`` that gives the child ``signum`` when its parent dies (None: no
    ``prctl``). Resolved now: a threaded parent's child must not load anything before exec."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(_PR_SET_PDEATHSIG, signum)


class WarmProcess:
    """A forked rank as the launcher handles a ``Popen``: ``pid``, ``poll``, ``wait``,
    ``send_signal``, ``returncode`` (negative for a death by a signal). Its exit comes over
    its own connection to the zygote, so a reused pid is never mistaken for it."""

    def __init__(self, pid: int, conn: socket.socket, answers: Any) -> None:
        self.pid = pid
        self._code: int | None = None
        self._ended = threading.Event()
        self._conn = conn
        threading.Thread(target=self._read, args=(answers,), name="kempner-warm-rank",
                         daemon=True).start()

    def _read(self, answers: Any) -> None:
        try:
            last = json.loads(answers.readline() or b"{}")
        except (OSError, ValueError):
            last = {}
        # No answer: the zygote died, and its ranks with it (their parent-death signal).
        self._code = int(last.get("code", -int(signal.SIGKILL)))
        # The zygote closes its end right after the exit line: once ``wait`` returns, it holds
        # nothing of this rank (its descriptors are counted by whoever checks it for leaks).
        with contextlib.suppress(OSError, ValueError):
            self._conn.settimeout(5.0)
            answers.readline()
        self._conn.close()
        self._ended.set()

    @property
    def returncode(self) -> int | None:
        return self._code

    def poll(self) -> int | None:
        return self._code

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(f"rank pid {self.pid}", timeout or 0.0)
        assert self._code is not None
        return self._code

    def send_signal(self, signum: int) -> None:
        # Only while the zygote has not reaped it: a reaped pid may already be another's. One
        # reaped a moment ago is gone, as for ``Popen``.
        if self._code is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Forker:
    """A zygote behind the abstract unix socket ``name`` (``_listen``): each rank is one
    connection, with the launcher's files as its streams."""

    def __init__(self, name: str) -> None:
        self.name = name

    def spawn(self, argv: Sequence[str], env: dict[str, str], cwd: str | None,
              stdout: str | int | None, stderr: str | int | None,
              death_signal: int = signal.SIGTERM, append: bool = False) -> WarmProcess:
        """A rank forked by the zygote, or OSError. ``stdout``, ``stderr``: a file's path, an
        open descriptor, or None (this process's). ``death_signal``: the rank's when the
        zygote dies or this process goes (its connection drops). ``append``: to its logs."""
        mode = os.O_WRONLY | os.O_CREAT | (os.O_APPEND if append else os.O_TRUNC)
        opened: dict[str | int, int] = {}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            for where in {stdout, stderr} - {None}:
                opened[where] = where if isinstance(where, int) else os.open(where, mode, 0o644)
            fds = [0, opened.get(stdout, 1), opened.get(stderr, 2)]
            conn.settimeout(_READY_S)       # the zygote's imports come before its answer
            conn.connect("\0" + self.name)
            request = json.dumps({"argv": list(argv), "env": env, "cwd": cwd,
                                  "death_signal": int(death_signal),
                                  "orphan_signal": int(death_signal)}).encode() + b"\n"
            conn.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS,
                                      array.array("i", fds))])
            answers = conn.makefile("rb")
            first = json.loads(answers.readline() or b"{}")
        except (OSError, ValueError) as e:
            conn.close()
            raise OSError(f"the warm-start process {self.name} did not answer ({e})") from None
        finally:
            for where, fd in opened.items():
                if not isinstance(where, int):
                    os.close(fd)        # the rank holds its own copies
        if "pid" not in first:
            conn.close()
            raise OSError(f"the warm-start process {self.name} refused to fork: "
                          f"{first.get('refused', 'no answer')}")
        conn.settimeout(None)       # the rank runs as long as it runs
        return WarmProcess(int(first["pid"]), conn, answers)

    def close(self) -> None:
        """Nothing: a zygote that is not the caller's own outlives it."""

    def __str__(self) -> str:
        return f"the warm-start process {self.name}"


class Zygote(Forker):
    """The caller's own zygote: started here, ended by ``close``."""

    def __init__(self, env: dict[str, str], *, preload: Sequence[str] = PRELOAD,
                 ignore: Sequence[int] = (), death_signal: int = signal.SIGTERM) -> None:
        """``ignore``: signals SLURM may send to every process of a step. ``death_signal``
        comes when the thread that starts it ends: start it on the launcher's main thread."""
        super().__init__(f"kempner-resilience-zygote-{os.getpid()}-{secrets.token_hex(4)}")
        self.proc = start(self.name, env, preload=preload, ignore=ignore,
                          death_signal=death_signal, quiet=False)

    def close(self) -> None:
        """End the zygote (its ranks are the launcher's to end first); bounded."""
        self.proc.kill()
        self.proc.wait()

    def __str__(self) -> str:
        return f"pid {self.proc.pid}"


def start(name: str, env: Mapping[str, str], *, preload: Sequence[str] = PRELOAD,
          ignore: Sequence[int] = (), death_signal: int | None = None, quiet: bool = True
          ) -> subprocess.Popen[bytes]:
    """A zygote behind ``name`` in a session of its own (a terminal's Ctrl+C is the
    launcher's to pass on); returns once its socket answers (within ``_READY_S``).
    ``death_signal``: its signal when the calling thread ends; ``quiet``: no output."""
    # Run as a file, not ``-m``: importing this package would leave its import-time state in
    # every rank.
    _check_imports(env)
    out = subprocess.DEVNULL if quiet else None
    proc = subprocess.Popen(listen_command(name, preload=preload, ignore=ignore), env=dict(env),
                            stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                            start_new_session=True,
                            preexec_fn=None if death_signal is None else parent_death(death_signal))
    deadline = time.monotonic() + _READY_S      # its socket is bound before its imports
    while proc.poll() is None and time.monotonic() < deadline:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            if probe.connect_ex("\0" + name) == 0:
                break
        time.sleep(0.02)
    return proc


def installed(name: str) -> bool:
    """Whether the package of module ``name`` (``transformers`` of ``transformers.trainer``)
    is installed here, found without importing it."""
    import importlib.util

    try:
        return importlib.util.find_spec(name.partition(".")[0]) is not None
    except (ImportError, ValueError):
        return False


def _check_imports(env: Mapping[str, str]) -> None:
    """Name in the log what ``$KEMPNER_RESILIENCE_WARM_IMPORTS`` lists that is not installed:
    the zygote skips it, and each rank pays its import (or fails on it) as a cold one does."""
    from kempner_resilience.core.log import get_logger

    for name in warm_imports(env):
        if not installed(name):
            get_logger(__name__).warning(
                "%s names %s, which is not installed here: the ranks import it themselves; "
                "fix the name or install it", IMPORTS_ENV, name.partition(".")[0])


# ------------------------------------------------------------------ the zygote process

# What the zygote's imports put in its environment: a cold rank's imports would put it in the
# rank's, so each forked rank gets what its own environment does not set (Lightning sets
# PYTORCH_NVML_BASED_CUDA_CHECK, torch's compiler TORCHINDUCTOR_CACHE_DIR).
_set_by_imports: dict[str, str] = {}


def _prepare(options: dict[str, Any]) -> int:
    """The zygote's set-up: signals ignored, the imports done and frozen; its thread count."""
    for signum in (signal.SIGINT, *options.get("ignore", ())):
        signal.signal(signum, signal.SIG_IGN)
    before = dict(os.environ)
    for name in options.get("preload", PRELOAD):
        __import__(name)
    # Counted before the user's imports: one that starts a thread (which a fork would not
    # copy) makes this process refuse to fork, and the ranks start cold.
    threads = _threads()
    for name in warm_imports(os.environ):
        # A module that does not import here is the rank's to import, and to fail on with its
        # own traceback (the launcher named it in the log already).
        with contextlib.suppress(Exception):
            __import__(name)
    _set_by_imports.update((k, v) for k, v in os.environ.items() if before.get(k) != v)
    # Frozen, the imports' objects are never scanned by a child's collector, which would
    # copy every page they live on (a rank's exit collection took 2.4 s here).
    gc.collect()
    gc.freeze()
    return threads


def _reaped() -> list[tuple[int, int]] | None:
    """The ranks that ended since the last look: (pid, code, negative for a signal); None
    when this process has no child left at all."""
    ended = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended or None
        if pid == 0:
            return ended
        ended.append((pid, os.waitstatus_to_exitcode(status)))


def _listen(name: str, options: dict[str, Any]) -> dict[str, Any] | None:
    """The zygote behind the abstract unix socket ``name``: the forked rank's request, None
    when it refused. A connection that drops takes its rank with it: with SIGKILL (an srun
    task's shim, ``srun/shim.py``) or the signal it named (``orphan_signal``, a launcher's)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # Bound before the imports: the first step's shims wait in the backlog, not start cold.
    server.bind("\0" + name)
    server.listen(256)
    threads = _prepare(options)
    uid = os.getuid()
    ranks: dict[socket.socket, int | None] = {}     # a connection -> its rank's pid
    orphaned: dict[socket.socket, int] = {}         # a connection -> its rank's signal
    while True:
        ready, _, _ = select.select([server, *ranks], [], [], 0.05)
        for conn in ready:
            if conn is server:
                new, _ = server.accept()
                creds = new.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                       socket.CMSG_LEN(12))
                if int.from_bytes(creds[4:8], sys.byteorder) == uid:   # only this user's
                    ranks[new] = None
                else:
                    new.close()
                continue
            if ranks[conn] is not None:
                if not conn.recv(4096):         # the shim is gone: so is its rank
                    with contextlib.suppress(OSError):
                        # The rank's own session (_become).
                        os.killpg(ranks.pop(conn), orphaned.pop(conn, signal.SIGKILL))
                    conn.close()
                continue
            msg, fds = _request(conn)
            if msg is None:
                ranks.pop(conn)
                conn.close()
                continue
            why = pristine(threads)
            if why is not None:
                conn.sendall(json.dumps({"refused": why}).encode() + b"\n")
                return None
            pid = os.fork()
            if pid == 0:
                server.close()
                for other in ranks:
                    other.close()
                for fd, target in zip(fds, (0, 1, 2)):
                    if fd != target:
                        os.dup2(fd, target)
                        os.close(fd)
                return msg
            for fd in fds:
                os.close(fd)
            ranks[conn] = pid
            orphaned[conn] = int(msg.get("orphan_signal", signal.SIGKILL))
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        for pid, code in _reaped() or ():
            for conn in [c for c, rank in ranks.items() if rank == pid]:
                with contextlib.suppress(OSError):
                    conn.sendall(json.dumps({"exit": pid, "code": code}).encode() + b"\n")
                del ranks[conn]
                orphaned.pop(conn, None)
                conn.close()


def _request(conn: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    """A shim's request line and the descriptors that came with it (stdin, stdout, stderr)."""
    buf, fds = b"", []
    while not buf.endswith(b"\n"):
        try:
            data, anc, _, _ = conn.recvmsg(1 << 20, socket.CMSG_SPACE(3 * 4))
        except OSError:
            data, anc = b"", []
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += list(memoryview(payload).cast("i"))
        if not data:
            break
        buf += data
    if not buf.endswith(b"\n") or len(fds) != 3:
        for fd in fds:
            os.close(fd)
        return None, []
    return json.loads(buf), fds


def _become(msg: dict[str, Any]) -> None:
    """In the forked child: become the rank ``msg`` describes, as a cold start would be."""
    os.setsid()
    die = parent_death(int(msg.get("death_signal", signal.SIGTERM)))
    if die is not None:
        die()
    os.environ.clear()
    os.environ.update(msg["env"])
    for key, value in _set_by_imports.items():
        os.environ.setdefault(key, value)
    if msg.get("cwd"):
        os.chdir(msg["cwd"])
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
                   signal.SIGUSR2, signal.SIGCHLD):
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    import torch

    # A cold start reads OMP_NUM_THREADS at ``import torch``; no parallel region ran in the
    # zygote, so the rank's count still takes.
    with contextlib.suppress(ValueError):
        wanted = int(os.environ.get("OMP_NUM_THREADS", ""))
        if wanted > 0 and torch.get_num_threads() != wanted:
            torch.set_num_threads(wanted)
    # A cold start seeds torch's CPU generator (and NumPy's) from the OS at import: without
    # this every forked rank would start an unseeded script from the same weights.
    torch.default_generator.seed()
    with contextlib.suppress(ImportError):
        import numpy

        numpy.random.seed()


def _run(argv: list[str]) -> None:
    """``python script.py args`` or ``python -m module args``, as the interpreter runs them."""
    import runpy

    if argv[1:2] == [UNBUFFERED]:
        argv = [argv[0], *_strip_flags(argv[1:], (UNBUFFERED,))]
        _unbuffered()
    # Inserted, not set: main() took the zygote's own folder off already, so sys.path[0] is
    # PYTHONPATH's first folder now, which a cold start keeps.
    if argv[1] == "-m":
        sys.argv = [argv[2], *argv[3:]]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(argv[2], run_name="__main__", alter_sys=True)
    else:
        script = str(Path(argv[1]))
        sys.argv = [script, *argv[2:]]
        sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
        runpy.run_path(script, run_name="__main__")


def _unbuffered() -> None:
    """``python -u``: stdout and stderr written through (the zygote made its streams)."""
    import io

    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        setattr(sys, name, io.TextIOWrapper(
            io.FileIO(fd, "w", closefd=False), encoding=old.encoding, errors=old.errors,
            write_through=True))


def main() -> None:
    del sys.path[0]     # this file's folder: the package's inside, not a place to import from
    msg = _listen(sys.argv[2], json.loads(sys.argv[3]) if len(sys.argv) > 3 else {})
    if msg is None:
        return
    _become(msg)
    _run(msg["argv"])    # an exception or SystemExit ends this interpreter as it would a rank's


if __name__ == "__main__":
    main()
