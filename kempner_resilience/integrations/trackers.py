"""Experiment trackers told how each attempt ends, so a requeued run stays one run in them.

W&B, with ``integrations.wandb: true`` and a W&B run the script started inside the run with
``wandb.init(id=run.run_id, resume="allow")`` (the same id in every attempt):

* before a requeue (``scontrol requeue``, or a REQUEUE exit for a local launcher), on the rank
  that holds the W&B run: ``wandb.run.mark_preempting()``, so W&B takes the attempt's non-zero
  end for a preemption, not a failure;
* when the attempt ends, whichever way the shutdown sequence ends it: ``finish(exit_code=code)``
  with the run's exit code, bounded like a cleanup (``watchdog.cleanup_timeout_s``). 0 (all
  steps done) finishes the W&B run; 75 (REQUEUE) after ``mark_preempting`` leaves it preempted,
  to be resumed by the next attempt's ``wandb.init``; any other code marks it failed.

Without this, an attempt that leaves through the shutdown deadline's ``os._exit`` (or a fast
exit that skips W&B's own exit hook) never tells W&B how it ended, and the dashboard shows the
run "crashed". wandb is imported when the run starts, only when the integration is on: never
on the shutdown path, never for a run that does not ask for it. A tracker's failure is logged,
never raised into the shutdown.
"""

from __future__ import annotations

from typing import Any

from kempner_resilience.config import IntegrationsConfig
from kempner_resilience.core.log import get_logger

__all__ = ["Trackers", "WANDB_MISSING"]

log = get_logger(__name__)

WANDB_MISSING = ("integrations.wandb is true but wandb is not installed: pip install "
                 "'kempner_resilience[wandb]' (or pip install wandb); the W&B run is not told "
                 "how attempts end")


class Trackers:
    """The trackers this run tells about its end; with none enabled every call does nothing."""

    def __init__(self, wandb: Any = None) -> None:
        self._wandb = wandb               # the wandb module, when integrations.wandb is on
        self._preempting: Any = None      # the W&B run already marked preempting

    @classmethod
    def from_config(cls, config: IntegrationsConfig) -> "Trackers":
        """Import what the enabled integrations need (at start-up, not at the shutdown)."""
        if not config.wandb:
            return cls()
        try:
            import wandb
        except ImportError:
            log.warning(WANDB_MISSING)
            return cls()
        return cls(wandb)

    @property
    def active(self) -> bool:
        """An integration is enabled (and could be loaded)."""
        return self._wandb is not None

    def _wandb_run(self) -> Any:
        return None if self._wandb is None else getattr(self._wandb, "run", None)

    def preempting(self) -> None:
        """The job is about to be requeued: tell the active W&B run (once)."""
        run = self._wandb_run()
        if run is None or run is self._preempting:
            return
        try:
            run.mark_preempting()
        except Exception as e:
            log.warning("W&B: mark_preempting() failed: %s", e)
            return
        self._preempting = run
        log.info("W&B run %s marked preempting before the requeue", getattr(run, "id", "?"))

    def finish(self, code: int) -> None:
        """The attempt ends with exit ``code``: finish the active W&B run with it."""
        run = self._wandb_run()
        if run is None:
            return
        try:
            run.finish(exit_code=int(code))
        except Exception as e:
            log.warning("W&B: finish(exit_code=%d) failed: %s", code, e)
            return
        state = ("finished" if code == 0 else
                 "preempted, to be resumed" if run is self._preempting else "failed")
        log.info("W&B run %s finished with exit code %d (%s)", getattr(run, "id", "?"), code,
                 state)
