"""ResilientRun: the one object a training script needs.

```python
cfg = kempner_resilience.load_config("configs/default.yaml")
with kempner_resilience.ResilientRun(cfg, state={"model": model, "optim": optim}) as run:
    for step in run.steps(total_steps):   # starts after the newest committed checkpoint
        train_step(step)
```

``run.steps()`` is the safe point: each boundary is a heartbeat for the hang watchdog, the place
where periodic checkpoints are written and where all ranks agree to stop. This module serves
the user API and runs the loop; how a run begins (signals, agreement, SLURM checks, identity,
checkpoints and resume, rescue) is the set-up sequence, ``kempner_resilience.run.begin``; how a
run ends (emergency checkpoint, requeue, teardown, the exit code and leaving) is
``kempner_resilience.shutdown``. After a shutdown, ``SystemExit`` carries the documented code,
so code after the loop (a "final" save of a model that is not final) never runs by mistake.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from kempner_resilience.checkpoint import identity
from kempner_resilience.checkpoint.identity import RUN_ID_ENV
from kempner_resilience.config import ExitMode, ResilienceConfig, load_config
from kempner_resilience.core.log import get_logger
from kempner_resilience.run import events
from kempner_resilience.run import remarks as loop
from kempner_resilience.run import window
from kempner_resilience.run.begin import begin
from kempner_resilience.runstate import Progress, RunParts, RunState
from kempner_resilience.shutdown import exit as leaving
from kempner_resilience.shutdown import outcome, sequence
from kempner_resilience.shutdown.report import REPORT_ENV
from kempner_resilience.stop.agreement import StopDecision
from kempner_resilience.stop.reason import StopKind, StopReason
from kempner_resilience.stop import rehearsal
from kempner_resilience.stop.signals import ShutdownHandler, ShutdownRequest
from kempner_resilience.stop.teardown import CleanupResult, TeardownStack
from kempner_resilience.stop.watchdog import HangWatchdog
from kempner_resilience.supervise.rank import note_hang_seen

if TYPE_CHECKING:
    from kempner_resilience.checkpoint.info import CheckpointInfo

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
            ``checkpoint.dir/run.json``, else a new one); see ``kempner_resilience.checkpoint.identity``.
    """

    # Which repeated signal forces the exit (None: ``stop.signals.repeat_forces``); a driver
    # whose parent sends SIGTERM with the Ctrl+C has its own rule (``run/ray_run.py``).
    _forces: Callable[[int, list[int]], bool] | None = None

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
        self._handler = ShutdownHandler(config.signals, forces=self._forces)
        self._hang = HangWatchdog(config.watchdog.hang_timeout_s,
                                  busy_timeout_s=config.watchdog.checkpoint_timeout_s,
                                  on_hang=self._on_hang, on_decide=self._on_hang_decided)
        # The run's state: its parts (frozen; the set-up returns the full set) and its
        # progress (the one object that changes while it runs: this run's own).
        self._progress = Progress()
        self._state = RunState(RunParts(config, self._handler, self._hang,
                                        TeardownStack(config.watchdog.cleanup_timeout_s),
                                        leaving.resolve(mode)), self._progress)
        self._explicit_run_id = run_id or os.environ.get(RUN_ID_ENV) or None
        self._entered = False
        self._done = False
        self._looped = False
        self._recorded: CheckpointInfo | None = None   # the newest commit the ledger recorded
        # check-resume's watcher of events (run/events.py), built at the loop; the events the
        # script named before it. None and unused in a real job.
        self._events: events.EventWatch | None = None
        self._named: list[str] = []

    # ------------------------------------------------------------------ context

    def __enter__(self) -> "ResilientRun":
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("ResilientRun must be entered on the main thread (Python only "
                               "delivers signals there)")
        parts = begin(self._state.parts, self._progress, self.state,    # the set-up sequence
                      self._explicit_run_id)
        self._state = RunState(parts, self._progress)
        if parts.ckpt is not None:
            from kempner_resilience.checkpoint import CheckpointError
            from kempner_resilience.checkpoint.lease import LeaseLost

            # Kept for the per-step save check: no import statement on every step.
            self._checkpoint_error = CheckpointError
            self._lease_lost = LeaseLost
            self._recorded = parts.ckpt.last_committed   # the ledger records only newer
        self._entered = True
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> bool:
        # The hang path decided to end the process (a stall that ended, then the loop ended or
        # failed): it alone leaves, with HANG; this thread waits for that exit here.
        self._hang.hold()
        run = self._state
        ended = self._progress.outcome is not None     # a shutdown already ran (SystemExit)
        try:
            if ended:
                return False
            if exc_type is not None and not issubclass(exc_type, SystemExit):
                sequence.fail(run, exc)     # leaves, or returns to re-raise a bug
                return False
            if exc_type is not None:
                # The script left by its own sys.exit (no shutdown of ours ran): rank 0, which
                # loses this rank now, must not take it for killed (supervise/endings.py).
                run.note_ending("exit", leaving.exit_status(exc))
            mine = self._signal_reason()
            reason = mine or run.parts.agreement.agreed_reason()
            # (A lost lease agreed but not yet reached stops at its step, in the loop only.)
            if exc_type is None and reason is not None and not self._done \
                    and reason.kind is not StopKind.LEASE_LOST:
                # The loop was left early (a break after should_stop()) on a stop this rank
                # received or agreed to: finish the shutdown here, on every rank alike.
                sequence.stop(run, StopDecision(self.step, reason, mine is not None))
            if exc_type is None:
                loop.say_if_never_looped(run.parts, self._looped, self._progress.last_saved)
                sequence.complete(run, self.step, left_early=self._looped and not self._done
                                  and reason is None)
        finally:
            self._hang.stop()
            # Past an ending in `exit` mode the deadline still bounds the interpreter's exit.
            code = self.exit_code
            self._handler.uninstall(keep_deadline=code is not None
                                    and run.parts.exit_mode is ExitMode.EXIT,
                                    instead=self._after_end(code) if code is not None else None)
        return False

    def _after_end(self, code: int) -> dict[int, Any]:
        """The handlers that replace the run's once it ended with ``code``. In `exit` mode the
        process is leaving with that code: a SIGTERM now (SLURM's answer to our own requeue, a
        late scancel) must not turn it into 143, and the armed deadline bounds the exit."""
        if self._state.parts.exit_mode is ExitMode.EXIT:
            return {signal.SIGTERM: signal.SIG_IGN}
        return {}

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
        return self._state.parts.run_id

    def time_remaining(self) -> float | None:
        """Seconds until the allocation ends; None when no end is known (outside SLURM)."""
        return self._state.parts.clock.remaining()

    @property
    def rank(self) -> int:
        return self._state.parts.agreement.rank

    @property
    def world_size(self) -> int:
        return self._state.parts.agreement.world_size

    @property
    def step(self) -> int:
        """Completed steps: the index of the next step to run."""
        return self._progress.step

    @property
    def start_step(self) -> int:
        """The step this run started at (the resumed checkpoint's step, or 0)."""
        return self._state.parts.start_step

    @property
    def resumed_from(self) -> CheckpointInfo | None:
        """The ``CheckpointInfo`` this run resumed from, or None for a fresh start."""
        return self._state.parts.resumed_from

    @property
    def exit_mode(self) -> ExitMode:
        """How this run leaves when it ends: ``exit`` or ``raise`` (``auto`` resolved)."""
        return self._state.parts.exit_mode

    @property
    def exit_code(self) -> int | None:
        """The code the run ended with (set when it ended; 0 after all steps ran)."""
        o = self._progress.outcome
        return None if o is None else int(outcome.exit_code(o))

    @property
    def timings(self) -> dict[str, float]:
        """Seconds spent resuming, in the emergency save, the requeue and the teardown."""
        return self._progress.timings

    @property
    def cleanup_results(self) -> list[CleanupResult]:
        return self._progress.cleanup_results

    def should_stop(self) -> bool:
        """Poll inside long phases (eval, warm-up): True once any rank asked to stop.

        In a distributed run this is a collective: call it on every rank equally often. After
        it returns True, leave the phase; the next ``steps()`` boundary stops every rank there.
        """
        return self._state.parts.agreement.any_requested(self._stop_reason(time.monotonic()))

    def event(self, name: str = "eval") -> None:
        """Say that ``name`` (an eval, by default) happened in the step now running.

        Call it where the loop evaluates (``if step % eval_interval == 0: run.event("eval")``),
        on any rank. A real job does nothing with it. Under ``kempner-resilience check-resume``
        the run writes where these events fall, and the check stops a run between two of them:
        a value the eval changes and the loop carries outside ``state`` (``best_val_loss``, an
        lr annealed on a plateau, a patience counter) then shows as a difference.
        """
        kind = events.event_kind(name)
        if self._events is not None:
            self._events.named(kind)
        elif not self._looped and kind not in self._named:
            self._named.append(kind)     # before the loop: told to the watcher when it starts

    def steps(self, total: int) -> Iterator[int]:
        """Yield step indices from the resume point up to ``total - 1``.

        Stops at the first boundary all ranks agree on after a shutdown signal, then checkpoints,
        requeues and raises ``SystemExit`` with the exit code (see ``exitcodes``).
        """
        if not self._entered:
            raise RuntimeError("use `with ResilientRun(...) as run:` before run.steps()")
        if total < 0:
            raise ValueError(f"total must be >= 0, got {total}")
        run, progress = self._state, self._progress
        parts = run.parts
        clock = parts.clock
        # Step times only matter for the stop before a known end: outside SLURM, measure nothing.
        timed = clock.end_epoch is not None and clock.stop_enabled
        if not self._looped:
            self._looped = True
            parts.ledger.event("loop", step=progress.step)
            if parts.ckpt is not None:    # loaders learn their look-ahead; schedulers checked
                parts.ckpt.state.loop_starts()
            loop.say_what_remains(parts, progress.step, total)
        rescue = parts.rescue
        if rescue is not None:
            rescue.mark(progress.step)
        plan = rehearsal.planned()      # check-resume's stops (stop/rehearsal.py); () otherwise
        # check-resume's watcher of epoch ends, milestones and named events (run/events.py);
        # None otherwise.
        seen = self._events = events.watch(parts.ckpt.state.others, parts.rank) \
            if plan and parts.ckpt is not None else None
        if seen is not None:
            for kind in self._named:
                seen.named(kind)
        self._named = []
        ends = window.WindowEnds(parts)     # the stop check after a window's end reads afresh
        while progress.step < total:
            if plan:
                if seen is not None:
                    seen.at(progress.step)
                rehearsal.rehearse(plan, progress.step, parts.start_step, parts.agreement)
            now = time.monotonic()
            reason = self._signal_reason()
            if reason is None and now >= clock.threshold and clock.due(now):
                reason = StopReason.TIME_LIMIT    # no signal: the allocation ends
            # Rank 0 holds the lease: losing it to another run is a stop every rank agrees on.
            lost = parts.ckpt is not None and parts.ckpt.lease_lost
            if lost and parts.ledger.active:
                parts.ledger.disown()  # the new holder's ledger from now on, not ours
            decision = parts.agreement.poll(progress.step, reason, lost, fresh=ends.closed())
            if decision is not None:     # inside an accumulation window: at its end (window.py)
                decision = window.stop_here(parts, progress.step, decision)
            if decision is not None:
                sequence.stop(run, decision)     # a lost lease: nothing saved
            yield progress.step
            if timed:
                clock.observe_step(time.monotonic() - now)
            step = progress.advance()
            self._hang.beat()
            if rescue is not None:
                rescue.mark(step)      # before the save: a peer may die during it
            if parts.ckpt is not None:
                self._periodic_save(step)
        progress.loop_ended(time.time())
        self._done = True
        if rescue is not None:
            rescue.close()
        self._record_complete()

    def _record_complete(self) -> None:
        """Rank 0, at the end of the loop: record in ``run.json`` the step this run's lineage
        reached (``identity.mark_complete``), for the next start's line."""
        parts, step = self._state.parts, self._progress.step
        if parts.rank != 0 or parts.ckpt is None or not parts.run_id or parts.ckpt.lease_lost:
            return       # (a run that lost its lease writes no run file any more)
        try:
            identity.mark_complete(parts.ckpt.paths, parts.run_id, step)
        except OSError as e:
            log.warning("cannot record that run %s completed step %d in %s: %s", parts.run_id,
                        step, parts.ckpt.paths.run_file, e)

    def add_cleanup(self, fn: Callable[[], Any], *, name: str | None = None,
                    timeout_s: float | None = None) -> Callable[[], Any]:
        """Run ``fn`` at shutdown (newest first), at most ``timeout_s`` (config default)."""
        return self._state.parts.teardown.add(fn, name=name, timeout_s=timeout_s)

    def add_executor(self, executor: Any, *, name: str | None = None,
                     timeout_s: float | None = None) -> Any:
        """Shut ``executor`` down at shutdown with ``cancel_futures=True``."""
        return self._state.parts.teardown.add_executor(executor, name=name,
                                                       timeout_s=timeout_s)

    def save(self) -> CheckpointInfo:
        """Write a checkpoint now (collective); returns its info."""
        run = self._state
        if run.parts.ckpt is None:
            raise RuntimeError("no checkpoint state: pass state={...} to ResilientRun")
        self._hang.hold()      # nothing is saved once the hang path decided to exit
        t0 = time.monotonic()
        try:
            info = run.parts.ckpt.save(self.step, reason="manual")
        except self._lease_lost:         # on every rank: another run holds the directory
            sequence.lease_lost(run, self.step)
        run.saved(info)
        self._saved(info, time.monotonic() - t0)
        return info

    # ------------------------------------------------------------------ set-up and the loop

    def _signal_reason(self) -> StopReason | None:
        """The signal this rank received, if any."""
        req = self._handler.request
        return None if req is None else StopReason.signal(req.signum)

    def _stop_reason(self, now: float) -> StopReason | None:
        """This rank's reason to stop: a signal it received, or the allocation's end."""
        reason = self._signal_reason()
        if reason is None and self._state.parts.clock.due(now):
            return StopReason.TIME_LIMIT
        return reason

    def _periodic_save(self, step: int) -> None:
        run = self._state
        ckpt = run.parts.ckpt
        t0 = time.monotonic()
        failed = ckpt.failed_saves
        try:
            info = ckpt.maybe_save(step)
        except self._lease_lost:
            # Raised on every rank at the same step (rank 0's check, broadcast): another run
            # holds the directory; stop here, nothing saved.
            sequence.lease_lost(run, step)
        except self._checkpoint_error as e:
            # Raised on every rank at the same step (failures are agreed across ranks), once
            # checkpoint.max_failed_saves periodic saves in a row failed: stop every rank alike.
            self._save_failed(step, failed)
            sequence.give_up(run, step, e)
        self._save_failed(step, failed)
        if info is not None:
            run.saved(info)
        done = info or ckpt.last_committed        # an async save commits in the background
        if done is not None and done is not self._recorded:
            self._saved(done, time.monotonic() - t0 if info is not None
                        else done.blocked_seconds)

    def _save_failed(self, step: int, before: int) -> None:
        """A periodic save failed (counted since ``before``): the ledger says so and why."""
        parts = self._state.parts
        ckpt = parts.ckpt
        if ckpt.failed_saves > before:
            parts.ledger.event("save_failed", step=step, failed=ckpt.failed_saves,
                                     reason=ckpt.last_failure[:500])

    def _saved(self, info: CheckpointInfo, blocking_s: float) -> None:
        """A periodic or manual save committed: the ledger, and the clock's save estimate."""
        parts = self._state.parts
        self._recorded = info
        secs = max(float(info.save_seconds), 1e-9)
        parts.ledger.event("save", step=int(info.step), reason=info.reason,
                           blocking_s=round(blocking_s, 4), bytes=int(info.nbytes),
                           bw_mib_s=round(info.nbytes / secs / 2**20, 1))
        parts.clock.set_save_estimate(parts.ckpt.estimate().seconds)
        self._hang.last_words(outcome.hang_words(self._state))   # the report's saved step

    def _on_hang_decided(self) -> None:
        """The hang watchdog's thread, the moment it decided: freeze the rescue's boundary, so
        a stall that ends now cannot step the state the rescue is about to write (the hang
        watchdog holds the rest of the loop at its next heartbeat)."""
        parts = self._state.parts
        if parts.rescue is not None:
            parts.rescue.freeze()
        # Under a supervisor (`kempner-resilience srun`, spare nodes): this rank's watchdog ran
        # in Python, so it is not the rank hung with the GIL held; the supervisor keeps the
        # silent one's node out of the relaunch.
        note_hang_seen(parts.rank)

    def _on_hang(self) -> int:
        """Runs in the hang watchdog's thread before the HANG exit, the main thread stuck or
        held; bounded by the backstop, armed for ``on_hang_budget_s`` when the hang was decided.

        The rescue, the requeue (only rank 0, only under SLURM: a local launcher sees the HANG
        code and decides), then the ending recorded as every other one is
        (``sequence.hang``): if this overruns its budget, the backstop's monitor writes the
        ledger's event and the report instead.
        """
        return sequence.hang(self._state)
