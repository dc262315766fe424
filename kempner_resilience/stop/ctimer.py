"""The kernel-timer backstop: exit with a chosen code even when a hang holds the GIL.

Used by the shutdown ``DeadlineWatchdog`` (a grace window is real time). The hang watchdog uses
a monitor process instead (``backstop.py``): a kernel timer runs on while the process is stopped
(a suspended job) and its signal, delivered at SIGCONT, would end a job that never hung.

A POSIX timer (``timer_create``, CLOCK_MONOTONIC) delivers a real-time signal whose handler is
faulthandler (C code: it dumps every thread's stack) chained to libc's ``_exit`` installed as a
plain signal handler. A handler receives the signal number as its argument, so the exit status is
the signal number: that is why ``ExitCode.HANG`` and ``ExitCode.DEADLINE`` lie in the real-time
signal range. No Python runs on this path.
"""

from __future__ import annotations

import ctypes
import faulthandler
import os
import signal
import sys

from kempner_resilience.core.log import get_logger

__all__ = ["CExitTimer", "install_exit_handler"]

log = get_logger(__name__)


class _timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _timespec), ("it_value", _timespec)]


class _sigevent(ctypes.Structure):
    # glibc x86_64/aarch64 layout: sigval, signo, notify, then a union padding to 64 bytes.
    _fields_ = [("sigev_value", ctypes.c_void_p), ("sigev_signo", ctypes.c_int),
                ("sigev_notify", ctypes.c_int), ("_pad", ctypes.c_int * 12)]


_CLOCK_MONOTONIC = 1
_SIGEV_SIGNAL = 0
_installed_codes: set[int] = set()
_libc_cache: list[ctypes.CDLL | None] = []


def _libc() -> ctypes.CDLL | None:
    if not _libc_cache:
        lib = None
        if sys.platform.startswith("linux"):
            lib = ctypes.CDLL(None, use_errno=True)
            if not hasattr(lib, "timer_create"):  # glibc < 2.34 keeps it in librt
                from ctypes.util import find_library   # runs ldconfig: only here

                rt = find_library("rt")
                lib = ctypes.CDLL(rt, use_errno=True) if rt else None
        _libc_cache.append(lib)
    return _libc_cache[0]


def install_exit_handler(code: int) -> None:
    """Make signal ``code`` dump every thread's stack (faulthandler) and then ``_exit(code)``,
    all in C: it works while a hang holds the GIL. Also used by the hang backstop's monitor
    process (``backstop.py``), which sends the signal instead of a timer."""
    if code in _installed_codes:
        return
    libc = ctypes.CDLL(None)
    libc.signal.restype = ctypes.c_void_p
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal(code, ctypes.cast(libc._exit, ctypes.c_void_p).value)
    # chain=True: after dumping, faulthandler restores the previous handler (_exit) and re-raises.
    faulthandler.register(code, file=2, all_threads=True, chain=True)
    _installed_codes.add(code)


class CExitTimer:
    """A kernel timer that, on expiry, dumps all stacks and ``_exit(code)``s without the GIL.

    ``code`` must be a real-time signal number (``ExitCode.HANG``/``DEADLINE``). Where POSIX
    timers are not available (not Linux) the timer is inert and ``available`` is False.
    """

    def __init__(self, code: int) -> None:
        self.code = int(code)
        self._timer = ctypes.c_void_p()
        self._pid = os.getpid()
        self.available = False
        libc = _libc()
        if libc is None or not (signal.SIGRTMIN <= self.code <= signal.SIGRTMAX):
            return
        install_exit_handler(self.code)
        ev = _sigevent()
        ev.sigev_signo = self.code
        ev.sigev_notify = _SIGEV_SIGNAL
        if libc.timer_create(_CLOCK_MONOTONIC, ctypes.byref(ev), ctypes.byref(self._timer)) != 0:
            log.warning("timer_create failed (errno %d): GIL-holding hangs are not covered",
                        ctypes.get_errno())
            return
        self._settime = libc.timer_settime
        self._spec = _itimerspec()
        self._spec_ref = ctypes.byref(self._spec)
        self.available = True

    def arm(self, seconds: float) -> None:
        """(Re)start the countdown: exit ``seconds`` from now unless re-armed or disarmed."""
        if not self.available or os.getpid() != self._pid:
            return
        seconds = max(seconds, 1e-3)
        whole = int(seconds)
        self._spec.it_value.tv_sec = whole
        self._spec.it_value.tv_nsec = int((seconds - whole) * 1e9)
        self._settime(self._timer, 0, self._spec_ref, None)

    def disarm(self) -> None:
        if not self.available or os.getpid() != self._pid:
            return
        self._spec.it_value.tv_sec = 0
        self._spec.it_value.tv_nsec = 0
        self._settime(self._timer, 0, self._spec_ref, None)

    def close(self) -> None:
        if self.available and os.getpid() == self._pid:
            self.disarm()
            _libc().timer_delete(self._timer)  # type: ignore[union-attr]
        self.available = False
