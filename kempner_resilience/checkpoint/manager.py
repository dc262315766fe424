"""CheckpointManager: when to save, how (sync, async, emergency), and resuming exactly.

Collectives: every public method except ``latest``, ``estimate``, ``estimate_save_seconds`` and
``busy`` is collective (all ranks call it, in the same order). They run on gloo groups created here at
construction (``dist.new_group`` is itself collective over the default group): one for foreground
work (save, emergency save, resume, check_dir) and, with ``async``, one for the background writer,
so a background save never interleaves its collectives with ours or with training's. Foreground
work also never uses the training group, so an emergency save can run from a watchdog thread
while the main thread is stuck in a training collective.

A save's collectives (DCP's gathers, the commit's gather and broadcast) wait for the other
ranks at most ``peer_timeout_s`` beyond this rank's estimate of the save (``estimate.py``: it
covers a slower rank's write). A rank that dies or stops answering (SIGSTOP, a frozen node)
during a save is then a lost peer within that bound (``SavePeerLost``), not a failed save nor
a stall of gloo's 30-minute default.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, Mapping

import torch.distributed as dist

from kempner_resilience.checkpoint import dircheck, directio, hostbuf, layout, loader, retention
from kempner_resilience.checkpoint.background import BackgroundSaver
from kempner_resilience.checkpoint.cadence import Cadence
from kempner_resilience.checkpoint.comm import Comm
from kempner_resilience.checkpoint.estimate import Estimate
from kempner_resilience.checkpoint.hostbuf import HostStaging
from kempner_resilience.checkpoint.info import CheckpointError, CheckpointInfo
from kempner_resilience.checkpoint.info import CheckpointDirError, SavePeerLost
from kempner_resilience.checkpoint.lease import Lease, LeaseLost
from kempner_resilience.checkpoint.sharded import mesh_field
from kempner_resilience.checkpoint.state import TrainState
from kempner_resilience.checkpoint.saver import Saver
from kempner_resilience.config import CheckpointConfig, StagingMode
from kempner_resilience.core.gcpause import gc_paused
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.runpaths import RunPaths

log = get_logger(__name__)

__all__ = ["CheckpointManager"]

# Single-process saves/loads are intended; DCP warns about them on every call.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized", category=UserWarning)
_GIB = 2**30


class CheckpointManager:
    """Saves and restores ``state`` under ``config.dir``; see the module docstring for collectives.

    ``state`` maps names to ``nn.Module`` (plain or DDP), optimizers (paired with the module that
    owns their parameters) and any object with ``state_dict()``/``load_state_dict()``. ``rank`` and
    ``world_size`` are this process's place in ``process_group`` (default: the default group);
    with ``world_size == 1`` torch.distributed need not be initialized. ``run_id`` is written
    into each step directory's ownership marker; retention leaves other runs' directories
    alone (and all that this package did not write, ``retention.why_not_ours``).

    A failed periodic save (full disk, I/O error) is logged, its partial directory removed, and
    the next one tries again; ``CheckpointError`` once ``config.max_failed_saves`` in a row fail.
    GPU tensors (sized here: move the model first) are staged through host buffers allocated
    here, once (``config.staging``, logged by rank 0); no save allocates them. Async snapshots'
    buffers are allocated in the background after the first step (``Stager.prewarm``).

    ``peer_timeout_s`` bounds a save's wait for the other ranks (see the module docstring;
    ``ResilientRun`` passes ``watchdog.hang_timeout_s``); None keeps the gloo group's default.
    ``busy_hook`` is entered around every foreground save and load (``ResilientRun`` widens the
    hang budget in it); ``manifest_extra`` is recorded in every manifest besides the run id
    (the SLURM job id, the restart count); ``lease`` (``checkpoint.lease.Lease``, rank 0's) is
    released by ``close`` once the last save is drained. Run id and lease may come later
    (``check_dir``, then ``claim``). """

    def __init__(self, config: CheckpointConfig, state: Mapping[str, Any], *, rank: int = 0,
                 world_size: int = 1, process_group: Any = None,
                 run_id: str | None = None, peer_timeout_s: float | None = None,
                 busy_hook: Callable[[], ContextManager[None]] = contextlib.nullcontext,
                 manifest_extra: Mapping[str, Any] | None = None,
                 lease: Lease | None = None) -> None:
        self.config = config
        self.run_id = run_id
        self.peer_timeout_s = peer_timeout_s
        # Every entry of the run's directory, named once (absolute: resolved with the config).
        self.paths = RunPaths.from_checkpoint_config(config)
        self.rank = rank
        self.world_size = world_size
        self.state = TrainState(state, ddp_buckets=config.ddp_buckets)
        if world_size > 1 and self.state.delegated:
            raise CheckpointError(
                f"state {sorted(self.state.delegated)} is saved by other processes (a worker "
                "group): it belongs to a single-process run (a Ray driver), not to one of "
                f"{world_size} ranks")
        if world_size > 1:
            if not (dist.is_available() and dist.is_initialized()):
                raise CheckpointError(f"world_size={world_size} but torch.distributed is not "
                                      "initialized; call init_process_group first")
            ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
            fg = dist.new_group(ranks=ranks, backend="gloo")
            bg = dist.new_group(ranks=ranks, backend="gloo") if config.async_ else None
        else:
            fg = bg = None
        self._fg = Comm(fg, rank, world_size)
        self._lock = threading.RLock()          # one foreground operation at a time
        self._busy = 0
        self._busy_lock = threading.Lock()
        # The O_DIRECT buffers first: they and the staging buffers share staging_cap_gib.
        direct = directio.reserve(config)
        self._saver = Saver(config, self.paths, self.state, rank=rank, world_size=world_size,
                            peer_timeout_s=peer_timeout_s, direct=direct,
                            staging=hostbuf.reserve(config, self.state, rank, direct),
                            manifest_extra={**(manifest_extra or {}),
                                            **mesh_field(self.state.every_module())},
                            last_good=lambda: self._last_committed or self.latest())
        self._saver.claim(run_id)
        self._async = BackgroundSaver(self._save_state, Comm(bg, rank, world_size),
                                      pin=config.staging is StagingMode.PINNED,
                                      max_failed_saves=config.max_failed_saves)
        self._cadence = Cadence(config, self._fg)
        self._last_committed: CheckpointInfo | None = None
        self._closed = False
        self._busy_hook = busy_hook
        self._lease = lease

    # ----------------------------------------------------------------------------------- status

    @property
    def root(self) -> Path:
        """The run's directory itself (``paths.root``); its entries: ``paths``."""
        return self.paths.root

    @property
    def busy(self) -> bool:
        """True while a save, load or wait runs in a caller's thread (not for a background write
        that does not block training)."""
        return self._busy > 0

    @property
    def last_committed(self) -> CheckpointInfo | None:
        """The newest checkpoint this manager committed or resumed from."""
        return self._last_committed

    @property
    def lease_lost(self) -> bool:  # rank 0's lease, taken over by another run: save nothing
        return self._lease is not None and self._lease.lost

    @property
    def manifest_extra(self) -> dict[str, Any]:
        """What every manifest records besides the run id (the SLURM job id, the restart
        count): a rescue's manifest records the same."""
        return self._saver.manifest_extra

    @property
    def comm(self) -> Comm:
        """The foreground collectives (this manager's own gloo group): for set-up steps of the
        main thread that must agree across ranks, never while a save or load runs."""
        return self._fg

    @property
    def failed_saves(self) -> int:
        """Periodic saves that failed in a row since the last commit (the same on every rank)."""
        return self._cadence.failed

    @property
    def last_failure(self) -> str:
        """Why the last failed periodic save failed ("" when none has)."""
        return self._cadence.last_failure

    @property
    def async_in_flight(self) -> bool:
        return self._async.running is not None

    @property
    def staging(self) -> HostStaging | None:
        """The host buffers GPU state is saved and loaded through (None: no GPU state, or
        ``checkpoint.staging: off``)."""
        return self._saver.staging

    @contextlib.contextmanager
    def _foreground(self) -> Iterator[None]:
        with self._lock, self._busy_hook():
            with self._busy_lock:
                self._busy += 1
            try:
                yield
            finally:
                with self._busy_lock:
                    self._busy -= 1

    # -------------------------------------------------------------------------------- start-up

    def claim(self, run_id: str, lease: Lease | None,
              earlier: frozenset[str | None] = frozenset()) -> None:
        """The run id, rank 0's lease and the lineages a fresh start left (never resumed from,
        counted or deleted): known once ``check_dir`` found the directory usable; before saves."""
        self.run_id = run_id
        self._saver.claim(run_id, lease, frozenset(earlier))
        self._lease = lease

    def check_dir(self) -> None:
        """Fail early if checkpoints cannot be written: the directory's parent is missing, it is
        not writable, it lacks the space for about one save, or its filesystem refuses
        ``O_DIRECT`` under ``checkpoint.direct_io: on``. Collective: every rank raises
        the same ``CheckpointDirError`` (exit code 78 when a script leaves it uncaught)."""
        clean = (lambda: retention.clean_trash(self.paths, self.run_id, self._saver.leave_alone)) \
            if self.rank == 0 else None
        problem = dircheck.local_problem(self.paths, self.state.nbytes(), self.rank, clean) \
            or self._saver.check_direct_io()
        problems = self._fg.all_gather_object(problem)
        bad = [f"rank {r}: {p}" if self.world_size > 1 else p
               for r, p in enumerate(problems) if p]
        if bad:
            raise CheckpointDirError("; ".join(bad))

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint that passes the cheap checks (manifest, file sizes,
        owner); bad ones are logged and skipped. Local (no collectives), reads no data."""
        return layout.latest(self.paths, self.config.allow_foreign_owner)

    # ---------------------------------------------------------------------------- resume

    def resume(self) -> CheckpointInfo | None:
        """Load the newest good checkpoint into ``state`` on every rank and restore RNG streams
        (``loader.load_newest``: a bad one is skipped, the previous one tried). None when there
        is none (fresh start) or ``config.resume`` is off; CheckpointError when checkpoints
        exist but none loads (``LineageDamagedError``, exit 78, when every one of the lineage
        was found damaged and set aside, now or before). Collective."""
        if not self.config.resume:
            log.info("checkpoint.resume is off: starting fresh")
            return None
        with self._foreground():
            self._drain_background(raise_errors=False)
            t0 = time.monotonic()
            unloadable: list[Path] = []      # kept from this run's retention (Saver.resumed)
            found = loader.load_newest(self.paths, self.config, self.state, self.rank, self._fg,
                                       self._saver.staging, earlier=self._saver.earlier,
                                       failed=unloadable)
            if found is None:
                return None
            info, nread = found
            self._saver.resumed(info.path, unloadable)
            self._cadence.saved(info.step)
            self._last_committed = info
            # The previous attempt's save time is the best evidence until this one saves.
            self._saver.estimator.seed(info.save_seconds, self.state.nbytes())
            log.info("resumed from %s (step %d): %.3f GiB read in %.2f s", info.path, info.step,
                     nread / _GIB, time.monotonic() - t0)
            return info

    # --------------------------------------------------------------------------------- saves

    def maybe_save(self, step: int) -> CheckpointInfo | None:
        """Save if the cadence says so (``every_steps`` multiples, or ``every_minutes`` since the
        last save). Synchronous saves return their info; async ones return None (see ``wait``
        and ``last_committed``). A failed save is logged and returns None: the previous
        checkpoint stays, the next periodic save tries again. Raises CheckpointError once
        ``config.max_failed_saves`` in a row have failed (for async saves: when the next one is
        due). Collective: call it on every rank at every step."""
        self.state.buckets.observe()
        info = None
        due = self._cadence.due(step)
        if self.config.async_ and not due:     # the snapshot's buffers, once, in the background
            self._async.prewarm(self.state.tensor_state)
        if due:
            if self.config.async_:
                self._start_async(step)
            else:
                try:
                    info = self.save(step, reason="periodic")
                except CheckpointError as e:     # raised on every rank together
                    self._cadence.retry_later()
                    self._periodic_failed(e)
        self._cadence.step_done()
        return info

    def _periodic_failed(self, err: BaseException) -> None:
        self._cadence.save_failed(err)
        self._cadence.check_failures()
        log.warning("%s Training goes on; the next periodic save tries again (%d of "
                    "checkpoint.max_failed_saves=%d failed in a row).", err, self._cadence.failed,
                    self.config.max_failed_saves)

    def save(self, step: int, *, reason: str = "periodic") -> CheckpointInfo:
        """Synchronous save of ``step`` completed steps into a fresh directory, committed when
        this returns. Waits for an in-flight async save first. Collective."""
        with self._foreground():
            self._drain_background(raise_errors=False)
            t0 = time.monotonic()
            sd = self.state.capture(step, self.rank)
            return self._save_state(sd, step, reason, self._fg, None, t0, 0.0)

    def emergency_save(self, step: int, *, deadline: float | None = None) -> CheckpointInfo | None:
        """The synchronous save before exiting. An in-flight async save is awaited if there is
        time for it and this save, else abandoned. Returns None (logging why) without starting
        only when measured saves say it cannot finish before ``deadline`` (a
        ``time.monotonic()`` value) minus ``save_margin_s``; without a measurement it tries (the
        deadline watchdog is the backstop). Raises CheckpointError if the save fails.
        Collective."""
        # The process is about to leave: no full collections in its last save.
        with self._foreground(), gc_paused():
            margin = self.config.save_margin_s
            bg = self._async.running
            # Every rank agrees, in flight or not: a save's thread may have just ended on one
            # rank and not on another, and the collectives must be the same on all of them.
            remaining = Estimate(0.0, True) if bg is None else self._saver.estimator.remaining(
                self.state.nbytes(), time.monotonic() - bg.started)
            left = self._agreed_estimate(remaining, self.estimate())
            if bg is not None:
                fits = deadline is None or left is None or \
                    time.monotonic() + left <= deadline - margin
                if not fits:
                    log.warning("abandoning the in-flight async save of step %d: no time for it "
                                "and the emergency save", bg.step)
                    bg.abort.set()
                bg.thread.join(None if deadline is None else max(deadline - time.monotonic(), 0))
                if bg.alive:     # stuck: leave it behind, it writes elsewhere
                    log.warning("async save of step %d did not stop; not waiting for it", bg.step)
                    self._async.leave_behind()
            self._drain_background(raise_errors=False, lost_peer=False)
            last = self._last_committed
            if last is not None and last.step == step:
                log.info("emergency save: step %d is already committed at %s", step, last.path)
                return last
            est = self._agreed_estimate(self.estimate())
            now = time.monotonic()
            if deadline is not None and est is not None and now + est > deadline - margin:
                log.error("emergency save of step %d refused: measured saves say it needs "
                          "~%.1f s and only %.1f s remain before the deadline minus "
                          "save_margin_s (%.1f s); the last committed checkpoint stays the resume "
                          "point", step, est, deadline - margin - now, margin)
                return None
            sd = self.state.capture(step, self.rank)
            return self._save_state(sd, step, "emergency", self._fg, None, now, 0.0)

    def _agreed_estimate(self, *parts: Estimate) -> float | None:
        """The slowest rank's estimate of ``sum(parts)``, or None when no rank measured a save
        (collective): the save then is tried, not refused on a guess."""
        measured = all(p.measured for p in parts)
        local = sum(p.seconds for p in parts) if measured else -1.0
        agreed = self._fg.max(local)
        return agreed if agreed >= 0 else None

    def _start_async(self, step: int) -> None:
        with self._foreground():
            self._drain_background(raise_errors=False)
            self._cadence.check_failures()
            t0 = time.monotonic()
            self._async.start(self.state.capture(step, self.rank), step, t0, self._cadence.failed)
            self._cadence.saved(step)            # cadence: counts as saved when started

    def wait(self) -> None:
        """Block until an in-flight async save is committed; CheckpointError if it failed."""
        with self._foreground():
            self._drain_background(raise_errors=True)

    def _drain_background(self, raise_errors: bool, lost_peer: bool = True) -> None:
        """Wait for the async save in flight. Its ``SavePeerLost`` (or ``LeaseLost``) is raised
        here, in the training thread, unless ``lost_peer`` is False (the emergency save, which
        tries its own group, and close): a lost peer or lease ends the run, never counted as a
        failed save."""
        bg = self._async.finish()
        if bg is None:
            return
        if isinstance(bg.error, (SavePeerLost, LeaseLost)) and lost_peer:
            raise bg.error
        if bg.error is not None:
            self._cadence.save_failed(bg.error)
        if bg.error is not None and raise_errors:
            if isinstance(bg.error, CheckpointError):
                raise bg.error
            raise CheckpointError(f"async checkpoint of step {bg.step} failed: {bg.error}")

    def _save_state(self, sd: dict[str, Any], step: int, reason: str, comm: Comm,
                    abort: threading.Event | None, t0: float, blocked: float) -> CheckpointInfo:
        """Write and commit ``sd`` (``Saver.save``), then count it for the cadence."""
        info = self._saver.save(sd, step, reason, comm, abort, t0, blocked)
        self._last_committed = info
        self._cadence.committed()
        if reason != "periodic-async":
            self._cadence.saved(step)
        return info

    # ----------------------------------------------------------------------------- estimates

    def estimate(self) -> Estimate:
        """This rank's estimate of a synchronous save of the current state, from the last
        measured saves (see ``checkpoint.estimate``); ``measured`` is False before any."""
        return self._saver.estimator.estimate(self.state.nbytes())

    def estimate_save_seconds(self) -> float:
        """Seconds a synchronous save of the current state should take on this rank (a
        conservative guess of 100 MiB/s + 2 s before any save was measured)."""
        return self.estimate().seconds

    # ------------------------------------------------------------------------------ shutdown

    def close(self) -> None:
        """Wait for an in-flight async save (errors are logged, not raised)."""
        if self._closed:
            return
        self._closed = True
        with self._foreground():
            self._drain_background(raise_errors=False, lost_peer=False)
            self._saver.join_retention()
            self._saver.forget_plans()
        if self._lease is not None:       # after the last write: the directory is free now
            self._lease.release()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
