"""An srun task that runs its rank warm: forked by its node's standby (``standby.py``).

Each task of a step is ``python -S shim.py NAME python train.py ...``: the standard library
only, so it starts in milliseconds. It hands its node's standby the rank's command,
environment, working directory and standard streams, passes the task's signals on and exits as
the rank did; with no standby answering it becomes the rank (``exec``), a cold start. A
job-wide signal reaches a warm rank twice (the standby's step, this shim), so each is passed on
as a real-time stand-in (``FORWARDED_ENV``) that the rank counts as one with the other; a rank
that does not handle the stand-in gets the signal itself. docs/slurm.md, "Warm ranks under srun".
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import sys
import time

#: Names the real-time signals the shim passes signals on as: ``"RT:SIG,..."``.
FORWARDED_ENV = "KEMPNER_RESILIENCE_FORWARDED_SIGNALS"
_PASSED_ON = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)
# SIGRTMIN + 10 is the launchers' parent-death signal, 42 and 43 the watchdogs' timers.
_FIRST_RT = int(getattr(signal, "SIGRTMIN", 34)) + 11
# The standby imports torch before it forks the first rank (a cold start's time, once).
_READY_S = 120.0
# The standby step starts with the first training step: its socket is up within this
# (seconds; ``WAIT_ENV`` sets another).
_LISTEN_S = 10.0
WAIT_ENV = "KEMPNER_RESILIENCE_STANDBY_WAIT_S"


def forwarded() -> dict[int, int]:
    """The signal the shim passes each of ``_PASSED_ON`` on as."""
    return {int(s): _FIRST_RT + i for i, s in enumerate(_PASSED_ON)}


def main(argv: list[str]) -> None:
    name, command = argv[1], argv[2:]
    if not command:
        sys.stderr.write("usage: shim.py NAME COMMAND...\n")
        sys.exit(2)
    sock = _connect(name)
    if sock is None:
        _cold(command, "no standby on this node")
    table = forwarded()
    pid: list[int] = []
    pending: list[int] = []

    def pass_on(signum: int, frame: object) -> None:
        if pid:
            # As itself to a rank that does not handle its stand-in (no package, or not yet):
            # it then acts as on a cold rank.
            try:
                os.kill(pid[0], table[signum] if _catches(pid[0], table[signum]) else signum)
            except ProcessLookupError:
                pass
        else:
            pending.append(signum)

    for signum in table:
        signal.signal(signum, pass_on)
    env = dict(os.environ)
    env[FORWARDED_ENV] = ",".join(f"{rt}:{s}" for s, rt in table.items())
    request = json.dumps({"argv": command, "env": env, "cwd": os.getcwd()}).encode() + b"\n"
    answers = sock.makefile("rb")
    sock.settimeout(_READY_S)
    try:
        sock.sendmsg([request], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
        first = json.loads(answers.readline() or b"{}")
    except (OSError, ValueError):
        first = {}
    if "pid" not in first:
        # Refused (the standby is not fit to fork any more), gone or stuck: start cold. A
        # signal that came in this moment is lost with the shim, as before a cold rank's
        # handlers.
        sock.close()
        _cold(command, first.get("refused", "the standby did not answer"))
    sock.settimeout(None)       # the rank runs as long as it runs
    pid.append(int(first["pid"]))
    for signum in pending:
        pass_on(signum, None)
    try:
        last = json.loads(answers.readline() or b"{}")
    except (OSError, ValueError):
        last = {}
    # No answer: the standby died, and its ranks with it (their parent-death signal).
    code = int(last.get("code", -int(signal.SIGKILL)))
    if code < 0:
        # Die as the rank did, so srun reports the same signal.
        if -code not in (signal.SIGKILL, signal.SIGSTOP):    # (those two take no handler)
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code
    sys.exit(code)


def _connect(name: str) -> socket.socket | None:
    """The standby's socket; it may still be starting with the job's first step."""
    try:
        wait = float(os.environ.get(WAIT_ENV, _LISTEN_S))
    except ValueError:
        wait = _LISTEN_S
    deadline = time.monotonic() + wait
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # Linux's abstract namespace: per network namespace (a node), no file left behind.
            sock.connect("\0" + name)
            return sock
        except OSError:
            sock.close()
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.05)


def _catches(pid: int, signum: int) -> bool:
    """Whether process ``pid`` has a handler for ``signum`` (``SigCgt`` in its status)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _cold(command: list[str], why: str) -> None:
    if os.environ.get("KEMPNER_RESILIENCE_DEBUG"):
        sys.stderr.write(f"kempner_resilience: starting the rank cold: {why}\n")
    for signum in forwarded():
        signal.signal(signum, signal.SIG_DFL)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv)
