"""Stop agreement: every rank leaves the training loop at the same step, whoever got the signal.

SLURM may signal only some ranks, and each sees it at a different moment. The first rank whose
step boundary finds a shutdown request publishes ``stop_at = n + 2`` to the key-value store that
``init_process_group`` already runs (compare-and-set: the first writer wins, everyone reads the
same value). Every rank checks that key once per step (one store round trip, ~20-50 us).

Why ``n + 2`` is enough: a training step has a collective, so no rank can finish step ``n + 1``
before every rank has started it. When the publisher is at boundary ``n``, no rank has passed
boundary ``n + 1``, so each one reads the key at a boundary no later than ``n + 2``. Ranks that
run no collective per step can drift further apart; ``StopAgreement`` then detects a rank that
is already past ``stop_at`` and stops it where it is, with an error in the log.

The check off the step's path: where every collective blocks the CPU until it completes (the
default group is gloo and CUDA is not in use), a rank cannot finish step ``n`` before the
publisher has started it, that is after its publication. So a check issued at boundary ``n + 1``
sees the key, and its answer can wait until boundary ``n + 2``, the agreed step: a thread runs
it while the step runs. With CUDA (NCCL) the CPU may run ahead of the collectives, and only a
check issued at the boundary itself is sure to see the key: there it stays on the step's path.
A boundary whose previous one issued no check (the first, or one reached again) checks itself;
an answer still on its way is waited for, never skipped (a 1 ms step).

The same key carries the stops that are no signal (``reason.py``): the allocation's end (each
rank's clock, the first to see it publishes), and rank 0's lost lease (``checkpoint/lease.py``:
another run took ``checkpoint.dir`` over). Only rank 0 holds the lease, so only it can know;
every rank then stops at the agreed step with LEASE_LOST.
"""

from __future__ import annotations

import datetime
import os
import queue
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kempner_resilience.core.fileio import read_bounded
from kempner_resilience.core.log import get_logger
from kempner_resilience.stop.reason import StopKind, StopReason

__all__ = ["StopAgreement", "StopDecision", "StopReason"]

log = get_logger(__name__)

KEY = "kempner_resilience/stop_at"
CODE_KEY = "kempner_resilience/exit_code"
FORCED_KEY = "kempner_resilience/forced_exit"


@dataclass(frozen=True)
class StopDecision:
    """All ranks stop at boundary ``step`` because of ``reason`` (some rank's)."""

    step: int
    reason: StopReason
    local: bool  # this rank had a reason of its own (a signal, its clock)

    @property
    def lease_lost(self) -> bool:
        """No signal: rank 0 lost checkpoint.dir's lease; nothing is saved."""
        return self.reason.kind is StopKind.LEASE_LOST


