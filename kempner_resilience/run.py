"""ResilientRun: the one object a training script needs.

```python
cfg = kempner_resilience.load_config("configs/default.yaml")
with kempner_resilience.ResilientRun(cfg, state={"model": model, "optim": optim}) as run:
    for step in run.steps(total_steps):   # starts after the newest committed checkpoint
        train_step(step)
```

``run.steps()`` is the safe point: each boundary is a heartbeat for the hang watchdog, the place
where periodic checkpoints are written and where all ranks agree to stop. On a shutdown signal
every rank leaves at the same boundary; the run then writes the emergency checkpoint, requeues
(rank 0, only after the commit), tears down and raises ``SystemExit`` with the documented code,
so code after the loop (a "final" save of a model that is not final) never runs by mistake.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import threading
import time
from typing import Any, Callable, Iterator, Mapping, NoReturn

from kempner_resilience import exitcodes
from kempner_resilience.agreement import StopAgreement, StopDecision
from kempner_resilience.config import Action, ResilienceConfig, load_config
from kempner_resilience.exitcodes import ExitCode
from kempner_resilience.log import get_logger
from kempner_resilience.signals import ShutdownHandler, ShutdownRequest
from kempner_resilience.teardown import (
    TeardownStack,
    cuda_synchronize,
    destroy_process_group,
    flush_logs,
)
from kempner_resilience.watchdog import HangWatchdog

__all__ = ["ResilientRun"]

log = get_logger(__name__)

REPORT_ENV = "KEMPNER_RESILIENCE_REPORT"

# Set when a shutdown completed in this process: the interpreter's own finalization (torch's
# module teardown takes 1-2 s) is then skipped. Registered at import, so atexit (LIFO) runs it
# after the handlers registered later, i.e. after the user's and their libraries'.
_completed_shutdown_code: list[int] = []


def _fast_exit() -> None:
    if not _completed_shutdown_code:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    flush_logs()
    os._exit(_completed_shutdown_code[0])


atexit.register(_fast_exit)


class ResilientRun:
    """Signals, deadline, hang watchdog, checkpoints, stop agreement and requeue for one run.

    Args:
        config: a ``ResilienceConfig``, a path to a YAML file, a mapping shaped like one, or
            None for the defaults.
        state: what a checkpoint holds, e.g. ``{"model": m, "optim": o, "sched": s,
            "data": it}``; values need ``state_dict()``/``load_state_dict()``. ``None``:
            no checkpoints (signals, deadline and exit codes still work).
        overrides: ``"section.key=value"`` strings applied on top of a config path.
    """

    def __init__(self, config: ResilienceConfig | str | os.PathLike[str] | Mapping[str, Any]
                 | None = None,
                 state: Mapping[str, Any] | None = None, *, overrides: tuple[str, ...] = ()
                 ) -> None:
        if not isinstance(config, ResilienceConfig):
            config = load_config(config, overrides)
        self.config = config
        self.state = state
        self.step = 0
        self.start_step = 0
        self.resumed_from: Any = None
        self.exit_code: int | None = None
        self.timings: dict[str, float] = {}
        self._handler = ShutdownHandler(config.signals)
        self._hang = HangWatchdog(config.watchdog.hang_timeout_s,
                                  busy_timeout_s=config.watchdog.checkpoint_timeout_s,
                                  on_hang=self._on_hang)
        self._teardown = TeardownStack(config.watchdog.cleanup_timeout_s)
        self._agreement = StopAgreement()
        self._ckpt: Any = None
        self._last_saved: Any = None
        self._slurm: Any = None
        self._entered = False
        self._shutting_down = False
        self._failed = False          # an exception ended the loop: the exit is bounded too
        self._done = False

    # ------------------------------------------------------------------ context

    def __enter__(self) -> "ResilientRun":
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("ResilientRun must be entered on the main thread (Python only "
                               "delivers signals there)")
        self._handler.install()
        try:
            self._agreement = StopAgreement.from_torch()
            self._handler.add_forced_exit_hook(
                lambda code: self._agreement.announce_forced_exit(code))
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
        try:
            if exc_type is not None and not issubclass(exc_type, SystemExit) \
                    and not self._shutting_down:
                self._exit_if_a_peer_was_forced_out(exc)
                self._end_after_error(exc)      # raises SystemExit for a lost peer
                return False
            signum = self._local_signum() or self._agreement.agreed_signum()
            if exc_type is None and signum and not self._shutting_down and not self._done:
                # The loop was left early (a break after should_stop()) on a stop this rank
                # received or agreed to: finish the shutdown here, on every rank alike.
                self._shutdown(StopDecision(self.step, signum, self._local_signum() is not None))
            if not self._shutting_down:
                self._teardown.run()
                if self._ckpt is not None:
                    self._ckpt.close()
                if exc_type is None:
                    self.exit_code = 0
                    self._write_report()
        finally:
            self._hang.stop()
            # Past a completed shutdown the deadline still bounds the interpreter's exit.
            self._handler.uninstall(keep_deadline=(self._shutting_down or self._failed)
                                    and not _caller_survives_system_exit())
        return False

    # ------------------------------------------------------------------ user API

    @property
    def shutdown_request(self) -> ShutdownRequest | None:
        """The first shutdown signal this process received, if any."""
        return self._handler.request

    @property
    def rank(self) -> int:
        return self._agreement.rank

    @property
    def world_size(self) -> int:
        return self._agreement.world_size

    def should_stop(self) -> bool:
        """Poll inside long phases (eval, warm-up): True once any rank asked to stop.

        In a distributed run this is a collective: call it on every rank equally often. After
        it returns True, leave the phase; the next ``steps()`` boundary stops every rank there.
        """
        return self._agreement.any_requested(self._local_signum())

    def steps(self, total: int) -> Iterator[int]:
        """Yield step indices from the resume point up to ``total - 1``.

        Stops at the first boundary all ranks agree on after a shutdown signal, then checkpoints,
        requeues and raises ``SystemExit`` with the exit code (see ``exitcodes``).
        """
        if not self._entered:
            raise RuntimeError("use `with ResilientRun(...) as run:` before run.steps()")
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        step = self.step
        while step < total:
            decision = self._agreement.poll(step, self._local_signum())
            if decision is not None:
                self._shutdown(decision)
            yield step
            step += 1
            self.step = step
            self._hang.beat()
            if self._ckpt is not None:
                self._periodic_save(step)
        self._done = True

    def add_cleanup(self, fn: Callable[[], Any], *, name: str | None = None,
                    timeout_s: float | None = None) -> Callable[[], Any]:
        """Run ``fn`` at shutdown (newest first), at most ``timeout_s`` (config default)."""
        return self._teardown.add(fn, name=name, timeout_s=timeout_s)

    def add_executor(self, executor: Any, *, name: str | None = None,
                     timeout_s: float | None = None) -> Any:
        """Shut ``executor`` down at shutdown with ``cancel_futures=True``."""
        return self._teardown.add_executor(executor, name=name, timeout_s=timeout_s)

    def save(self) -> Any:
        """Write a checkpoint now (collective); returns its info."""
        if self._ckpt is None:
            raise RuntimeError("no checkpoint state: pass state={...} to ResilientRun")
        info = self._ckpt.save(self.step, reason="manual")
        self._last_saved = info
        return info

    # ------------------------------------------------------------------ internals

    def _write_report(self) -> None:
        """Rank 0 writes what happened as JSON to $KEMPNER_RESILIENCE_REPORT (for launchers)."""
        path = os.environ.get(REPORT_ENV)
        if not path or self.rank != 0:
            return
        info = self._last_saved
        report = {"exit_code": self.exit_code, "start_step": self.start_step,
                  "step": self.step, "stop_step": getattr(self, "stop_step", None),
                  "resumed_from": None if self.resumed_from is None else int(
                      self.resumed_from.step),
                  "saved_step": None if info is None else int(info.step),
                  "saved_path": None if info is None else str(info.path),
                  "timings": self.timings, "world_size": self.world_size}
        try:
            tmp = f"{path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(report, f)
            os.replace(tmp, path)
        except OSError as e:
            log.warning("could not write the run report %s: %s", path, e)

    def _committed_step(self) -> int | None:
        info = self._last_saved or self.resumed_from
        return None if info is None else int(info.step)

    def _local_signum(self) -> int | None:
        req = self._handler.request
        return None if req is None else req.signum

    def _setup_slurm(self) -> None:
        from kempner_resilience.slurm import SlurmJob, format_findings, preflight

        self._slurm = SlurmJob.from_env()
        if self._slurm is None or self._slurm.procid != 0:
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

        self._ckpt = CheckpointManager(self.config.checkpoint, self.state,
                                       rank=self._agreement.rank,
                                       world_size=self._agreement.world_size)
        # Saves and loads widen the hang budget, so a slow save is never taken for a hang.
        self._ckpt.busy_hook = self._hang.busy
        self._ckpt.check_dir()
        if self.config.checkpoint.resume:
            t0 = time.monotonic()
            info = self._ckpt.resume()
            if info is not None:
                self.resumed_from = info
                self.step = self.start_step = int(info.step)
                self.timings["resume_s"] = time.monotonic() - t0
                log.info("resumed from %s (step %d) in %.2f s", info.path, info.step,
                         self.timings["resume_s"])

    def _periodic_save(self, step: int) -> None:
        from kempner_resilience.checkpoint import CheckpointError

        try:
            info = self._ckpt.maybe_save(step)
        except CheckpointError as e:
            # Raised on every rank at the same step (failures are agreed across ranks), once
            # checkpoint.max_failed_saves periodic saves in a row failed: stop every rank alike.
            self._stop_checkpoints_failing(step, e)
        if info is not None:
            self._last_saved = info

    def _stop_checkpoints_failing(self, step: int, err: BaseException) -> NoReturn:
        """Too many failed periodic saves: stop with CHECKPOINT_FAILED (no emergency save: it
        would fail the same way). Always raises SystemExit."""
        self._shutting_down = True
        self._hang.stop()
        log.error("stopping at step %d: %s", step, err)
        self._finish(ExitCode.CHECKPOINT_FAILED, step)

    def _on_hang(self) -> None:
        """Runs in the hang watchdog's thread before the HANG exit: requeue if it is worth it.

        Only rank 0, only under SLURM (a local launcher sees the HANG code and decides), only
        with a committed checkpoint to come back to, and only within the restart budget.
        """
        self._requeue_after_failure("hang")

    def _shutdown(self, decision: StopDecision) -> None:
        """Emergency checkpoint, requeue decision, teardown; always raises SystemExit."""
        self._shutting_down = True
        self._hang.stop()  # from here the shutdown deadline governs
        req = self._handler.request
        signum = decision.signum
        name = _signame(signum)
        if req is None:
            # Another rank got the signal: this rank's deadline starts now.
            grace = self.config.signals.grace_for(name)
            self._handler.deadline.arm(time.monotonic() + grace, f"{name} on another rank")
        action = self.config.signals.actions.get(name, Action.STOP)
        log.warning("stopping at step %d (%s, action %s)", decision.step, name, action.value)
        code = self._emergency_checkpoint(decision)
        if code is None:
            code = self._requeue(decision) if action is Action.REQUEUE \
                else exitcodes.for_signal_stop(signum)
        self._finish(code, decision.step)

    def _finish(self, code: int, step: int) -> NoReturn:
        """Teardown, report and the bounded exit with ``code``; always raises SystemExit."""
        code = self._peer_forced_code() or code
        self._run_teardown()
        self.exit_code = int(code)
        self.stop_step = step
        self._write_report()
        log.warning("exiting with %s", exitcodes.describe(int(code)))
        if _caller_survives_system_exit():
            # A notebook kernel or a test runner catches SystemExit and carries on: a deadline
            # left armed, or a forced exit code, would kill or mislabel it later.
            self._handler.deadline.disarm()
        else:
            if not self._handler.deadline.armed:    # a stop no signal started: bound the exit too
                self._handler.deadline.arm(time.monotonic() + self.config.watchdog.exit_timeout_s,
                                           "interpreter exit after a completed shutdown")
            self._handler.deadline.finished(int(code), self.config.watchdog.exit_timeout_s)
            _completed_shutdown_code[:] = [int(code)]
        raise SystemExit(int(code))

    def _peer_forced_code(self) -> int | None:
        """The code another rank was forced out with (a repeated SIGTERM/SIGINT), if any: the
        job ends the way that rank did, so SLURM's record says 143/130 on every rank."""
        forced = self._agreement.forced_exit()
        if forced is None or forced[1] == self.rank:
            return None
        log.error("rank %d was forced out with %s; this rank exits with the same code",
                  forced[1], exitcodes.describe(forced[0]))
        return forced[0]

    def _exit_if_a_peer_was_forced_out(self, exc: BaseException) -> None:
        """An error in the loop caused by a peer that was forced out (its collectives fail here)
        ends with that peer's code and one log line instead of a traceback and exit 1."""
        code = self._peer_forced_code()
        if code is None:
            return
        log.error("the loop ended with %s: %s", type(exc).__name__, str(exc).splitlines()[0]
                  if str(exc) else "")
        self.exit_code = code
        if not _caller_survives_system_exit():
            self._handler.deadline.finished(code, self.config.watchdog.exit_timeout_s)
            _completed_shutdown_code[:] = [code]
        raise SystemExit(code) from None

    def _end_after_error(self, exc: BaseException) -> None:
        """An exception ended the loop. A collective that failed because a peer is gone ends
        with PEER_LOST and one log line (rank 0 requeues under SLURM when a committed checkpoint
        exists); anything else is the user's error and keeps its traceback and exit code 1.
        Either way the exit is bounded: cleanups within the grace, the interpreter's exit
        (executor threads, gloo/NCCL teardown waiting for dead peers) within exit_timeout_s."""
        from kempner_resilience.faults import first_line, is_peer_failure

        peer = is_peer_failure(exc)
        code = ExitCode.PEER_LOST if peer else ExitCode.ERROR
        survives = _caller_survives_system_exit()
        self._failed = True
        self._hang.stop()
        if not survives:
            self._handler.deadline.expect_exit(int(code), self.config.signals.grace_s,
                                               f"exit after {type(exc).__name__}")
        if peer:
            log.error("a peer rank is gone (%s); leaving at step %d", first_line(exc), self.step)
            self._requeue_after_failure("peer lost")
        results = self._teardown.run(deadline=self._handler.deadline.deadline)
        builtin = TeardownStack(self.config.watchdog.cleanup_timeout_s)
        builtin.add(flush_logs, name="flush logs")
        if not peer:     # with a peer gone, gloo/NCCL teardown would wait for it
            builtin.add(destroy_process_group, name="destroy process group")
        builtin.add(cuda_synchronize, name="cuda synchronize")
        if self._ckpt is not None:
            builtin.add(self._ckpt.close, name="drain checkpoint saves")
        self.cleanup_results = results + builtin.run(deadline=self._handler.deadline.deadline)
        self.exit_code = int(code)
        self._write_report()
        if survives:
            return           # a notebook or test runner gets the exception itself
        self._handler.deadline.finished(int(code), self.config.watchdog.exit_timeout_s)
        if peer:
            log.error("exiting with %s", exitcodes.describe(int(code)))
            _completed_shutdown_code[:] = [int(code)]
            raise SystemExit(int(code)) from None

    def _requeue_after_failure(self, why: str) -> None:
        """Rank 0, under SLURM, with a committed checkpoint to come back to, within the restart
        budget: requeue now, since nobody else will (a local launcher sees the exit code)."""
        if self._slurm is None or self.rank != 0 or self._committed_step() is None:
            return
        try:
            code = self._requeue_decision()
        except Exception as e:      # never let the requeue attempt stop the exit
            log.error("%s: requeue failed: %s", why, e)
            return
        log.warning("%s: %s", why, "job requeued" if code == ExitCode.REQUEUE
                    else exitcodes.describe(int(code)))

    def _emergency_checkpoint(self, decision: StopDecision) -> ExitCode | None:
        if self._ckpt is None:
            return None
        from kempner_resilience.checkpoint import CheckpointError

        t0 = time.monotonic()
        try:
            info = self._ckpt.emergency_save(decision.step, deadline=self._handler.deadline.deadline)
        except (CheckpointError, OSError) as e:
            # Expected (full disk, quota, I/O error): the message names the cause and the fix.
            log.error("emergency checkpoint at step %d failed: %s", decision.step, e)
            return ExitCode.CHECKPOINT_FAILED
        except Exception:
            log.exception("emergency checkpoint at step %d failed; the previous committed "
                          "checkpoint is intact", decision.step)
            return ExitCode.CHECKPOINT_FAILED
        self.timings["emergency_save_s"] = time.monotonic() - t0
        if info is None:
            return ExitCode.CHECKPOINT_FAILED
        self._last_saved = info
        log.info("emergency checkpoint for step %d committed in %.2f s: %s", decision.step,
                 self.timings["emergency_save_s"], getattr(info, "path", info))
        return None

    def _requeue(self, decision: StopDecision) -> int:
        """Rank 0 applies the restart budget and requeues; every rank returns the same code."""
        code: int | None = None
        if self.rank == 0:
            code = int(self._requeue_decision())
        left = self._handler.deadline.remaining()
        try:
            return self._agreement.share_exit_code(code, left if left is not None else 60.0)
        except Exception:  # rank 0 is gone or the store timed out: the checkpoint is safe
            log.exception("did not learn rank 0's requeue outcome; exiting with REQUEUE_FAILED")
            return int(ExitCode.REQUEUE_FAILED)

    def _requeue_decision(self) -> ExitCode:
        from kempner_resilience.slurm import decide_requeue, requeue_job
        from kempner_resilience.slurm.requeue import RestartLedger

        ledger = None
        if self._ckpt is not None:
            ledger = RestartLedger.for_checkpoint_dir(self.config.checkpoint.dir)
        who = self._slurm if self._slurm is not None else _local_restart_count()
        verdict = decide_requeue(who, ledger, self._committed_step(), self.config.requeue)
        if not verdict.requeue:
            return verdict.exit_code
        if self._slurm is None:
            return ExitCode.REQUEUE  # "run me again": the local launcher relaunches
        t0 = time.monotonic()
        result = requeue_job(self._slurm, self.config.requeue)
        self.timings["requeue_s"] = time.monotonic() - t0
        return result.exit_code

    def _run_teardown(self) -> None:
        deadline = self._handler.deadline.deadline
        t0 = time.monotonic()
        results = self._teardown.run(deadline=deadline)  # the user's cleanups, newest first
        builtin = TeardownStack(self.config.watchdog.cleanup_timeout_s)
        builtin.add(flush_logs, name="flush logs")
        builtin.add(destroy_process_group, name="destroy process group")
        builtin.add(cuda_synchronize, name="cuda synchronize")
        if self._ckpt is not None:
            builtin.add(self._ckpt.close, name="drain checkpoint saves")
        results += builtin.run(deadline=deadline)
        self.cleanup_results = results
        self.timings["teardown_s"] = time.monotonic() - t0


def _local_restart_count() -> int | None:
    """Restarts so far when a local launcher (the demo's) relaunches us; None if unknown."""
    value = os.environ.get("KEMPNER_RESTART_COUNT")
    return int(value) if value and value.isdigit() else None


def _caller_survives_system_exit() -> bool:
    """Notebook kernels, interactive shells and test runners outlive a SystemExit."""
    return ("ipykernel" in sys.modules or bool(sys.flags.interactive)
            or "pytest" in sys.modules or "unittest" in sys.argv[0])


def _signame(signum: int) -> str:
    import signal

    return signal.Signals(signum).name
