"""Warm workers for the torchrun agents: each worker forked from the agent's zygote.

A relaunched worker pays Python's start-up, ``import torch``, DCP and the first optimizer
again: most of the time from a node's death to the next step. With
``$KEMPNER_RESILIENCE_WARM=1`` (the torchrun template sets it) each agent starts one zygote
(``local/warm.py``) and every worker is a fresh fork of it: while a group starts
(``agent.starting``), torch's process context builds our ``SubprocessHandler``, whose
``_popen`` asks the zygote. A command the zygote cannot run, or a zygote that is gone, starts
the worker cold.
"""

from __future__ import annotations

import importlib
import os
import signal
from typing import Any

from kempner_resilience.core import torch_private
from kempner_resilience.core.log import get_logger
from kempner_resilience.supervise.torchrun.agent import AGENT_NAME, Agent
from kempner_resilience.supervise.local.warm import (STEP_SIGNALS, UNBUFFERED, WarmProcess,
                                                      Zygote, warm_command)
from kempner_resilience.stop.signals import PARENT_DEATH_ENV, PARENT_DEATH_SIGNAL

__all__ = ["WarmWorkers"]

log = get_logger("kempner_resilience.supervise.torchrun.wrapper")


class WarmWorkers:
    """One agent's zygote and the starting of its workers from it (``for_spec``)."""

    def __init__(self, tracked: Agent, zygote: Zygote) -> None:
        self.tracked = tracked
        self.zygote = zygote
        self.cold_why: str | None = None     # set once the workers start cold for good
        self.handler = _warm_handler(self)   # what get_subprocess_handler builds meanwhile

    @classmethod
    def for_spec(cls, spec: Any, tracked: Agent) -> "WarmWorkers | None":
        """The agent's warm workers for torch's ``WorkerSpec``, zygote started; None when the
        command cannot start warm (``warm_command``) or this torch lacks the names. Call it on
        the agent's main thread: the zygote dies when the thread that started it ends."""
        if not isinstance(spec.entrypoint, str) \
                or not warm_command([spec.entrypoint, *map(str, spec.args)], (UNBUFFERED,)) \
                or torch_private.elastic("warm") is None:
            return None
        handled = {*STEP_SIGNALS, *tracked.config.signals.handled()}
        ignore = sorted(int(getattr(signal, n)) for n in handled if hasattr(signal, n))
        zygote = Zygote(dict(os.environ), ignore=ignore, death_signal=signal.SIGKILL)
        log.info("%s: workers start warm, forked from pid %d (%s=1)", AGENT_NAME,
                 zygote.proc.pid, "KEMPNER_RESILIENCE_WARM")
        return cls(tracked, zygote)

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

    def close(self) -> None:
        """End the zygote once the agent's workers are gone (bounded)."""
        self.zygote.close()


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
