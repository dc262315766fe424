"""torchrun under srun: one elastic agent per node whose workers shut down like srun ranks.

Stock torchrun is unsafe as an srun task. A SIGUSR1 (SLURM's time-limit warning) kills its
agent (the default action), the task ends and SLURM kills the workers mid-save. On SIGTERM the
agent forwards it and SIGKILLs the workers 30 s later, whatever they are doing. And when one
worker exits first it SIGTERMs the others: a second SIGTERM forces a worker out at once, so a
slower rank 0 that was still finishing its shutdown loses it.

``run`` runs torchrun's own ``main`` in this process with three pieces of torch elastic replaced
(each looked up defensively: a missing name logs a warning and keeps torch's behaviour):

* its signal handler (``multiprocessing.api._terminate_process_handler``): a signal at the agent
  is recorded and sent once to every worker, unless SLURM delivers it to the workers itself
  (``forward_signals``). The workers decide what it means (a second SIGTERM/SIGINT forces them
  out, anything else tightens their deadline), so the agent never escalates on its own.
* ``PContext.close``: once a signal came or a worker exited, the agent waits for every worker
  to exit on its own, until the package's shutdown deadline (the signal's grace +
  ``watchdog.exit_timeout_s`` + ``MARGIN_S``); only workers still alive then are SIGKILLed.
* the workers' ``Popen``: the agent keeps the processes, and each worker gets a signal from
  the kernel when the agent dies (``PR_SET_PDEATHSIG``): torch starts them in sessions of their
  own, where neither proctrack/pgid nor a terminal reaches them. Not SIGTERM: the agent has
  threads, and Linux sends the parent-death signal as each of them exits, so one death would
  reach a worker as two or more SIGTERMs within milliseconds, and a second SIGTERM forces it out
  without its checkpoint. The workers get ``signals.PARENT_DEATH_SIGNAL``, named in their
  ``$KEMPNER_RESILIENCE_PARENT_DEATH_SIGNAL``: their ShutdownHandler counts its repeats once and
  stops as for SIGTERM (checkpoint, 143).

The agent's exit code is the workers' (``exit_code``): 75 when rank 0 requeued the job. Its
last line says what it knows about the checkpoint, from rank 0's run report (the agent points
``$KEMPNER_RESILIENCE_REPORT`` at a file of its own): the newest checkpoint the run committed,
or none; without a report (rank 0 forced out or killed, or started by another node's agent) it
claims nothing. On a requeue (75) it also says that torch's ``failed (exitcode: 75)`` just
before is the requeue, not an error.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Mapping, Sequence

from kempner_resilience.config import ResilienceConfig, load_config
from kempner_resilience.exitcodes import ExitCode, describe
from kempner_resilience.ledger import AGENT_START_ENV, process_start_time
from kempner_resilience.log import get_logger
from kempner_resilience.shutdown.report import REPORT_ENV
from kempner_resilience.signals import PARENT_DEATH_ENV, PARENT_DEATH_SIGNAL
from kempner_resilience.slurm.preflight import TORCHRUN_AGENT_ENV

__all__ = ["run", "forward_signals", "exit_code", "FORWARD_ENV", "AGENT_ENV", "MARGIN_S"]

log = get_logger("kempner_resilience.integrations.torchrun")  # also as __main__

#: ``yes``: the agent forwards every signal to its workers; ``no``: never (SLURM delivers them
#: to every process of the step); ``auto`` (default): decided from SLURM's ProctrackType.
FORWARD_ENV = "KEMPNER_RESILIENCE_FORWARD_SIGNALS"
#: Set in the workers' environment (the agent's pid): preflight knows who started them.
AGENT_ENV = TORCHRUN_AGENT_ENV
#: Added to a worker's own deadline (grace + exit timeout) before the agent kills it: the
#: worker's deadline watchdog must always get the first word.
MARGIN_S = 15.0
# What stock torchrun handles (TORCHELASTIC_SIGNALS_TO_HANDLE's default); the config's
# signals (SIGUSR1, SIGUSR2, ...) come on top.
_TORCH_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
# torch elastic's opt-out of sharing the rendezvous TCPStore with the workers (see ``run``).
_OWN_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
_YES, _NO = ("yes", "1", "true", "always"), ("no", "0", "false", "never")
# Our log lines carry a rank prefix taken from SLURM_PROCID, the node's index here: the host
# name says which agent speaks.
_AGENT = f"torchrun agent on {socket.gethostname()}"


def forward_signals(environ: Mapping[str, str] | None = None, timeout_s: float = 10.0
                    ) -> tuple[bool, str]:
    """Whether the agent must forward the signals it gets to its workers, and why.

    SLURM signals a job step through its proctrack plugin. proctrack/cgroup signals only the
    task itself, srun's child (the agent), unless cgroup.conf has
    ``SignalChildrenProcesses=yes``; proctrack/pgid only the task's process group, which the
    workers (sessions of their own) are not in; proctrack/linuxproc the task's whole process
    tree, workers included. Outside SLURM (a terminal's Ctrl+C reaches only the agent) the agent
    forwards. ``$KEMPNER_RESILIENCE_FORWARD_SIGNALS`` (yes/no/auto) overrides the decision.
    """
    env = os.environ if environ is None else environ
    choice = env.get(FORWARD_ENV, "auto").strip().lower() or "auto"
    if choice in _YES:
        return True, f"{FORWARD_ENV}={choice}"
    if choice in _NO:
        return False, f"{FORWARD_ENV}={choice}"
    if choice != "auto":
        raise ValueError(f"{FORWARD_ENV}={choice!r} is not allowed; use yes, no or auto")
    if "SLURM_JOB_ID" not in env or "SLURM_STEP_ID" not in env:
        return True, "not an srun task: only the agent gets the signals"
    from kempner_resilience.slurm.scontrol import run_scontrol

    res = run_scontrol(["show", "config"], timeout_s, environ=env)
    conf = dict(re.findall(r"^(\w+)\s*=\s*(\S*)", res.stdout, re.M)) if res.ok else {}
    proctrack = conf.get("ProctrackType")
    if proctrack is None:
        log.warning("could not read SLURM's ProctrackType (%s): the agent forwards signals to "
                    "its workers; set %s=no if SLURM signals every process of a step",
                    res.describe(), FORWARD_ENV)
        return True, "ProctrackType unknown"
    if proctrack == "proctrack/linuxproc":
        return False, f"{proctrack} signals the task's whole process tree"
    if proctrack == "proctrack/cgroup" and conf.get("SignalChildrenProcesses", "").lower() \
            in ("yes", "1", "true"):
        return False, f"{proctrack} with SignalChildrenProcesses=yes signals every process"
    return True, f"{proctrack} signals only the srun task"


def exit_code(codes: Mapping[int, int]) -> int:
    """The agent's exit code from its workers' ``{global rank: returncode}``: the lowest rank's
    non-zero code, a death by signal N as 128+N (as a shell reports it); 0 when all are 0."""
    for rank in sorted(codes):
        code = codes[rank]
        if code:
            return 128 - code if code < 0 else code
    return 0


class _Agent:
    """What the agent knows about its workers and the signals it got (one per process)."""

    def __init__(self, config: ResilienceConfig, forward: bool) -> None:
        self.config = config
        self.forward = forward
        self.workers: list[subprocess.Popen] = []
        self.signals: list[int] = []
        self.deadline: float | None = None   # time.monotonic() at which survivors are killed
        self._changed = threading.Event()
        self._reaper: threading.Thread | None = None
        self._group = 0                      # the worker group (torch restarts start a new one)
        # Reentrant: the signal handler runs on the main thread, maybe while it holds the lock.
        self._lock = threading.RLock()

    def add_worker(self, proc: subprocess.Popen) -> None:
        with self._lock:
            if self.workers and not self.alive():
                # torch restarts the group (--max-restarts > 0): a fresh start, fresh deadline.
                self.workers, self.signals, self.deadline = [], [], None
                self._group += 1
                self._reaper = None
                self._changed.set()
            self.workers.append(proc)

    def window(self, signum: int | None) -> float:
        """Seconds a worker may take to exit after ``signum`` (None: after a peer exited)."""
        s = self.config.signals
        if signum is None:
            grace = max([s.grace_s, *(s.grace_for(n) for n in s.handled())])
        else:
            name = signal.Signals(signum).name
            grace = s.grace_for(name) if name in s.handled() else s.grace_s
        return grace + self.config.watchdog.exit_timeout_s + MARGIN_S

    def alive(self) -> list[subprocess.Popen]:
        return [p for p in list(self.workers) if p.poll() is None]

    def on_signal(self, signum: int, frame: Any) -> None:
        """The agent's handler for every signal torchrun or the config handles."""
        name = signal.Signals(signum).name
        self.signals.append(signum)
        if not self.workers:
            # No worker exists yet (rendezvous): nothing to stop gracefully; leave as stock
            # torchrun would, without starting them.
            raise _Interrupted(signum)
        self._arm(time.monotonic() + self.window(signum))
        if self.forward:
            for p in self.workers:
                try:
                    p.send_signal(signum)   # polls first: never a reused pid
                except OSError:
                    pass
        log.warning("%s: %s %s %d worker(s); waiting up to %.0f s for them to exit", _AGENT,
                    name, "forwarded to" if self.forward else "not forwarded (SLURM signals) to",
                    len(self.workers), self.deadline - time.monotonic())

    def wait_for_workers(self) -> None:
        """Once a signal came or a worker exited: until every worker is gone, or the deadline
        (then the reaper has killed what was left)."""
        if not self.signals and len(self.alive()) == len(self.workers):
            return   # torch stops healthy workers for its own reasons (a restart): its way
        self._arm(time.monotonic() + self.window(None))
        while self.alive():
            with self._lock:
                end = self.deadline
            if end is not None and time.monotonic() > end + 5.0:
                break
            time.sleep(0.05)

    def _arm(self, deadline: float) -> None:
        with self._lock:
            if self.deadline is not None and self.deadline <= deadline:
                return
            self.deadline = deadline
            self._changed.set()
            if self._reaper is None:
                self._reaper = threading.Thread(target=self._reap, args=(self._group,),
                                                name="kempner-agent-reaper", daemon=True)
                self._reaper.start()

    def _reap(self, group: int) -> None:
        while True:
            with self._lock:
                if group != self._group:
                    return
                self._changed.clear()
                left = self.deadline - time.monotonic()  # type: ignore[operator]
                if left <= 0:
                    survivors = self.alive()
                    break
            self._changed.wait(left)
        if survivors:
            log.error("%s: %d worker(s) still running at the shutdown deadline: killing them "
                      "(pids %s)", _AGENT, len(survivors), [p.pid for p in survivors])
        for p in survivors:
            try:
                os.killpg(p.pid, signal.SIGKILL)    # its own session: its children too
            except OSError:
                pass


class _Interrupted(BaseException):
    # A BaseException: torch's rendezvous retries on Exception, and must not swallow this.
    def __init__(self, signum: int) -> None:
        super().__init__(f"{signal.Signals(signum).name} before the workers started")
        self.signum = signum


_PR_SET_PDEATHSIG = 1


def _pdeathsig() -> Callable[[], None] | None:
    # Resolved here, in the agent: between fork and exec the child must not dlopen anything.
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    return lambda: prctl(_PR_SET_PDEATHSIG, PARENT_DEATH_SIGNAL)


def _patch(module: Any, name: str, new: Any, saved: list[tuple[Any, str, Any]]) -> bool:
    if not hasattr(module, name):
        log.warning("torch %s has no %s.%s: keeping torchrun's own behaviour there",
                    _torch_version(), module.__name__, name)
        return False
    saved.append((module, name, getattr(module, name)))
    setattr(module, name, new)
    return True


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


@contextmanager
def _patched(agent: _Agent) -> Iterator[bool]:
    """torch elastic's worker Popen, signal handler and close replaced for the time of the run;
    yields False (nothing replaced: stock torchrun) when the workers cannot be tracked."""
    from torch.distributed.elastic.multiprocessing import api
    from torch.distributed.elastic.multiprocessing.subprocess_handler import \
        subprocess_handler as sh

    saved: list[tuple[Any, str, Any]] = []
    stock_popen = getattr(sh, "Popen", None)
    stock_close = getattr(getattr(api, "PContext", None), "close", None)
    die_with_agent = _pdeathsig()

    def popen(*args: Any, **kwargs: Any) -> subprocess.Popen:
        if die_with_agent is not None and "preexec_fn" not in kwargs:
            kwargs["preexec_fn"] = die_with_agent
            # The worker learns which signal means "the agent died" (see the module's doc).
            env = dict(os.environ if kwargs.get("env") is None else kwargs["env"])
            env[PARENT_DEATH_ENV] = str(PARENT_DEATH_SIGNAL)
            kwargs["env"] = env
        proc = stock_popen(*args, **kwargs)  # type: ignore[misc]
        agent.add_worker(proc)
        return proc

    def close(pcontext: Any, death_sig: Any = None, timeout: int = 30) -> None:
        agent.wait_for_workers()
        stock_close(pcontext, death_sig, timeout)  # type: ignore[misc]

    # Everything rests on knowing the workers: without them, torchrun stays stock.
    if _patch(sh, "Popen", popen, saved):
        _patch(api, "_terminate_process_handler", agent.on_signal, saved)
        if stock_close is not None:
            _patch(api.PContext, "close", close, saved)
        else:
            log.warning("torch %s has no PContext.close: a worker that exits first gets the "
                        "others SIGTERMed, as with stock torchrun", _torch_version())
    try:
        yield bool(saved)
    finally:
        for module, name, value in reversed(saved):
            setattr(module, name, value)


def _signals(config: ResilienceConfig) -> list[int]:
    names = set(config.signals.handled()) | set(_TORCH_SIGNALS)
    return sorted(int(getattr(signal, n)) for n in names if hasattr(signal, n))


def run(argv: Sequence[str], config: ResilienceConfig | None = None,
        forward: bool | None = None) -> int:
    """Run ``torchrun argv`` (its own arguments, then the script's) in this process as a
    well-behaved srun task; returns the exit code for the batch script (see ``exit_code``).

    ``config``: the package config the workers use (their grace and exit timeout bound the
    agent's wait); default ``load_config()``. ``forward``: None decides with
    ``forward_signals()``.
    """
    config = config or load_config()
    config.validate()  # built or changed in Python: held to the file's rules (ConfigError, 78)
    if forward is None:
        forward, why = forward_signals()
    else:
        why = "forward=" + str(forward)
    agent = _Agent(config, forward)
    previous = {s: signal.getsignal(s) for s in _signals(config)}
    # Before torch loads (seconds): a signal before the workers start then ends the agent with
    # 128+N, as a shell would report it, instead of a USR1's silent default-action death.
    for s in previous:
        signal.signal(s, agent.on_signal)
    report: _Report | None = None
    try:
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import main as torchrun_main

        os.environ[AGENT_ENV] = str(os.getpid())
        # The workers' ledger counts the attempt from here: the agent's imports and rendezvous
        # are the job's time, not time in the queue (goodput.py).
        os.environ[AGENT_START_ENV] = repr(process_start_time())
        # The workers' own store, not the agent's: recent torch (c10d rendezvous) lets
        # the workers share the agent's TCPStore by default, and the stop agreement, the
        # checkpoint's commit and the shared exit code all go through that store. An agent that
        # dies (OOM-killed, SIGKILLed) would take it along and turn the workers' graceful stop
        # into a lost peer. With torch's own opt-out, worker rank 0 serves it, as under srun.
        # (The static rendezvous always shares the agent's store: there node 0's agent dying
        # still leaves only the rescue.)
        os.environ.setdefault(_OWN_STORE_ENV, "1")
        report = _Report()
        log.info("%s: signals %s to the workers (%s)", _AGENT,
                 "are forwarded" if forward else "are not forwarded", why)
        with _patched(agent) as patched:
            if not patched:
                _restore(previous)
            try:
                torchrun_main(list(argv))
            except ChildFailedError as e:
                codes = {int(r): int(f.exitcode) for r, f in sorted(e.failures.items())}
                code = exit_code(codes)
                log.warning("%s: workers exited with %s: exiting with %s", _AGENT, codes,
                            what_the_workers_did(code, report.read()))
                return code
        return 0
    except _Interrupted as e:
        log.warning("%s: %s; exiting with %d", _AGENT, e, 128 + e.signum)
        return 128 + e.signum
    finally:
        _restore(previous)
        if report is not None:
            report.close()


# Codes whose meaning includes "checkpoint committed": from the code alone the agent cannot tell
# (a forced exit, 130/143, committed nothing; a run without state requeues without one).
_COMMIT_CODES = (ExitCode.REQUEUE, ExitCode.STOPPED, ExitCode.REQUEUE_FAILED, ExitCode.SIGINT,
                 ExitCode.SIGTERM)


def what_the_workers_did(code: int, report: Mapping[str, Any] | None) -> str:
    """The agent's account of its workers' exit ``code``: the code, and only what rank 0's run
    ``report`` (None: there is none) says about the checkpoint."""
    if code in _COMMIT_CODES:
        text = f"{ExitCode(code).name} ({code})"
    else:
        text = describe(code)
    if report is None:
        text += ("; no run report from rank 0 (forced out, killed, or started by another "
                 "node's agent), so no checkpoint is claimed here: `kempner-resilience ls` "
                 "shows what is on disk")
    elif report.get("saved_step") is not None:
        text += (f"; newest checkpoint this run committed: step {report['saved_step']} "
                 f"({report.get('saved_path')})")
    else:
        resumed = report.get("resumed_from")
        text += "; this run committed no checkpoint" + (
            f" (it resumed from step {resumed})" if resumed is not None else "")
    if code == ExitCode.REQUEUE:
        text += "; torch's 'failed (exitcode: 75)' report above is this requeue, not an error"
    return text


class _Report:
    """Rank 0's run report, for the agent's last line: at the user's
    ``$KEMPNER_RESILIENCE_REPORT`` (then only a report written during this run counts), else in
    a directory of the agent's own, set in the environment the workers inherit."""

    def __init__(self) -> None:
        self._saved_env = os.environ.get(REPORT_ENV)
        self._own_dir: str | None = None
        if self._saved_env:
            self.path = self._saved_env
        else:
            self._own_dir = tempfile.mkdtemp(prefix="kempner-agent-")
            self.path = os.path.join(self._own_dir, "report.json")
            os.environ[REPORT_ENV] = self.path
        self._before = self._stamp()

    def _stamp(self) -> int | None:
        try:
            return os.stat(self.path).st_mtime_ns
        except OSError:
            return None

    def read(self) -> dict[str, Any] | None:
        """The report rank 0 wrote during this run, or None."""
        if self._stamp() in (None, self._before):
            return None
        try:
            with open(self.path) as f:
                report = json.load(f)
        except (OSError, ValueError):
            return None
        return report if isinstance(report, dict) else None

    def close(self) -> None:
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)
            if os.environ.get(REPORT_ENV) == self.path:
                del os.environ[REPORT_ENV]


def _restore(handlers: Mapping[int, Any]) -> None:
    for signum, handler in handlers.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m kempner_resilience.integrations.torchrun [torchrun args] script [args]``
    (config from ``$KEMPNER_RESILIENCE_CONFIG``)."""
    from kempner_resilience.log import configure

    configure("INFO")
    return run(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    sys.exit(main())
