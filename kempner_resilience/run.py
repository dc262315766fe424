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
import signal
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

from kempner_resilience.agreement import StopAgreement, StopDecision
from kempner_resilience.config import Action, ExitMode, ResilienceConfig, load_config
from kempner_resilience.exitcodes import Ending, Facts
from kempner_resilience.identity import RUN_ID_ENV
from kempner_resilience.ledger import LEDGER_NAME, Ledger, attempt_start
from kempner_resilience.log import announce, get_logger
from kempner_resilience.runstate import RunState
from kempner_resilience.shutdown import exit as leaving
from kempner_resilience.shutdown import outcome, sequence
from kempner_resilience.shutdown.report import REPORT_ENV
from kempner_resilience.shutdown.trackers import Trackers
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
        run_id: this run's id (default: ``$KEMPNER_RESILIENCE_RUN_ID``, else the one in
            ``checkpoint.dir/run.json``, else a new one); see ``kempner_resilience.identity``.
    """

    def __init__(self, config: ResilienceConfig | str | os.PathLike[str] | Mapping[str, Any]
                 | None = None,
                 state: Mapping[str, Any] | None = None, *, overrides: tuple[str, ...] = (),
                 exit_mode: ExitMode | str | None = None, run_id: str | None = None) -> None:
        if not isinstance(config, ResilienceConfig):
            config = load_config(config, overrides)
        else:  # built or changed in Python: held to the file's rules (NaN, ranges) -> 78
            config.validate()
        self.config = config
        self.state = state
        mode = ExitMode(str(exit_mode).lower()) if exit_mode is not None \
            else config.watchdog.exit_mode
        self._handler = ShutdownHandler(config.signals)
        self._hang = HangWatchdog(config.watchdog.hang_timeout_s,
                                  busy_timeout_s=config.watchdog.checkpoint_timeout_s,
                                  on_hang=self._on_hang, on_decide=self._on_hang_decided)
        self._parts = RunState(config, self._handler, self._hang,
                                 TeardownStack(config.watchdog.cleanup_timeout_s),
                                 leaving.resolve(mode))
        self._explicit_run_id = run_id or os.environ.get(RUN_ID_ENV) or None
        self._entered = False
        self._done = False
        self._looped = False
        self._recorded: Any = None        # the newest commit the ledger has recorded

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
            self._handler.add_forced_exit_hook(self._on_forced_exit)
            self._setup_slurm()
            self._setup_clock()
            # Imported now, never on the shutdown path: a tracker told how the attempt ends.
            self._parts.trackers = Trackers.from_config(self.config.integrations)
            self._hang.start()  # before resuming: a load that hangs is a hang too
            with self._hang.busy():  # imports, directory checks and the load may be slow
                self._setup_checkpoints()
                self._preflight()
            if self._parts.run_id is None:     # no checkpoints: an id for this attempt only
                from kempner_resilience.identity import new_run_id

                mine = (self._explicit_run_id or new_run_id()) if self.rank == 0 else None
                self._parts.run_id = self._parts.agreement.share_text("run_id", mine, 120.0)
            self._hang.last_words(outcome.hang_words(self._parts))
        except BaseException:
            self._hang.stop()
            self._handler.uninstall(keep_deadline=self._handler.requested())
            raise
        self._entered = True
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        # The hang path decided to end the process (a stall that ended, then the loop ended or
        # failed): it alone leaves, with HANG; this thread waits for that exit here.
        self._hang.hold()
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
    def run_id(self) -> str | None:
        """This run's id, the same in every attempt (requeue) of it: pass it to a tracker
        (``wandb.init(id=run.run_id, resume="allow")``; with ``integrations.wandb`` the run
        also tells W&B how each attempt ends, see docs/trackers.md). Set once the run is
        entered."""
        return self._parts.run_id

    def time_remaining(self) -> float | None:
        """Seconds until the allocation ends; None when no end is known (outside SLURM)."""
        return self._parts.clock.remaining()

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
        o = self._parts.outcome
        return None if o is None else int(outcome.exit_code(o))

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
        return self._parts.agreement.any_requested(self._stop_signum(time.monotonic()))

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
        clock = parts.clock
        # Step times only matter for the stop before a known end: outside SLURM, measure nothing.
        timed = clock.end_epoch is not None and clock.stop_enabled
        if not self._looped:
            self._looped = True
            parts.ledger.event("loop", step=parts.step)
        rescue = parts.rescue
        if rescue is not None:
            rescue.mark(parts.step)
        while parts.step < total:
            now = time.monotonic()
            signum = self._local_signum()
            if signum is None and now >= clock.threshold and clock.due(now):
                signum = self._clock_signum       # as if the requeue signal had come
            decision = parts.agreement.poll(parts.step, signum)
            if decision is not None:
                sequence.stop(parts, decision)
            yield parts.step
            if timed:
                clock.observe_step(time.monotonic() - now)
            parts.step += 1
            self._hang.beat()
            if rescue is not None:
                rescue.mark(parts.step)      # before the save: a peer may die during it
            if parts.ckpt is not None:
                self._periodic_save(parts.step)
        parts.loop_end_wall = time.time()
        self._done = True
        if rescue is not None:
            rescue.close()

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
        self._hang.hold()      # nothing is saved once the hang path decided to exit
        t0 = time.monotonic()
        info = self._parts.ckpt.save(self.step, reason="manual")
        self._parts.saved(info)
        self._saved(info, time.monotonic() - t0)
        return info

    # ------------------------------------------------------------------ set-up and the loop

    def _local_signum(self) -> int | None:
        req = self._handler.request
        return None if req is None else req.signum

    def _stop_signum(self, now: float) -> int | None:
        """This rank's reason to stop: a signal it received, or the allocation's end."""
        signum = self._local_signum()
        if signum is None and self._parts.clock.due(now):
            return self._clock_signum
        return signum

    @property
    def _clock_signum(self) -> int:
        # The signal whose action the time-limit stop takes: the first one that requeues.
        for name, action in self.config.signals.actions.items():
            if action is Action.REQUEUE:
                return int(getattr(signal, name))
        return int(signal.SIGUSR1)

    def _setup_clock(self) -> None:
        """The allocation's end, read once: from the environment on every rank, else asked of
        SLURM by rank 0 alone (bounded) and shared, so a big job does not flood slurmctld."""
        from kempner_resilience.slurm.clock import END_TIME_ENV, RunClock, job_end_time

        parts, cfg = self._parts, self.config.requeue
        if os.environ.get(END_TIME_ENV):
            end = job_end_time(timeout=cfg.scontrol_timeout_s)
        elif parts.slurm is None:
            end = None
        else:
            mine = None
            if parts.rank == 0:
                mine = job_end_time(timeout=cfg.scontrol_timeout_s)
            text = parts.agreement.share_text("end_time", "" if mine is None else repr(mine),
                                              cfg.scontrol_timeout_s + 30.0)
            end = float(text) if text else None
        parts.clock = RunClock(end, margin_s=cfg.time_limit_margin_s,
                               stop_enabled=cfg.time_limit_stop)
        if end is not None and parts.rank == 0:
            log.info("the allocation ends in %.0f s%s", parts.clock.remaining(),
                     "" if cfg.time_limit_stop else " (requeue.time_limit_stop is off)")

    def _setup_slurm(self) -> None:
        from kempner_resilience.slurm import SlurmJob

        self._parts.slurm = SlurmJob.from_env()

    def _preflight(self) -> None:
        """Rank 0 says once what stands between this job and a safe shutdown: a signal that
        never reaches the ranks, or an emergency save that cannot fit in the signal's lead
        (checked once the state and the last save are known: after the resume)."""
        from kempner_resilience.slurm import SaveFacts, format_findings, preflight

        job, ckpt = self._parts.slurm, self._parts.ckpt
        if job is None or job.procid != 0:
            return
        save = None
        try:
            if ckpt is not None:
                est, last = ckpt.estimate(), ckpt.last_committed
                save = SaveFacts(est.seconds, est.measured, ckpt.state.nbytes(),
                                 None if last is None else int(last.nbytes),
                                 None if last is None else float(last.save_seconds))
            findings = preflight(self.config, save=save,
                                 timeout=self.config.requeue.scontrol_timeout_s)
        except Exception:
            log.exception("preflight checks failed to run")
            return
        problems = [f for f in findings if f.level in ("warn", "error")]
        if problems:
            log.warning("preflight found problems (run `kempner-resilience doctor` inside the "
                        "job for details):\n%s", format_findings(problems))
        for f in findings:
            if f.code in ("save-fits", "time-limit-stop-covers"):
                log.info("%s", f.message)

    def _setup_checkpoints(self) -> None:
        if self.state is None:
            return
        from kempner_resilience.checkpoint import CheckpointError, CheckpointManager

        # Kept for the per-step save check: no import statement on every step.
        self._checkpoint_error = CheckpointError
        parts = self._parts
        # A save waits for the other ranks no longer than any step does (hang_timeout_s) plus
        # what the save itself takes; the hang budget's widening to checkpoint_timeout_s during
        # a save is for this rank's own write, not for waiting on a rank that is gone or paused.
        hang_s = self.config.watchdog.hang_timeout_s
        parts.ckpt = ckpt = CheckpointManager(self.config.checkpoint, self.state,
                                              rank=parts.agreement.rank,
                                              world_size=parts.agreement.world_size,
                                              peer_timeout_s=hang_s if hang_s > 0 else None)
        # Saves and loads widen the hang budget, so a slow save is never taken for a hang.
        ckpt.busy_hook = self._hang.busy
        ckpt.check_dir()
        parts.run_id = ckpt.run_id = self._resolve_run_id(ckpt.root)
        job = parts.slurm
        restarts = job.restart_count if job is not None else _local_restart_count()
        self._hold_directory(ckpt.root, restarts)
        self._mark_forced_exits_in(ckpt.root)
        ckpt.manifest_extra = {"job_id": None if job is None else job.requeue_id,
                               "restart_count": restarts}
        if self.config.checkpoint.ledger:
            # Rank 0 writes the ledger; another rank only a rescue it wrote (rank 0 may be the
            # rank that died, and then no one else would record the step the rescue kept).
            parts.ledger = Ledger(ckpt.root / LEDGER_NAME, run_id=parts.run_id,
                                  attempt=restarts or 0,
                                  only=None if parts.rank == 0 else ("rescue",))
        parts.ledger.event("start", t0=_attempt_start(), job_id=ckpt.manifest_extra["job_id"],
                           restart_count=restarts, world_size=parts.agreement.world_size,
                           hosts=(job.nodelist if job is not None and job.nodelist
                                  else socket.gethostname()))
        info = None
        if self.config.checkpoint.resume:
            t0 = time.monotonic()
            info = ckpt.resume()
            if info is not None:
                parts.resumed_from = info
                parts.step = parts.start_step = int(info.step)
                parts.timings["resume_s"] = time.monotonic() - t0
                parts.ledger.event("resume", step=int(info.step),
                                   load_s=round(parts.timings["resume_s"], 4))
        self._announce_start(info)
        parts.clock.set_save_estimate(ckpt.estimate().seconds)
        self._recorded = ckpt.last_committed      # the ledger records only newer commits
        self._setup_rescue()

    def _announce_start(self, info: Any) -> None:
        """One line per run on rank 0, visible at Python's default log level: where it resumed
        from, or that it starts fresh and why."""
        if self._parts.rank != 0:
            return
        ckpt = self._parts.ckpt
        if info is not None:
            announce(log, "resumed from %s (step %d, reason %s) in %.2f s", info.path, info.step,
                     info.reason, self._parts.timings.get("resume_s", 0.0))
        elif not self.config.checkpoint.resume:
            announce(log, "starting fresh at step 0: checkpoint.resume is off (%s)", ckpt.root)
        else:
            announce(log, "starting fresh at step 0: no committed checkpoint in %s", ckpt.root)

    def _setup_rescue(self) -> None:
        """The just-in-time rescue (``kempner_resilience.rescue``), when every rank holds the
        full state; collective."""
        parts, cfg = self._parts, self.config.rescue
        if not cfg.enabled or parts.agreement.world_size < 2:
            return
        from kempner_resilience.rescue import Rescuer

        parts.rescue = Rescuer.start(cfg, parts.ckpt, rank=parts.rank,
                                     world_size=parts.agreement.world_size)
        if parts.rescue is not None:
            # The hang watchdog runs the rescue before it exits: give it the time.
            self._hang.on_hang_budget_s += cfg.budget_s

    def _hold_directory(self, root: Any, restarts: int | None) -> None:
        """Rank 0 takes the directory's lease (one live run per ``checkpoint.dir``) before
        anything is written into it; every rank gets the same refusal when another live run
        holds it. Given up at teardown; one left by a killed run is taken over."""
        from kempner_resilience.checkpoint import lease

        parts = self._parts
        text = "ok"
        if parts.rank == 0:
            job = parts.slurm
            try:
                held = lease.acquire(root, job_id=None if job is None else job.requeue_id,
                                     restart_count=restarts, run_id=parts.run_id)
                parts.ckpt.lease = held        # given up once its last save is drained
            except lease.DirectoryInUseError as e:
                text = "refused:" + str(e)
            except OSError as e:
                log.warning("cannot hold %s with a lease (%s): a second run on this directory "
                            "would not be noticed", root, e)
        text = parts.agreement.share_text("lease", text,
                                          lease.STALE_S + 4 * lease.HEARTBEAT_S + 60.0)
        kind, _, why = text.partition(":")
        if kind == "refused":
            raise lease.DirectoryInUseError(why)

    def _mark_forced_exits_in(self, root: Any) -> None:
        """A rank forced out (a repeated SIGTERM/SIGINT) also leaves a marker in ``root``: the
        store, which normally carries the news, dies with rank 0 when rank 0 is that rank.
        Rank 0, holding the lease, clears the markers of earlier attempts, then hands every rank
        this attempt's token (collective)."""
        parts = self._parts
        if parts.agreement.store is None:
            return
        from kempner_resilience.agreement import FORCED_MARKER_PREFIX

        token = None
        if parts.rank == 0:
            token = uuid.uuid4().hex[:12]
            try:
                for old in Path(root).glob(FORCED_MARKER_PREFIX + "*"):
                    old.unlink(missing_ok=True)
            except OSError as e:     # a stale marker has another token: it is never read
                log.debug("cannot clear old forced-exit markers in %s: %s", root, e)
        token = parts.agreement.share_text("attempt_token", token, 120.0)
        parts.agreement.use_forced_marker(Path(root), token)

    def _resolve_run_id(self, root: Any) -> str:
        """Rank 0 reads or creates ``run.json`` and checks the checkpoints belong to this run;
        every rank gets the id, or the same refusal."""
        from kempner_resilience import identity
        from kempner_resilience.checkpoint import layout

        parts, cfg = self._parts, self.config.checkpoint
        text = None
        if parts.rank == 0:
            try:
                # repair: a damaged run.json is rewritten from the checkpoints' run id, so
                # it neither blocks the restart nor gives this attempt an unrecorded id.
                rid = self._explicit_run_id
                recorded = identity.repair(root, rid)
                if rid is None:
                    rid, _ = identity.load_or_create(root)
                elif recorded is None:
                    rid, _ = identity.load_or_create(root, rid)
                if cfg.resume:
                    try:
                        identity.check_same_run(root, rid, layout.scan(root), recorded)
                    except identity.OtherRunError as e:
                        if not cfg.allow_other_run:
                            raise
                        log.warning("%s; continuing: checkpoint.allow_other_run is true",
                                    str(e).split("; refusing")[0])
                text = "ok:" + rid
            except identity.OtherRunError as e:
                text = "refused:" + str(e)
            except OSError as e:
                text = "ok:" + (self._explicit_run_id or identity.new_run_id())
                log.warning("cannot record the run id in %s (%s); this attempt uses %s", root,
                            e, text[3:])
        text = parts.agreement.share_text("run_id", text, 120.0)
        kind, _, value = text.partition(":")
        if kind == "refused":
            raise identity.OtherRunError(value)
        return value

    def _periodic_save(self, step: int) -> None:
        ckpt = self._parts.ckpt
        t0 = time.monotonic()
        failed = ckpt.failed_saves
        try:
            info = ckpt.maybe_save(step)
        except self._checkpoint_error as e:
            # Raised on every rank at the same step (failures are agreed across ranks), once
            # checkpoint.max_failed_saves periodic saves in a row failed: stop every rank alike.
            self._save_failed(step, failed)
            sequence.give_up(self._parts, step, e)
        self._save_failed(step, failed)
        if info is not None:
            self._parts.saved(info)
        done = info or ckpt.last_committed        # an async save commits in the background
        if done is not None and done is not self._recorded:
            self._saved(done, time.monotonic() - t0 if info is not None
                        else done.blocked_seconds)

    def _save_failed(self, step: int, before: int) -> None:
        """A periodic save failed (counted since ``before``): the ledger says so and why."""
        ckpt = self._parts.ckpt
        if ckpt.failed_saves > before:
            self._parts.ledger.event("save_failed", step=step, failed=ckpt.failed_saves,
                                     reason=ckpt.last_failure[:500])

    def _saved(self, info: Any, blocking_s: float) -> None:
        """A periodic or manual save committed: the ledger, and the clock's save estimate."""
        parts = self._parts
        self._recorded = info
        secs = max(float(info.save_seconds), 1e-9)
        parts.ledger.event("save", step=int(info.step), reason=info.reason,
                           blocking_s=round(blocking_s, 4), bytes=int(info.nbytes),
                           bw_mib_s=round(info.nbytes / secs / 2**20, 1))
        parts.clock.set_save_estimate(parts.ckpt.estimate().seconds)
        self._hang.last_words(outcome.hang_words(parts))   # the report's saved step

    def _on_forced_exit(self, code: int) -> None:
        """The signal thread, just before its ``os._exit(code)`` for a second SIGINT/SIGTERM
        (the table's code for FORCED, 128 + the signal): record the ending as every other one
        is. The signal thread waits for its hooks at most a second, then leaves regardless."""
        if self._parts.outcome is None:
            sequence.record(self._parts, Facts(Ending.FORCED, self._parts.step,
                                               signum=code - 128))

    def _on_hang_decided(self) -> None:
        """The hang watchdog's thread, the moment it decided: freeze the rescue's boundary, so
        a stall that ends now cannot step the state the rescue is about to write (the hang
        watchdog holds the rest of the loop at its next heartbeat)."""
        if self._parts.rescue is not None:
            self._parts.rescue.freeze()

    def _on_hang(self) -> None:
        """Runs in the hang watchdog's thread before the HANG exit, the main thread stuck or
        held; bounded by the backstop, armed for ``on_hang_budget_s`` when the hang was decided.

        First the rescue (survivors write the last step boundary), then the requeue: only
        rank 0, only under SLURM (a local launcher sees the HANG code and decides), only with a
        committed checkpoint to come back to, and only within the restart budget. Then the
        ending is recorded as every other one is (ledger, trackers, report): if this overruns
        its budget, the backstop's monitor writes the ledger's event and the report instead.
        """
        sequence.rescue(self._parts, "hang")
        verdict = sequence.requeue_after_failure(self._parts, "hang")
        sequence.record(self._parts, Facts(Ending.HANG, self._parts.step, requeue=verdict))


def _local_restart_count() -> int | None:
    from kempner_resilience.shutdown.sequence import _local_restart_count as count

    return count()


def _attempt_start() -> float:
    return attempt_start()
