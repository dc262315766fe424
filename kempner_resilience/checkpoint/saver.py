"""Writing one save and committing it: the step directory, DCP's write through the
checksumming writer, the commit (manifest, rename, fsync) on rank 0, then retention.

``Saver.save`` is the one way a state dict becomes a committed checkpoint, for the periodic,
manual, emergency and background saves alike (``CheckpointManager`` decides when and on which
group, and keeps the cadence and the failure count). Every collective in it waits for the
other ranks at most ``peer_timeout_s`` plus this rank's estimate of the save; a lost peer is
raised as ``SavePeerLost`` (see ``checkpoint/manager.py``'s docstring).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch.distributed.checkpoint as dcp   # imported up front: ~0.7 s, never on the emergency path
from torch.distributed.checkpoint.api import CheckpointException   # a BaseException subclass
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from kempner_resilience.checkpoint import (commit, delegated, dircheck, directio, layout, pinned,
                                           retention)
from kempner_resilience.checkpoint.comm import Comm
from kempner_resilience.checkpoint.directio import DirectPool
from kempner_resilience.checkpoint.estimate import SaveEstimator
from kempner_resilience.checkpoint.hostbuf import HostStaging
from kempner_resilience.checkpoint.info import (CheckpointError, CheckpointInfo, SavePeerLost,
                                               describe_error)
from kempner_resilience.checkpoint.lease import Lease, LeaseLost
from kempner_resilience.checkpoint.state import TrainState
from kempner_resilience.checkpoint.writer import STAGING_MISMATCH, ChecksummingWriter
from kempner_resilience.config import CheckpointConfig
from kempner_resilience.core.faults import first_line, is_peer_failure
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.runpaths import RunPaths
from kempner_resilience.core.torch_private import forget_save_plans

__all__ = ["Saver"]

log = get_logger(__name__)

_GIB = 2**30


_runs = itertools.count()


class RunSavePlanner(DefaultSavePlanner):
    """DCP's default planner, its plan cache kept to one run's saves.

    DCP caches plans in class-level dicts keyed by the planner's class name, for the life of
    the process. A process that lives on into another run (a warm Ray actor, reborn; a
    notebook) would bring the last run's plans into a group whose other ranks have none, and
    the save fails (a ``KeyError`` on the rank without them). So each Saver saves with a
    subclass of a name of its own (``for_one_run``), and forgets its plans when it closes."""

    @classmethod
    def for_one_run(cls) -> type["RunSavePlanner"]:
        return type(f"{cls.__name__}{next(_runs)}", (cls,), {})


class Saver:
    """Writes and commits saves of ``state`` under ``config.dir`` for one rank.

    ``staging`` (the host buffers GPU state goes through) is trusted once the run's first
    staged save matched a plain copy, tensor by tensor; until then emergency saves (no second
    chance) go unstaged, and a mismatch turns it off for the run. ``last_good`` names the
    newest good checkpoint for a failure's message. ``estimator`` holds this rank's measured
    saves.
    """

    def __init__(self, config: CheckpointConfig, paths: RunPaths, state: TrainState, *,
                 rank: int, world_size: int, peer_timeout_s: float | None,
                 staging: HostStaging | None, manifest_extra: dict[str, Any],
                 last_good: Callable[[], CheckpointInfo | None],
                 direct: DirectPool | None = None) -> None:
        self.config = config
        self.paths = paths
        self.root = paths.root
        self.state = state
        self.rank = rank
        self.world_size = world_size
        self.peer_timeout_s = peer_timeout_s
        self.staging = staging
        self.staging_proven = False
        # Allocated and touched at set-up (directio.reserve): the files are written past the
        # page cache from these, so no save draws fresh pages from free memory.
        self.direct = direct
        self.manifest_extra = manifest_extra
        self.run_id: str | None = None            # the manager's, once claimed
        self.lease: Lease | None = None           # rank 0's lease on the directory, once claimed
        self.estimator = SaveEstimator()          # measured saves of this rank
        self._last_good = last_good
        self._writing: set[Path] = set()          # directories being written: retention skips them
        self._retention_thread: threading.Thread | None = None
        self._left_alone: set[Path] = set()       # what retention already said it leaves alone
        self.earlier: frozenset[str | None] = frozenset()   # lineages left behind: never touched
        # Until this run commits a checkpoint of its own, the one it resumed from is the only
        # one known to load: retention keeps it whatever keep_last says. Those resume could not
        # load (and did not set aside) are neither counted nor deleted by this run.
        self._resumed_from: Path | None = None
        self._unloadable: set[Path] = set()
        self._own_commit = False
        self._planner = RunSavePlanner.for_one_run()

    def claim(self, run_id: str | None, lease: Lease | None = None,
              earlier: frozenset[str | None] = frozenset()) -> None:
        """The run the step directories are marked with (their ownership marker); rank 0's
        lease on the directory, checked before a step directory is made, before the commit's
        rename and before retention deletes (a run that lost it writes nothing more); and the
        earlier lineages of the directory that retention must leave alone."""
        self.run_id = run_id
        self.lease = lease
        self.earlier = frozenset(earlier)

    def check_direct_io(self) -> str | None:
        """At start-up, the run's directory made: whether its filesystem takes ``O_DIRECT``.
        Under ``checkpoint.direct_io: on`` a refusal is the returned problem; under ``auto``
        the buffers are given back (the files go through the page cache) and it is said once."""
        self.direct, problem = directio.settle(self.direct, self.paths, self.rank)
        return problem

    def resumed(self, path: Path, unloadable: list[Path]) -> None:
        """The run resumed from ``path`` after ``unloadable`` failed to load: protect them
        from this run's retention (see ``__init__``)."""
        self._resumed_from = Path(path)
        self._unloadable.update(Path(p) for p in unloadable)

    def distrust_staging(self, why: str) -> None:
        """The staging path wrote other bytes than the tensors hold: never use it again in this
        run (saves and loads go the plain way) and say which tensor showed it."""
        log.error("checkpoint staging is OFF for the rest of this run: %s. The save is written "
                  "again without staging; nothing staged was committed. Please report this "
                  "(GPU, driver, torch version) and set checkpoint.staging: off meanwhile", why)
        self.staging = None

    def save(self, sd: dict[str, Any], step: int, reason: str, comm: Comm,
                    abort: threading.Event | None, t0: float, blocked: float) -> CheckpointInfo:
        """Write and commit ``sd``; every collective in it waits for the other ranks at most
        ``peer_timeout_s`` plus this rank's estimate of the save, and a lost peer raises
        ``SavePeerLost`` (see the module docstring)."""
        slack, bound = self.peer_timeout_s, None
        if slack is not None and comm.distributed:
            bound = slack + self.estimator.estimate(self.state.nbytes()).seconds
        try:
            with comm.bounded(bound):
                return self._write_and_commit(sd, step, reason, comm, abort, t0, blocked)
        except CheckpointError:
            raise
        except (Exception, CheckpointException) as e:
            if not is_peer_failure(e):
                raise
            within = "" if bound is None or slack is None else (
                f" or did not answer within {bound:.1f} s (watchdog.hang_timeout_s {slack:g} s "
                f"+ this save's estimate {bound - slack:.1f} s)")
            raise SavePeerLost(f"{reason} checkpoint of step {step}: another rank is gone"
                               f"{within}: {first_line(e)}") from e

    def _write_and_commit(self, sd: dict[str, Any], step: int, reason: str, comm: Comm,
                          abort: threading.Event | None, t0: float,
                          blocked: float) -> CheckpointInfo:
        # Rank 0 picks a fresh directory; a failure there must reach every rank.
        choice: tuple[str | None, str | None] = (None, None)
        if self.rank == 0:
            self.join_retention()     # it must not see our new, still partial directory
            try:
                if self.lease is not None:
                    self.lease.check()
                choice = (str(layout.create_step_dir(self.paths, step, self.run_id)), None)
            except LeaseLost as e:
                choice = (None, commit.LOST_PREFIX + str(e))
            except OSError as e:
                choice = (None, dircheck.note_inodes(describe_error(e) or "", self.root))
        path_s, err = comm.broadcast_object(choice)
        if path_s is None:
            _raise_if_lost(err)
            raise CheckpointError(self._failure_text(step, self.root, err or "?"))
        path = Path(path_s)
        self._writing.add(path)
        try:
            staging = self.staging if self.staging_proven or reason != "emergency" else None
            prove = staging is not None and not self.staging_proven
            # overwrite=False: a save never writes over anything (the directory is fresh).
            writer = ChecksummingWriter(path, overwrite=False, threads=self.config.io_threads,
                                        abort=abort, staging=staging, prove=prove,
                                        direct=self.direct)
            failure: BaseException | None = None
            try:
                # Plan caching: with an unchanged state layout (every save after the first),
                # DCP reuses the global plan and metadata instead of rebuilding them.
                dcp.save(sd, storage_writer=writer, process_group=comm.dcp_group,
                         planner=self._planner(enable_plan_caching=True),
                         no_dist=comm.dcp_no_dist)
            except (Exception, CheckpointException) as e:   # DCP raises on all ranks together
                if is_peer_failure(e):
                    # Its own collective failed: the group is broken (after a gloo timeout every
                    # later operation fails), so no gather of the failure either.
                    raise
                failure = e
            files, lost = writer.files, None
            if failure is None and self.rank == 0 and self.state.delegated:
                try:    # the parts other processes save (a Ray worker group's actors)
                    files = delegated.save_parts(self.state.delegated, path, step, files)
                except Exception as e:  # noqa: BLE001 - theirs to raise; nothing is committed
                    failure = e
                    lost = e if is_peer_failure(e) else None
            gathered = comm.all_gather_object(
                (files if failure is None else None, describe_error(failure)))
            mismatch = next((why for _, why in gathered if why and STAGING_MISMATCH in why), None)
            if mismatch is not None:
                # Same list on every rank (all_gather): all drop staging and save again.
                if self.rank == 0:
                    with contextlib.suppress(OSError):
                        retention.remove_dir(path)
                self.distrust_staging(mismatch)
                return self._write_and_commit(sd, step, reason, comm, abort, t0, blocked)
            status: str | None = None
            manifest: dict[str, Any] = {}
            if self.rank == 0:
                status = commit.commit(path, step, reason, gathered, t0, blocked,
                                       self.world_size, manifest,
                                       {"run_id": self.run_id, **self.manifest_extra},
                                       lease=self.lease)
                if status is not None and not status.startswith(commit.LOST_PREFIX):
                    status = dircheck.note_inodes(status, self.root)   # partial still holds them
            status, committed_at, nbytes = comm.broadcast_object(
                (status, manifest.get("committed_at", 0.0), manifest.get("nbytes", 0)))
            # Lost: the partial directory stays as it is (this run deletes nothing there now;
            # the holder's retention removes an abandoned partial save).
            _raise_if_lost(status)
            if status is not None:
                if self.rank == 0:
                    with contextlib.suppress(OSError):
                        retention.remove_dir(path)
                if lost is not None:    # the processes that save a part are gone: not a save
                    raise lost          # failure to retry, a loss for the run's policy
                raise CheckpointError(self._failure_text(step, path, status))
        finally:
            self._writing.discard(path)
        self._own_commit = True
        if prove and writer.proven_records:      # a save that staged nothing proves nothing
            self.staging_proven = True
            log.info("staging proven: the first staged save matched a plain copy (%d tensors)",
                     writer.proven_records)
        elapsed = time.monotonic() - t0
        self.estimator.record(elapsed, writer.write_seconds, self.state.nbytes())
        info = CheckpointInfo(step=step, path=path, reason=reason, committed_at=committed_at,
                              nbytes=nbytes, world_size=self.world_size, save_seconds=elapsed,
                              blocked_seconds=blocked or elapsed)
        log.info("checkpoint step %d committed (%s): %.3f GiB in %.2f s (writing %.2f s) -> %s",
                 step, reason, nbytes / _GIB, elapsed, writer.write_seconds, path)
        if self.rank == 0 and reason != "emergency":
            # In a thread: deleting a large checkpoint takes about a second here, and nobody
            # needs to wait for it (a crash mid-delete leaves only a .trash-* directory). Not
            # after an emergency save: the process is about to exit; the next run cleans up.
            self.join_retention()
            self._retention_thread = threading.Thread(target=self._retention,
                                                      name="ckpt-retention", daemon=True)
            self._retention_thread.start()
        return info

    def join_retention(self) -> None:
        t = self._retention_thread
        if t is not None and t is not threading.current_thread():
            t.join()
        self._retention_thread = None

    def forget_plans(self) -> None:
        """The run is over: its DCP plans go (``RunSavePlanner``)."""
        forget_save_plans(self._planner.__name__)

    def _failure_text(self, step: int, path: Path, status: str) -> str:
        return commit.failure_text(step, path, status, self.root, self._last_good(),
                                   self.config.keep_last)

    def _retention(self) -> None:
        try:
            if self.lease is not None:
                self.lease.check()               # a run that lost its lease deletes nothing
            retention.clean_trash(self.paths, self.run_id, self.leave_alone)
            # Pinned (pinned.json: a partial resume's full checkpoint) are never deleted; an
            # unreadable pin file raises OSError here, and nothing is deleted.
            protect = set(self._writing) | self._unloadable | pinned.read(self.paths)
            if self._resumed_from is not None and not self._own_commit:
                protect.add(self._resumed_from)
            victims = retention.select_for_deletion(layout.scan(self.paths), self.config.keep_last,
                                                 self.config.keep_every, protect,
                                                 run_id=self.run_id, earlier=self.earlier,
                                                 on_skip=self.leave_alone)
            for e in victims:
                if self.lease is not None:
                    self.lease.check()           # again before each: a deletion takes time
                log.info("retention: removing %s checkpoint %s",
                         "old" if e.committed else "abandoned partial", e.path)
                with contextlib.suppress(FileNotFoundError):
                    retention.remove_dir(e.path)
        except LeaseLost:
            log.info("retention in %s skipped: this run lost its lease", self.root)
        except OSError as e:
            log.warning("retention in %s failed (checkpoints are unaffected): %s", self.root, e)

    def leave_alone(self, path: Path, why: str) -> None:
        if path not in self._left_alone:       # once per directory, not at every save
            self._left_alone.add(path)
            log.warning("retention: leaving %s alone: %s", path, why)


def _raise_if_lost(status: str | None) -> None:
    """Every rank raises ``LeaseLost`` when rank 0's status says the lease was lost."""
    if status is not None and status.startswith(commit.LOST_PREFIX):
        raise LeaseLost(status[len(commit.LOST_PREFIX):])
