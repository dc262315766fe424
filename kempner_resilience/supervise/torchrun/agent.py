"""The torchrun agent's workers: tracked, signalled once, killed only at the shutdown deadline.

``starting`` is the one place torch's module-level names are replaced. With
``$KEMPNER_RESILIENCE_WARM=1`` (the torchrun template sets it) every worker is a fresh fork of
the agent's zygote (``local/warm.py``): Python's start-up and ``import torch`` are paid once.
On a machine with a standby that fits (``local/standby.py``) the workers fork from it, and the
agent starts no zygote at all. A command the zygote cannot run, or a zygote that is gone,
starts the worker cold.
"""

from __future__ import annotations

import importlib
import os
import signal
import socket
import subprocess
import threading
import time
from contextlib import ExitStack, contextmanager, suppress
from typing import Any, Callable, Iterator

from kempner_resilience.config import ResilienceConfig
from kempner_resilience.core import torch_private
from kempner_resilience.core.log import get_logger
from kempner_resilience.stop.signals import PARENT_DEATH_ENV, PARENT_DEATH_SIGNAL
from kempner_resilience.supervise.local.standby import standby_or_zygote
from kempner_resilience.supervise.local.warm import (STEP_SIGNALS, UNBUFFERED, Forker,
                                                      WarmProcess, parent_death,
                                                      warm_command)

__all__ = ["Agent", "Interrupted", "starting", "WarmWorkers", "MARGIN_S", "AGENT_NAME",
           "TORCH_SIGNALS"]

# One logger for the whole integration: users filter their logs on it.
log = get_logger("kempner_resilience.supervise.torchrun.wrapper")

#: Added to a worker's own deadline (grace + exit timeout) before the agent kills it: the
#: worker's deadline watchdog must always get the first word.
MARGIN_S = 15.0
# The rank prefix here is SLURM_PROCID, the node's index: the host name says which agent.
AGENT_NAME = f"torchrun agent on {socket.gethostname()}"
#: The signals torch's process context handles by default (TORCHELASTIC_SIGNALS_TO_HANDLE).
TORCH_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")


class Agent:
    """What the agent knows about its workers and the signals it got (one per process)."""

    def __init__(self, config: ResilienceConfig, forward: bool) -> None:
        self.config = config
        self.forward = forward
        self.workers: list[subprocess.Popen] = []
        self.ranks: dict[int, int] = {}      # worker pid -> global rank (this group)
        self.killed: set[int] = set()        # pids the reaper killed at the deadline
        self.signals: list[int] = []
        self.deadline: float | None = None   # time.monotonic() at which survivors are killed
        self._changed = threading.Event()
        self._reaper: threading.Thread | None = None
        self._group = 0                      # the worker group (torch restarts start a new one)
        # Reentrant: the signal handler runs on the main thread, maybe while it holds the lock.
        self._lock = threading.RLock()

    def add_worker(self, proc: subprocess.Popen) -> None:
        with self._lock:
            self.stand_by()     # torch restarts the group (--max-restarts > 0): a fresh deadline
            self.workers.append(proc)

    def stand_by(self) -> None:
        """Forget a group that is over (a restart, or a round this agent stands by in)."""
        with self._lock:
            if self.workers and not self.alive():
                self.workers, self.signals, self.deadline = [], [], None
                self.ranks, self.killed = {}, set()
                self._group += 1
                self._reaper = None
                self._changed.set()

    def name_ranks(self, ranks: dict[int, int]) -> None:
        """``{pid: global rank}`` of the group just started (its workers' codes by rank)."""
        with self._lock:
            self.ranks.update(ranks)

    def codes(self) -> dict[int, int]:
        """The workers of this group that ended: ``{global rank: return code}``."""
        return {self.ranks[p.pid]: int(p.returncode) for p in list(self.workers)
                if p.pid in self.ranks and p.poll() is not None}

    def killed_ranks(self) -> set[int]:
        """The global ranks the reaper killed at the deadline (they had not ended)."""
        return {self.ranks[pid] for pid in self.killed if pid in self.ranks}

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
        self.signals.append(signum)
        if not self.workers:
            # Still in the rendezvous: leave as stock torchrun would.
            raise Interrupted(signum)
        self._arm(time.monotonic() + self.window(signum))
        if self.forward:
            for p in self.workers:
                with suppress(OSError):
                    p.send_signal(signum)   # polls first: never a reused pid
        log.warning("%s: %s %s %d worker(s); waiting up to %.0f s for them to exit", AGENT_NAME,
                    signal.Signals(signum).name,
                    "forwarded to" if self.forward else "not forwarded (SLURM signals) to",
                    len(self.workers), self.deadline - time.monotonic())

    def wait_for_workers(self) -> None:
        """Once a signal came or a worker exited: wait until every worker is gone, or the
        deadline."""
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
                      "(pids %s)", AGENT_NAME, len(survivors), [p.pid for p in survivors])
        for p in survivors:
            self.killed.add(p.pid)
            with suppress(OSError):
                os.killpg(p.pid, signal.SIGKILL)    # its own session: its children too


