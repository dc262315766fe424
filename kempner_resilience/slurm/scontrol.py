"""Calling ``scontrol`` safely: argument lists (no shell), a time limit, and parsed output.

``scontrol`` may be missing (inside enroot/pyxis containers) or hang (a slow or unreachable
slurmctld), so every call here has a timeout and reports failure as a value, never as an
exception: the callers run on the shutdown path, where an exception would cost the checkpoint.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Mapping

from kempner_resilience.core.log import get_logger

__all__ = ["ScontrolResult", "run_scontrol", "show_job", "parse_show_job", "parse_slurm_time",
           "find_scontrol", "kill_wait"]

_log = get_logger(__name__)


# What a SLURM client prints when it could not reach slurmctld at all.
_NO_CONTROLLER = ("Unable to contact slurm controller", "Connection refused")


@dataclass(frozen=True)
class ScontrolResult:
    """Outcome of one ``scontrol`` call.

    ``returncode`` is None when the command did not run to completion (binary missing: ``missing``
    is True; time limit hit: ``timed_out`` is True).
    """

    args: tuple[str, ...]
    returncode: int | None
    stdout: str = ""
    stderr: str = ""
    missing: bool = False
    timed_out: bool = False
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    @property
    def unreachable(self) -> bool:
        """The client could not reach slurmctld at all: another call now fails the same way."""
        return self.returncode not in (0, None) and any(w in self.stderr for w in _NO_CONTROLLER)

    @property
    def unanswered(self) -> bool:
        """slurmctld did not answer: unreachable, or too slow (the time limit, or the client's
        own socket timeout), unlike a call it answered with an error."""
        return self.timed_out or self.unreachable or \
            (self.returncode not in (0, None) and "Socket timed out" in self.stderr)

    def describe(self) -> str:
        """One line saying what went wrong (or ``ok``), for logs and error messages."""
        cmd = " ".join(self.args)
        if self.missing:
            return f"`{cmd}`: {self.args[0]} not found on PATH"
        if self.timed_out:
            return f"`{cmd}`: no answer within {self.seconds:.1f}s (slurmctld slow or unreachable)"
        if self.returncode == 0:
            return f"`{cmd}`: ok"
        text = (self.stderr.strip() or self.stdout.strip() or "no output").splitlines()[-1]
        return f"`{cmd}`: exit {self.returncode}: {text}"


def find_scontrol(environ: Mapping[str, str] | None = None, name: str = "scontrol") -> str | None:
    """Path of ``scontrol`` on ``environ['PATH']`` (default: this process's PATH), or None."""
    env = os.environ if environ is None else environ
    return shutil.which(name, path=env.get("PATH", os.defpath))


# The shield's wrapper: an ignored disposition survives exec, so scontrol ignores them too.
_SHIELD = 'trap "" TERM INT HUP USR1 USR2; exec "$0" "$@"'
_SHIELD_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2}


def run_scontrol(args: list[str] | tuple[str, ...], timeout: float = 10.0, *,
                 environ: Mapping[str, str] | None = None,
                 shield: bool = False, tool: str = "scontrol") -> ScontrolResult:
    """Run ``scontrol *args`` with a time limit; never raises for a missing binary or a hang.
    ``tool``: another SLURM client (``squeue``), called the same way.

    ``shield``: the call survives the job's own SIGTERM (a call made right after ``scontrol
    requeue``, which makes slurmstepd signal every process of the job a few ms later): the
    child starts with those signals blocked (inherited from this thread's mask over fork and
    exec, so there is no window) and ignores them (``trap ''`` before exec). SIGKILL, after
    KillWait, still ends it; the time limit stays."""
    exe = find_scontrol(environ, tool)
    full = (tool, *args)
    if exe is None:
        return ScontrolResult(full, None, missing=True)
    argv = [exe, *args]
    if shield and os.path.exists("/bin/sh"):
        argv = ["/bin/sh", "-c", _SHIELD, exe, *args]
    t0 = time.monotonic()
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SHIELD_SIGNALS) if shield else None
    try:
        # Own session: on a hang the whole group is killed (a wrapper script's children too,
        # which would otherwise keep the pipes open and block us), and a terminal's Ctrl+C
        # meant for the training process never reaches it.
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                stdin=subprocess.DEVNULL, text=True, start_new_session=True,
                                env=None if environ is None else dict(environ))
    except OSError as e:  # not executable, vanished between which() and exec, ...
        return ScontrolResult(full, None, "", str(e), missing=True, seconds=time.monotonic() - t0)
    finally:
        if old_mask is not None:    # this thread takes its signals again (a pending one now)
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        try:
            out, err = proc.communicate(timeout=2.0)
        except subprocess.TimeoutExpired:  # a grandchild escaped the group and holds a pipe
            out, err = "", ""
        return ScontrolResult(full, None, out or "", err or "", timed_out=True,
                              seconds=time.monotonic() - t0)
    return ScontrolResult(full, proc.returncode, out, err, seconds=time.monotonic() - t0)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        try:
            proc.kill()
        except OSError:
            pass


# `scontrol show -o job` prints `Key=Value` pairs separated by spaces on one line per job; values
# can themselves hold spaces (Reason, Command, Comment), so split only before something that looks
# like the next key.
_KEY_SPLIT = re.compile(r" (?=[A-Za-z][A-Za-z0-9_/:.]*=)")


def parse_show_job(text: str) -> list[dict[str, str]]:
    """Parse ``scontrol show -o job`` output into one dict per job (an array gives several)."""
    jobs = []
    for line in text.splitlines():
        line = line.strip()
        if not line or "=" not in line:
            continue
        record: dict[str, str] = {}
        for token in _KEY_SPLIT.split(line):
            key, sep, value = token.partition("=")
            if sep:
                record[key.strip()] = value.strip()
        jobs.append(record)
    return jobs


def show_job(job_id: str, timeout: float = 10.0, *,
             environ: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """``scontrol show -o job <job_id>`` as a dict, or None when it cannot be obtained."""
    res = run_scontrol(["show", "-o", "job", str(job_id)], timeout, environ=environ)
    if not res.ok:
        _log.debug("show job failed: %s", res.describe())
        return None
    jobs = parse_show_job(res.stdout)
    return jobs[0] if jobs else None


_KILL_WAIT = re.compile(r"^\s*KillWait\s*=\s*(\d+)", re.M)


def kill_wait(timeout: float = 10.0, *,
              environ: Mapping[str, str] | None = None) -> float | None:
    """The cluster's ``KillWait`` (seconds from the time limit's SIGTERM to SIGKILL), from
    ``scontrol show config``; None when it cannot be obtained."""
    res = run_scontrol(["show", "config"], timeout, environ=environ)
    if not res.ok:
        _log.debug("show config failed: %s", res.describe())
        return None
    m = _KILL_WAIT.search(res.stdout)
    return float(m.group(1)) if m else None


def parse_slurm_time(value: str | None) -> float | None:
    """``2026-11-21T19:22:10`` (slurmctld's local time) -> epoch seconds; None for N/A/Unknown."""
    if not value or value in ("N/A", "Unknown", "None", "(null)"):
        return None
    try:
        return time.mktime(time.strptime(value, "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None