class StopAgreement:
    """Per-step stop check; cheap single-process path, one store lookup per step otherwise."""

    def __init__(self, store: Any | None = None, *, rank: int = 0, world_size: int = 1,
                 group: Any | None = None, lead_steps: int = 2,
                 ahead: bool = False) -> None:
        self.store = store if world_size > 1 else None
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.lead_steps = lead_steps
        # The check may be issued one boundary ahead (module doc): the caller knows every
        # collective blocks the CPU (a gloo default group); CUDA in use is checked per step.
        self.ahead = ahead and self.store is not None
        if self.ahead:   # (a caller with a gloo group has torch loaded already)
            import torch.cuda

            # CUDA initialised in this process: its collectives (NCCL) may let the CPU run
            # ahead, and the check goes back on the step's path.
            self._cuda_in_use = torch.cuda.is_initialized
        self._asked: int | None = None      # the boundary whose check the thread runs
        self._asks: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._answers: queue.SimpleQueue[bool | BaseException] = queue.SimpleQueue()
        self._checker: threading.Thread | None = None
        self._decided: StopDecision | None = None
        self._stop_at: int | None = None
        self._reason: StopReason | None = None
        self._agreed_now = False
        self._marker: Path | None = None

    @classmethod
    def from_torch(cls) -> "StopAgreement":
        """Use the default process group's store when torch.distributed is initialized."""
        if "torch.distributed" not in sys.modules:  # no process group without the module
            return cls()
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls()
        store = dist.distributed_c10d._get_default_store()
        return cls(store, rank=dist.get_rank(), world_size=dist.get_world_size(),
                   ahead=dist.get_backend() == "gloo")

    @property
    def distributed(self) -> bool:
        return self.store is not None

    def poll(self, step: int, local: StopReason | None,
             lease_lost: bool = False, fresh: bool = False) -> StopDecision | None:
        """Call at every step boundary ``step``; returns the decision once this rank must stop.
        ``local``: this rank's own reason (a signal, the allocation's end); ``lease_lost``: this
        rank (rank 0) lost the directory's lease, a stop of its own. ``fresh``: the step just
        ended a gradient-accumulation window, so the key is read now (``_key_set``)."""
        if self._decided is not None:
            return self._decided
        if self._agreed_now:
            # every rank saw any_requested() return True at the same call: stop right here.
            assert self._reason is not None
            self._decided = StopDecision(step, self._reason, local is not None)
            return self._decided
        if self.store is None:
            if lease_lost:
                self._decided = StopDecision(step, StopReason.LEASE_LOST, False)
                return self._decided
            if local is None:
                return None
            self._decided = StopDecision(step, local, True)
            return self._decided
        if self._stop_at is None:
            if local is not None or lease_lost:
                self._publish(step, local or StopReason.LEASE_LOST)
            elif self._key_set(step, fresh):
                self._read()
            if self._stop_at is None:
                if self.ahead:
                    self._ask(step)
                return None
        if step < self._stop_at:
            return None
        if step > self._stop_at:
            log.error("this rank reached step %d before it saw the agreed stop step %d: ranks "
                      "are drifting apart (no collective per step?); stopping here", step,
                      self._stop_at)
        assert self._reason is not None
        self._decided = StopDecision(step, self._reason, local is not None)
        return self._decided

    def stop_at(self) -> int | None:
        return self._stop_at

    def _key_set(self, step: int, fresh: bool = False) -> bool:
        """Whether some rank published a stop, as a check issued at boundary ``step - 1`` saw
        it where that is enough (module doc), else as a check now. ``fresh``: a check now.
        Inside a gradient-accumulation window no step has a collective, so a rank may run a
        whole window ahead: its check issued before the window's closing all-reduce can miss
        a stop published while it waited there, and the window's end is the boundary where
        every rank must know the stop (``run/window.py``)."""
        asked, self._asked = self._asked, None
        if asked is not None:
            found = self._answers.get()    # waits only while that check is still on its way
            if isinstance(found, BaseException):
                raise found              # as the check on this thread would have
            if asked == step - 1 and not fresh and not self._cuda_in_use():
                return found
        return self.store.check([KEY])

    def _ask(self, step: int) -> None:
        """Have the thread check the key while step ``step`` runs."""
        if self._checker is None:
            self._checker = threading.Thread(target=self._checks, name="kempner-stop-check",
                                             daemon=True)
            self._checker.start()
        self._asked = step
        self._asks.put(step)

    def _checks(self) -> None:
        while self._asks.get() is not None:
            store = self.store
            try:
                self._answers.put(store is not None and store.check([KEY]))
            except Exception as e:  # noqa: BLE001 - raised on the main thread, at its poll
                self._answers.put(e)

    def agreed_reason(self) -> StopReason | None:
        """The reason of a stop this rank has agreed to (via ``poll`` or ``any_requested``)."""
        if self._decided is not None:
            return self._decided.reason
        if self._agreed_now or self._stop_at is not None:
            return self._reason
        return None

    def _publish(self, step: int, reason: StopReason) -> None:
        want = f"{step + self.lead_steps}:{reason.encode()}"
        got = self.store.compare_set(KEY, "", want)
        self._parse(got)
        if got.decode() == want:
            log.warning("%s here at step %d: all ranks stop at step %d",
                        "the lease lost" if reason.kind is StopKind.LEASE_LOST else reason.word,
                        step, self._stop_at)

    def _read(self) -> None:
        self._parse(self.store.get(KEY))

    def _parse(self, raw: bytes) -> None:
        at, reason = raw.decode().split(":", 1)
        self._stop_at, self._reason = int(at), StopReason.decode(reason)

    def any_requested(self, local: StopReason | None, timeout_s: float = 600.0) -> bool:
        """Collective: True on every rank when any rank has a request (for ``should_stop``).

        Every rank must call it the same number of times, like any collective. Once it returned
        True, the next ``poll`` stops every rank at that boundary.
        """
        if self.store is None:
            if local is not None:
                self._reason, self._agreed_now = self._reason or local, True
            return local is not None or self._decided is not None
        import torch
        import torch.distributed as dist

        if self.group is None:
            # Our own gloo group: the default group may be NCCL-only (no CPU tensors), and
            # nothing of ours may enqueue work on the user's communicator. Made here, at the
            # first call, because new_group is collective over the default group and so is
            # this method (every rank reaches it at the same point); entering a run is not.
            self.group = dist.new_group(backend="gloo")
        mine = local or self._reason
        # A lost lease is no reason here: it stops through poll, agreed through the store.
        flag = torch.tensor([mine.order if mine is not None and
                             mine.kind is not StopKind.LEASE_LOST else 0])
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        work.wait(datetime.timedelta(seconds=timeout_s))
        agreed = StopReason.from_order(int(flag.item()))
        if agreed is not None:
            self._reason = self._reason or agreed
            self._agreed_now = True
        return agreed is not None

    def share_text(self, name: str, text: str | None, timeout_s: float, *,
                   readers_s: float = 0.0) -> str:
        """Rank 0's ``text`` on every rank, through the store (a value only rank 0 decides:
        the run id, the allocation's end). Single process: ``text`` itself.

        ``readers_s`` > 0: rank 0 returns only once every other rank has read the value, or
        after ``readers_s``. For the last value shared before the ranks exit (the requeue
        verdict): rank 0 hosts the store under srun and the local launcher, and a rank 0 that
        exits right after its ``set`` takes the store with it while a slower rank is still
        between its ``wait`` and its ``get`` (that rank then exits REQUEUE_FAILED for a requeue
        that happened)."""
        if self.store is None:
            assert text is not None
            return text
        key = f"kempner_resilience/{name}"
        done_key = f"{key}/all-read"
        if self.rank == 0:
            assert text is not None
            self.store.set(key, text)
            if readers_s > 0:
                try:
                    self.store.wait([done_key], datetime.timedelta(seconds=readers_s))
                except Exception as e:   # a rank is gone or slow: it learns nothing more late
                    log.debug("not every rank read %s within %.1f s: %s", name, readers_s, e)
            return text
        self.store.wait([key], datetime.timedelta(seconds=max(timeout_s, 1.0)))
        value = self.store.get(key).decode()
        if readers_s > 0:
            # The last reader tells rank 0 (one key to wait on, not a count to poll).
            if self.store.add(f"{key}/read", 1) == self.world_size - 1:
                self.store.set(done_key, "1")
        return value

    def release(self) -> None:
        """The run is over: drop this object's reference to the store. The store then goes
        with the process group when the script destroys it, as without this package, instead of
        living on into the interpreter's finalisation, where destroying rank 0's store server
        (its thread) aborted a finished FSDP2 rank now and then ("terminate called without an
        active exception", exit -6: a completed job recorded FAILED)."""
        self.store = None
        checker, self._checker = self._checker, None
        if checker is not None:   # no check of ours in flight while the store goes
            self._asks.put(None)
            checker.join(2.0)

    def use_forced_marker(self, marker: Path) -> None:
        """Announce forced exits also as the file ``marker`` (``RunPaths.forced_marker`` of
        this attempt's token, the same on every rank). The store dies with its host, rank 0:
        when rank 0 is the rank forced out, the others find its announcement only in the
        checkpoint directory, which every rank shares. The name is new in every attempt, so no
        rank has looked it up (and cached its absence, as an NFS client does) before it is
        written."""
        if self.store is not None:
            self._marker = marker

    def announce_forced_exit(self, code: int) -> None:
        """This rank is about to be forced out with ``code`` (a repeated SIGTERM/SIGINT): tell
        the others, so every rank's exit code says what happened to the job, not only this one's.
        Through the store (quick), then the marker file (which outlives the store's host)."""
        if self.store is None:
            return
        text = f"{int(code)}:{self.rank}"

        def tell_store() -> None:
            try:
                self.store.set(FORCED_KEY, text)
            except Exception:    # the store's host is gone: the marker still tells
                pass

        # Side by side: a store whose host is gone may block the set, a slow filesystem the
        # write, and the forced exit gives its hooks about a second in all.
        setter = threading.Thread(target=tell_store, name="kempner-forced-exit-set",
                                  daemon=True)
        setter.start()
        if self._marker is not None:
            tmp = self._marker.with_name(f"{self._marker.name}.{self.rank}.tmp")
            try:
                tmp.write_text(text)
                os.replace(tmp, self._marker)   # whole or absent, never a half-written text
            except OSError:
                pass
        setter.join(1.0)

    def forced_exit(self, timeout_s: float = 3.0) -> tuple[int, int] | None:
        """(code, rank) when some rank announced a forced exit; None otherwise or when neither
        the marker nor the store answers within ``timeout_s`` (the store's host, rank 0, may be
        the one that left, or be paused: a SIGSTOPped rank 0's store answers nothing, and a
        store read waits on its socket beyond the store's timeout). With a marker in use, only
        the marker is read: every rank announcing a forced exit writes it before it leaves, and
        a store read with rank 0 gone (rank 0 leaves as soon as its own shutdown is done) fails
        with a C++ stack trace from torch in the user's log. The read runs in a daemon thread,
        left behind if it does not return (a hung filesystem): the process is on its way out,
        through ``os._exit``."""
        if self.store is None:
            return None
        box: list[tuple[int, int] | None] = []
        read = self._read_marker if self._marker is not None else self._read_forced
        reader = threading.Thread(
            target=lambda: box.append(read()),
            name="kempner-forced-exit-read", daemon=True)
        reader.start()
        reader.join(timeout_s)
        return box[0] if box else None

    def _read_marker(self) -> tuple[int, int] | None:
        if self._marker is None:
            return None
        try:
            # Bounded: a marker replaced by a FIFO or a link to /dev/zero is no announcement.
            return _parse_forced(read_bounded(self._marker, 4096).decode())
        except (OSError, ValueError):
            return None

    def _read_forced(self) -> tuple[int, int] | None:
        try:
            if not self.store.check([FORCED_KEY]):
                return None
            return _parse_forced(self.store.get(FORCED_KEY).decode())
        except Exception:
            return None


def _parse_forced(text: str) -> tuple[int, int]:
    code, rank = text.strip().split(":")
    return int(code), int(rank)