class Interrupted(BaseException):
    # A BaseException: torch's rendezvous retries on Exception, and must not swallow this.
    def __init__(self, signum: int) -> None:
        super().__init__(f"{signal.Signals(signum).name} before the workers started")
        self.signum = signum


@contextmanager
def starting(agent: Agent, names: dict[str, Any],
             warm: Callable[..., Any] | None = None) -> Iterator[None]:
    """For one worker group's start: torch's workers' ``Popen``, its signal handler and, with
    ``warm`` (``WarmWorkers.handler``), its subprocess handler are ours.

    No subclass can do this: module functions build the process context and call these
    names. Our handler installed after the start would leave a window for torch's
    ``SignalException`` (every worker SIGTERMed, SIGKILLed 30 s later)."""
    popen_module = importlib.import_module(torch_private.SUBPROCESS_HANDLER_MODULE)
    api_module = importlib.import_module(torch_private.MP_API_MODULE)
    stock_popen = names["Popen"]
    die_with_agent = parent_death(PARENT_DEATH_SIGNAL)   # None: no prctl

    def popen(*args: Any, **kwargs: Any) -> subprocess.Popen:
        if die_with_agent is not None and "preexec_fn" not in kwargs:
            kwargs["preexec_fn"] = die_with_agent
            # The worker learns which signal means "the agent died".
            kwargs["env"] = {**(os.environ if kwargs.get("env") is None else kwargs["env"]),
                             PARENT_DEATH_ENV: str(PARENT_DEATH_SIGNAL)}
        proc = stock_popen(*args, **kwargs)
        agent.add_worker(proc)
        return proc

    ours = [(popen_module, "Popen", popen), (api_module, "_terminate_process_handler",
                                             agent.on_signal)]
    if warm is not None:
        ours.append((api_module, "get_subprocess_handler", warm))
    with ExitStack() as undo:
        for module, name, value in ours:
            undo.callback(setattr, module, name, getattr(module, name))
            setattr(module, name, value)
        yield


class WarmWorkers:
    """One agent's zygote, or the machine's standby; ``handler`` forks each worker from it."""

    def __init__(self, tracked: Agent, zygote: Forker) -> None:
        self.tracked = tracked
        self.zygote = zygote
        self.cold_why: str | None = None     # set once the workers start cold for good
        self.handler = _warm_handler(self)   # what get_subprocess_handler builds meanwhile

    @classmethod
    def for_spec(cls, spec: Any, tracked: Agent) -> "WarmWorkers | None":
        """The agent's warm workers for torch's ``WorkerSpec``, zygote started; None when the
        command cannot start warm or this torch lacks the names. Call it on the agent's main
        thread: the zygote dies when the thread that started it ends."""
        if not isinstance(spec.entrypoint, str) \
                or not warm_command([spec.entrypoint, *map(str, spec.args)], (UNBUFFERED,)) \
                or torch_private.elastic("warm") is None:
            return None
        handled = {*STEP_SIGNALS, *tracked.config.signals.handled()}
        ignore = sorted(int(getattr(signal, n)) for n in handled if hasattr(signal, n))
        parent = standby_or_zygote(dict(os.environ), ignore=ignore, death_signal=signal.SIGKILL)
        log.info("%s: workers start warm, forked from %s (%s=1)", AGENT_NAME, parent,
                 "KEMPNER_RESILIENCE_WARM")
        return cls(tracked, parent)

    def popen(self, handler: Any, args: tuple, env: dict[str, str]) -> WarmProcess | None:
        """The worker ``handler`` starts, forked from the zygote; None: start it cold."""
        argv = [str(a) for a in args]
        if self.cold_why is not None or not warm_command(argv, (UNBUFFERED,)):
            return None
        if torch_private.instance_missing("warm", handler):
            self.cold_why = "torch's handler has no log files to give the worker"
            return None
        out, err = handler._stdout, handler._stderr
        try:
            proc = self.zygote.spawn(argv, {**env, PARENT_DEATH_ENV: str(PARENT_DEATH_SIGNAL)},
                                     os.getcwd(), out.name if out else None,
                                     err.name if err else None, death_signal=PARENT_DEATH_SIGNAL)
        except OSError as e:
            self.cold_why = str(e)
            log.warning("%s: warm start unavailable (%s): the workers start cold from now on",
                        AGENT_NAME, e)
            return None
        self.tracked.add_worker(proc)  # type: ignore[arg-type]  # Popen's interface
        return proc


def _warm_handler(warm: WarmWorkers) -> type:
    """torch's ``SubprocessHandler`` whose ``_popen`` forks the worker from ``warm``'s zygote."""
    base = importlib.import_module(torch_private.SUBPROCESS_HANDLER_MODULE).SubprocessHandler

    class WarmSubprocessHandler(base):  # type: ignore[misc, valid-type]
        def _popen(self, args: tuple, env: dict[str, str]) -> Any:
            proc = warm.popen(self, args, env)
            return proc if proc is not None else super()._popen(args, env)

        def close(self, death_sig: signal.Signals | None = None) -> None:
            try:
                super().close(death_sig)
            except ProcessLookupError:
                # Forked a moment ago, not yet in a session of its own: the process alone.
                self.proc.send_signal(death_sig or signal.SIGTERM)

    return WarmSubprocessHandler
