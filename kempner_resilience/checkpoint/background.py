"""The async periodic save: at most one in flight, staged into host memory in the caller's
thread (training may change the state as soon as ``start`` returns), then written and
committed by a thread of its own on the manager's background gloo group, so it never
interleaves its collectives with the foreground's or training's. The manager decides when; this
module runs one and hands back how it ended."""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from kempner_resilience.checkpoint.comm import Comm
from kempner_resilience.checkpoint.info import CheckpointError, CheckpointInfo, describe_error
from kempner_resilience.checkpoint.staging import Stager
from kempner_resilience.core.log import get_logger

__all__ = ["Flight", "BackgroundSaver", "SaveFn"]

log = get_logger(__name__)

#: ``Saver.save``'s shape as the manager wraps it: (state dict, step, reason, comm, abort, t0,
#: seconds training was blocked) -> the committed checkpoint.
SaveFn = Callable[[dict[str, Any], int, str, Comm, "threading.Event | None", float, float],
                  CheckpointInfo]


class Flight:
    """One async save in flight: its step, staged bytes, thread, and how it ended."""

    def __init__(self, step: int, nbytes: int) -> None:
        self.step = step
        self.nbytes = nbytes
        self.started = time.monotonic()
        self.abort = threading.Event()
        self.thread: threading.Thread | None = None
        self.info: CheckpointInfo | None = None
        self.error: BaseException | None = None

    @property
    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


class BackgroundSaver:
    """Runs async saves through ``save`` on ``comm`` (the background group), one at a time.
    Snapshots are pinned when ``pin``; ``max_failed_saves`` is only for the log line."""

    def __init__(self, save: SaveFn, comm: Comm, *, pin: bool, max_failed_saves: int) -> None:
        self._save = save
        self._comm = comm
        self._stager = Stager(pin=pin)
        self._max_failed = max_failed_saves
        self._flight: Flight | None = None
        self._prewarmed = False

    @property
    def running(self) -> Flight | None:
        """The save whose thread still runs, or None."""
        fl = self._flight
        return fl if fl is not None and fl.alive else None

    def prewarm(self, tensor_state: Callable[[], dict[str, Any]]) -> None:
        """Allocate the snapshot's buffers in the background (``Stager.prewarm``), once: at
        the first step that is no save, when the optimizer's state exists (it appears at the
        first ``step()``), so the first async save does not allocate them with training held."""
        if not self._prewarmed:
            self._prewarmed = True
            self._stager.prewarm(tensor_state())

    def start(self, sd: dict[str, Any], step: int, t0: float, failed_in_a_row: int) -> None:
        """Snapshot ``sd`` (captured since ``t0``) and write it in a thread. The caller has
        finished the previous one (``finish``); ``failed_in_a_row`` is for its log line."""
        staged = self._stager.stage(sd)
        self._stager.synchronize()
        blocked = time.monotonic() - t0
        fl = Flight(step, self._stager.staged_bytes)
        fl.thread = threading.Thread(target=self._run,
                                     args=(fl, staged, t0, blocked, failed_in_a_row),
                                     name="ckpt-async-save", daemon=True)
        self._flight = fl
        fl.thread.start()

    def _run(self, fl: Flight, staged: dict[str, Any], t0: float, blocked: float,
             failed_in_a_row: int) -> None:
        try:
            fl.info = self._save(staged, fl.step, "periodic-async", self._comm, fl.abort, t0,
                                 blocked)
        except BaseException as e:  # reported by finish()/logged here; never kills the thread
            fl.error = e
            if fl.abort.is_set():
                log.info("async checkpoint of step %d abandoned for the emergency save", fl.step)
            elif isinstance(e, CheckpointError):
                # Counted when the next save is due, in the foreground, where all ranks agree.
                log.warning("async %s Training goes on; the next periodic save tries again (%d "
                            "of checkpoint.max_failed_saves=%d failed in a row).", e,
                            failed_in_a_row + 1, self._max_failed)
            else:
                log.error("async checkpoint of step %d failed: %s", fl.step, describe_error(e))

    def leave_behind(self) -> None:
        """Forget a save whose thread did not stop when asked: it writes into a step directory
        of its own that nothing will commit, and nothing waits for it."""
        self._flight = None

    def finish(self) -> Flight | None:
        """Wait for the save in flight and hand it back (its ``info`` or ``error``); None when
        there is none."""
        fl, self._flight = self._flight, None
        if fl is not None and fl.thread is not None:
            fl.thread.join()
        return fl
