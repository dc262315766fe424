"""The hang watchdog's GIL-free backstop: a small monitor process that does not count suspensions.

A hang that holds the GIL stops every Python thread, so the last resort must live outside the
interpreter. A kernel timer (``ctimer.py``) would do, but every kernel timer that can fire while
a process sleeps in a deadlock (CLOCK_MONOTONIC, REALTIME, BOOTTIME) also runs while the process
is stopped: ``scontrol suspend``, ``PreemptMode=SUSPEND`` and a cgroup freeze stop every task
and continue it later, and the timer's signal, pending since the stop, is delivered on SIGCONT
before any Python code runs: a suspended job died as hung. CPU-time clocks never fire
for a deadlock (no CPU is used). So the countdown lives in a separate process that can see
stops:

* one monitor per rank, started once by ``HangWatchdog.start()`` (``sys.executable -I -S -c``:
  no site, no torch, no GPU handle, close_fds, every signal that a launcher or SLURM sends to the
  whole job ignored), reading the deadline from a shared page (a memfd mapped by both); the rank's
  re-arm is one 8-byte store into that page (tens of nanoseconds);
* every ``POLL_S`` it checks the deadline. Time in which the rank was stopped (``/proc/<pid>/stat``
  state T or t) or in which the monitor itself did not run (a wake-up much later than asked:
  stopped or frozen with the whole job) is not counted: the deadline moves by that much;
* when the deadline passes it sends the rank the same real-time signal the kernel timer sent,
  so faulthandler dumps every stack and libc's ``_exit`` ends it with the signal number
  (``ExitCode.HANG``), in C, while the GIL is held;
* it exits when the rank closes it, when the rank's end closes the pipe between them (the rank
  died, however) or when its parent pid changes (polled: a forked child may hold the pipe);
* the rank may leave it last words (``last_words``: one JSON line over that pipe): a line to
  append to a file and a file to replace, written just before it signals the rank. That is how
  a hang that holds the GIL, where no Python runs in the rank, still leaves the run ledger's
  ``exit`` event and the run report (``shutdown/outcome.py`` says what they hold).
"""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
from time import monotonic

from kempner_resilience.stop.ctimer import install_exit_handler
from kempner_resilience.core.log import get_logger

__all__ = ["BackstopMonitor", "POLL_S", "PAUSE_MIN_S", "MAX_WORDS"]

log = get_logger(__name__)

# How often the monitor looks; also how late after its deadline it fires, at most.
POLL_S = 0.1
# A wake-up later than asked by more than this means the monitor was not running (stopped or
# frozen with the job); shorter delays are the scheduler's and count as time.
PAUSE_MIN_S = 1.0

# The shared page: [0] the deadline (CLOCK_MONOTONIC seconds, system wide on Linux; 0 = none),
# [1] nonzero once the rank closed the monitor.
_DEADLINE, _CLOSED = 0, 1
# Last words fit one pipe write (PIPE_BUF), so the monitor never reads half of them.
MAX_WORDS = 4096

# Runs in the monitor process: standard library only, nothing from this package (started with
# -I -S, it could not import it, and must not import torch). Arguments: the memfd, the pipe's
# read end, the rank's pid, the signal, the poll interval, the pause threshold.
_MONITOR = r"""
import json, mmap, os, select, signal, sys, time
fd, pipe, ppid, signum = (int(a) for a in sys.argv[1:5])
poll, pause_min = float(sys.argv[5]), float(sys.argv[6])
# A launcher or SLURM signals every process of the job (Ctrl+C to the process group, SIGTERM,
# SIGUSR1 before the time limit): none of that is for the monitor, which ends with its rank.
keep = {signal.SIGKILL, signal.SIGSTOP, signal.SIGCONT, signal.SIGCHLD, signal.SIGSEGV,
        signal.SIGBUS, signal.SIGFPE, signal.SIGILL, signal.SIGABRT, signal.SIGTRAP}
for s in signal.valid_signals():
    if s not in keep:
        try:
            signal.signal(s, signal.SIG_IGN)
        except (OSError, ValueError):
            pass
page = mmap.mmap(fd, mmap.PAGESIZE)
shared = memoryview(page).cast("d")
stat = "/proc/%d/stat" % ppid


def rank_stopped():
    try:
        with open(stat, "rb") as f:
            text = f.read()
    except OSError:
        return False
    return text[text.rindex(b")") + 2:text.rindex(b")") + 3] in (b"T", b"t")


def deadline():
    # The rank's store is one aligned 8-byte write; two equal reads rule out a torn one anyway.
    while True:
        a = shared[0]
        if shared[0] == a:
            return a


def say(words):
    # The rank's last words: {"append": [path, event]} (a JSON line, "t" now, on a fresh line)
    # and {"replace": [path, object]} (a temporary file renamed over it). Best effort: the
    # signal to the rank goes out whatever happens here.
    try:
        path, event = words.get("append") or (None, None)
        if path:
            event["t"] = round(time.time(), 3)
            line = (json.dumps(event, separators=(",", ":")) + "\n").encode()
            f = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK)
            try:
                size = os.fstat(f).st_size
                if size:
                    r = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
                    try:
                        if os.pread(r, 1, size - 1) != b"\n":
                            line = b"\n" + line     # a torn last line must not swallow ours
                    finally:
                        os.close(r)
                os.write(f, line)
            finally:
                os.close(f)
    except Exception:
        pass
    try:
        path, obj = words.get("replace") or (None, None)
        if path:
            tmp = "%s.tmp%d" % (path, os.getpid())
            with open(tmp, "w") as f:
                json.dump(obj, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
    except Exception:
        pass


shift, shift_for = 0.0, None       # seconds not counted, and the deadline they apply to
words, heard = None, b""
last = time.monotonic()
while True:
    ready, _, _ = select.select([pipe], [], [], poll)
    if ready:
        data = os.read(pipe, 65536)
        if not data:
            break                  # the rank's end closed: it exited or was killed
        heard += data
        while b"\n" in heard:
            msg, heard = heard.split(b"\n", 1)
            try:
                words = json.loads(msg)
            except ValueError:
                pass
    if os.getppid() != ppid or shared[1]:
        break
    now = time.monotonic()
    interval, last = now - last, now
    stopped = rank_stopped()
    if stopped:
        paused = interval          # the rank was stopped: its clock does not run
    elif interval > poll + pause_min:
        paused = interval - poll   # we were not running: stopped or frozen with the job
    else:
        paused = 0.0
    d = deadline()
    if paused:
        if d != shift_for:
            shift, shift_for = 0.0, d
        shift += paused
    if d > 0 and now > d + (shift if d == shift_for else 0.0) and not stopped:
        if words:
            say(words)             # first: once the rank is gone, its ending is on disk
        os.kill(ppid, signum)      # faulthandler dumps the stacks, _exit(signum) ends the rank
        break
"""


