"""ResilientRun: the one object a training script needs.

```python
cfg = kempner_resilience.load_config("configs/default.yaml")
with kempner_resilience.ResilientRun(cfg, state={"model": model, "optim": optim}) as run:
    for step in run.steps(total_steps):   # starts after the newest committed checkpoint
        train_step(step)
```

``run.steps()`` is the safe point: each boundary is a heartbeat for the hang watchdog, the place
where periodic checkpoints are written and where all ranks agree to stop. This module sets the
run up (signals, agreement, SLURM checks, checkpoints and resume) and serves the user API; how a
run ends (emergency checkpoint, requeue, teardown, the exit code and leaving) is
``kempner_resilience.shutdown``. After a shutdown, ``SystemExit`` carries the documented code,
so code after the loop (a "final" save of a model that is not final) never runs by mistake.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Iterator, Mapping

from kempner_resilience.agreement import StopAgreement, StopDecision
from kempner_resilience.config import ExitMode, ResilienceConfig, load_config
from kempner_resilience.log import get_logger
from kempner_resilience.shutdown import exit as leaving
from kempner_resilience.shutdown import sequence
from kempner_resilience.shutdown.report import REPORT_ENV
from kempner_resilience.signals import ShutdownHandler, ShutdownRequest
from kempner_resilience.teardown import TeardownStack
from kempner_resilience.watchdog import HangWatchdog

__all__ = ["ResilientRun", "REPORT_ENV"]

log = get_logger(__name__)


class ResilientRun:
    """Signals, deadline, hang watchdog, checkpoints, stop agreement and requeue for one run.

    Args:
        config: a ``ResilienceConfig``, a path to a YAML file, a mapping shaped like one, or
            None for the defaults.
        state: what a checkpoint holds, e.g. ``{"model": m, "optim": o, "sched": s,
            "data": it}``; values need ``state_dict()``/``load_state_dict()``. ``None``:
            no checkpoints (signals, deadline and exit codes still work).
        overrides: ``"section.key=value"`` strings applied on top of a config path.
        exit_mode: overrides ``watchdog.exit_mode``: ``"exit"`` when the process ends with the
            run, ``"raise"`` when the caller lives on after the ``SystemExit`` (a notebook, a
            test), ``"auto"`` to decide (see ``kempner_resilience.shutdown.exit``).
    """

    def __init__(self, config: ResilienceConfig | str | os.PathLike[str] | Mapping[str, Any]
                 | None = None,
                 state: Mapping[str, Any] | None = None, *, overrides: tuple[str, ...] = (),
                 exit_mode: ExitMode | str | None = None) -> None:
        if not isinstance(config, ResilienceConfig):
            config = load_config(config, overrides)
        self.config = config
        self.state = state
        mode = ExitMode(str(exit_mode).lower()) if exit_mode is not None \
            else config.watchdog.exit_mode
        self._handler = ShutdownHandler(config.signals)
        self._hang = HangWatchdog(config.watchdog.hang_timeout_s,
                                  busy_timeout_s=config.watchdog.checkpoint_timeout_s,
                                  on_hang=self._on_hang)
        self._parts = sequence.RunParts(config, self._handler, self._hang,
                                        TeardownStack(config.watchdog.cleanup_timeout_s),
                                        leaving.resolve(mode))
        self._entered = False
        self._done = False

    # ------------------------------------------------------------------ context

    def __enter__(self) -> "ResilientRun":
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("ResilientRun must be entered on the main thread (Python only "
                               "delivers signals there)")
        self._handler.install()
        try:
            self._parts.agreement = StopAgreement.from_torch()
            self._handler.add_forced_exit_hook(
                lambda code: self._parts.agreement.announce_forced_exit(code))
            self._setup_slurm()
            self._hang.start()  # before resuming: a load that hangs is a hang too
            with self._hang.busy():  # imports, directory checks and the load may be slow
                self._setup_checkpoints()
        except BaseException:
            self._hang.stop()
            self._handler.uninstall(keep_deadline=self._handler.requested())
            raise
        self._entered = True
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        ended = self._parts.outcome is not None     # a shutdown already ran (SystemExit)
        try:
            if ended:
                return False
            if exc_type is not None and not issubclass(exc_type, SystemExit):
                sequence.fail(self._parts, exc)     # leaves, or returns to re-raise a bug
                return False
            signum = self._local_signum() or self._parts.agreement.agreed_signum()
            if exc_type is None and signum and not self._done:
                # The loop was left early (a break after should_stop()) on a stop this rank
                # received or agreed to: finish the shutdown here, on every rank alike.
                sequence.stop(self._parts, StopDecision(self.step, signum,
                                                        self._local_signum() is not None))
            if exc_type is None:
                sequence.complete(self._parts, self.step)
        finally:
            self._hang.stop()
            # Past an ending in `exit` mode the deadline still bounds the interpreter's exit.
            self._handler.uninstall(keep_deadline=self._parts.outcome is not None
                                    and self._parts.exit_mode is ExitMode.EXIT)
        return False

    # ------------------------------------------------------------------ user API

    @property
    def shutdown_request(self) -> ShutdownRequest | None:
        """The first shutdown signal this process received, if any."""
        return self._handler.request

    @property
    def rank(self) -> int:
        return self._parts.agreement.rank

    @property
    def world_size(self) -> int:
        return self._parts.agreement.world_size

    @property
    def step(self) -> int:
        """Completed steps: the index of the next step to run."""
        return self._parts.step

    @property
    def start_step(self) -> int:
        """The step this run started at (the resumed checkpoint's step, or 0)."""
        return self._parts.start_step

    @property
    def resumed_from(self) -> Any:
        """The ``CheckpointInfo`` this run resumed from, or None for a fresh start."""
        return self._parts.resumed_from

    @property
    def exit_mode(self) -> ExitMode:
        """How this run leaves when it ends: ``exit`` or ``raise`` (``auto`` resolved)."""
        return self._parts.exit_mode

    @property
    def exit_code(self) -> int | None:
        """The code the run ended with (set when it ended; 0 after all steps ran)."""
        from kempner_resilience.shutdown.outcome import exit_code

        o = self._parts.outcome
        return None if o is None else int(exit_code(o))

    @property
    def timings(self) -> dict[str, float]:
        """Seconds spent resuming, in the emergency save, the requeue and the teardown."""
        return self._parts.timings

    @property
    def cleanup_results(self) -> list[Any]:
        return self._parts.cleanup_results

    def should_stop(self) -> bool:
        """Poll inside long phases (eval, warm-up): True once any rank asked to stop.

        In a distributed run this is a collective: call it on every rank equally often. After
        it returns True, leave the phase; the next ``steps()`` boundary stops every rank there.
        """
        return self._parts.agreement.any_requested(self._local_signum())

    def steps(self, total: int) -> Iterator[int]:
        """Yield step indices from the resume point up to ``total - 1``.

        Stops at the first boundary all ranks agree on after a shutdown signal, then checkpoints,
        requeues and raises ``SystemExit`` with the exit code (see ``exitcodes``).
        """
        if not self._entered:
            raise RuntimeError("use `with ResilientRun(...) as run:` before run.steps()")
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        parts = self._parts
        while parts.step < total:
            decision = parts.agreement.poll(parts.step, self._local_signum())
            if decision is not None:
                sequence.stop(parts, decision)
            yield parts.step
            parts.step += 1
            self._hang.beat()
            if parts.ckpt is not None:
                self._periodic_save(parts.step)
        self._done = True

    def add_cleanup(self, fn: Callable[[], Any], *, name: str | None = None,
                    timeout_s: float | None = None) -> Callable[[], Any]:
        """Run ``fn`` at shutdown (newest first), at most ``timeout_s`` (config default)."""
        return self._parts.teardown.add(fn, name=name, timeout_s=timeout_s)

    def add_executor(self, executor: Any, *, name: str | None = None,
                     timeout_s: float | None = None) -> Any:
        """Shut ``executor`` down at shutdown with ``cancel_futures=True``."""
        return self._parts.teardown.add_executor(executor, name=name, timeout_s=timeout_s)

    def save(self) -> Any:
        """Write a checkpoint now (collective); returns its info."""
        if self._parts.ckpt is None:
            raise RuntimeError("no checkpoint state: pass state={...} to ResilientRun")
        info = self._parts.ckpt.save(self.step, reason="manual")
        self._parts.last_saved = info
        return info

    # ------------------------------------------------------------------ set-up and the loop

    def _local_signum(self) -> int | None:
        req = self._handler.request
        return None if req is None else req.signum

    def _setup_slurm(self) -> None:
        from kempner_resilience.slurm import SlurmJob, format_findings, preflight

        self._parts.slurm = job = SlurmJob.from_env()
        if job is None or job.procid != 0:
            return
        # Said once, by rank 0: a job whose signal never reaches the ranks loses its last hours.
        try:
            findings = [f for f in preflight(self.config) if f.level in ("warn", "error")]
        except Exception:
            log.exception("preflight checks failed to run")
            return
        if findings:
            log.warning("preflight found problems (run `kempner-resilience doctor` inside the "
                        "job for details):\n%s", format_findings(findings))

    def _setup_checkpoints(self) -> None:
        if self.state is None:
            return
        from kempner_resilience.checkpoint import CheckpointManager

        parts = self._parts
        parts.ckpt = ckpt = CheckpointManager(self.config.checkpoint, self.state,
                                              rank=parts.agreement.rank,
                                              world_size=parts.agreement.world_size)
        # Saves and loads widen the hang budget, so a slow save is never taken for a hang.
        ckpt.busy_hook = self._hang.busy
        ckpt.check_dir()
        if self.config.checkpoint.resume:
            t0 = time.monotonic()
            info = ckpt.resume()
            if info is not None:
                parts.resumed_from = info
                parts.step = parts.start_step = int(info.step)
                parts.timings["resume_s"] = time.monotonic() - t0
                log.info("resumed from %s (step %d) in %.2f s", info.path, info.step,
                         parts.timings["resume_s"])

    def _periodic_save(self, step: int) -> None:
        from kempner_resilience.checkpoint import CheckpointError

        try:
            info = self._parts.ckpt.maybe_save(step)
        except CheckpointError as e:
            # Raised on every rank at the same step (failures are agreed across ranks), once
            # checkpoint.max_failed_saves periodic saves in a row failed: stop every rank alike.
            sequence.give_up(self._parts, step, e)
        if info is not None:
            self._parts.last_saved = info

    def _on_hang(self) -> None:
        """Runs in the hang watchdog's thread before the HANG exit: requeue if it is worth it.

        Only rank 0, only under SLURM (a local launcher sees the HANG code and decides), only
        with a committed checkpoint to come back to, and only within the restart budget.
        """
        sequence.requeue_after_failure(self._parts, "hang")