class BackstopMonitor:
    """A countdown kept by a monitor process; on expiry the process dumps all stacks and
    ``_exit(code)``s without the GIL. Stopped time (SIGSTOP, a suspended job) does not count.

    The same interface as ``CExitTimer``: ``arm(seconds)``, ``disarm()``, ``close()``,
    ``available`` (False where the monitor could not start: not Linux, no ``sys.executable``).
    """

    def __init__(self, code: int) -> None:
        self.code = int(code)
        self._pid = os.getpid()
        self.available = False
        self._proc: subprocess.Popen | None = None
        self._gone = False                 # its death was reported (once)
        if not (sys.platform.startswith("linux") and sys.executable
                and hasattr(os, "memfd_create")
                and signal.SIGRTMIN <= self.code <= signal.SIGRTMAX):
            return
        fd = rfd = wfd = -1
        try:
            fd = os.memfd_create("kempner-hang-backstop", os.MFD_CLOEXEC)
            os.ftruncate(fd, mmap.PAGESIZE)
            self._page = mmap.mmap(fd, mmap.PAGESIZE)
            self._shared = memoryview(self._page).cast("d")
            rfd, wfd = os.pipe()
            install_exit_handler(self.code)
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _MONITOR, str(fd), str(rfd), str(self._pid),
                 str(self.code), str(POLL_S), str(PAUSE_MIN_S)],
                pass_fds=(fd, rfd), close_fds=True, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL)
        except OSError as e:
            log.warning("the hang backstop's monitor process did not start (%s)", e)
            if wfd >= 0:
                os.close(wfd)
            return
        finally:
            for f in (fd, rfd):
                if f >= 0:
                    os.close(f)
        # The write end only tells the monitor that we are gone (it reads EOF): no child of
        # ours may keep it open, so it is close-on-exec (os.pipe's default).
        self._wfd = wfd
        self.available = True

    def arm(self, seconds: float) -> None:
        """(Re)start the countdown: exit ``seconds`` from now unless re-armed or disarmed."""
        if self.available and os.getpid() == self._pid:
            self._shared[_DEADLINE] = monotonic() + max(seconds, 1e-3)

    def disarm(self) -> None:
        if self.available and os.getpid() == self._pid:
            self._shared[_DEADLINE] = 0.0

    def close(self) -> None:
        """Stop the monitor (bounded: it notices within one poll, and is killed after 1 s)."""
        if not self.available or os.getpid() != self._pid:
            self.available = False
            return
        self.available = False
        self._shared[_DEADLINE] = 0.0
        self._shared[_CLOSED] = 1.0
        os.close(self._wfd)
        assert self._proc is not None
        try:
            self._proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._shared.release()
        self._page.close()

    def last_words(self, words: dict) -> None:
        """What the monitor writes when it fires, before it signals the rank (replacing any
        earlier words): ``{"append": [path, event]}``, ``{"replace": [path, object]}``, either
        or both (see the module docstring). Skipped, logged, when over ``MAX_WORDS`` bytes."""
        if not self.available or os.getpid() != self._pid:
            return
        msg = (json.dumps(words, separators=(",", ":"), default=str) + "\n").encode()
        if len(msg) > MAX_WORDS:
            log.warning("the hang backstop's last words are too long (%d bytes); a hang that "
                        "holds the GIL will leave no exit event", len(msg))
            return
        if self._gone:
            return
        try:
            os.write(self._wfd, msg)    # one write below PIPE_BUF: atomic, and never blocks
        except OSError as e:            # the monitor is gone: nothing will fire either
            # Once: the words are offered after every commit, and a monitor does not come back.
            self._gone = True
            log.warning("the hang backstop's monitor process is gone (%s): a hang that holds "
                        "the GIL will not end this rank, nor leave its exit event", e.strerror or e)

    @property
    def pid(self) -> int | None:
        """The monitor process's pid (None when not running)."""
        return self._proc.pid if self._proc is not None and self.available else None
