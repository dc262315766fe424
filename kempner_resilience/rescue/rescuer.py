"""The rescue, start to end: set-up, the per-step mark, and what a survivor does after a failure.

After a peer failure or a hang, each survivor that reaches ``rescue()`` (its training thread
after the collective failed, or its hang watchdog) first offers its snapshots: its own of the
last two boundaries and the ones its predecessor sent it (``files``), and wakes its buddy, which
does the same and passes the wake on (ranks stuck in a collective with live peers learn of the
failure this way). Then:

* a rank whose state is not at its last boundary (an optimizer step began since) says so and
  does not write;
* a rank whose state is, claims the rescue (``O_EXCL``); the first one writes: it waits, within
  half of ``rescue.budget_s``, for every rank's snapshot of its boundary step, then writes and
  commits a normal checkpoint (``save``). Missing snapshots (a rank and its buddy both gone, or
  a rank that died one boundary behind the survivors: a ring all-reduce can finish on some ranks
  before others) mean no rescue: never a checkpoint that mixes steps or guesses a rank's RNG. A
  snapshot stops being waited for ``GIVE_UP_S`` after the rank or its buddy offered all it holds
  without it, so the fallback comes within SLURM's KillWait, not after half the budget; at once
  when the rank died without a word and its buddy offered all of it (``files.died``);
* every other rank waits for the outcome (``done.json``) within the budget, so that rank 0 never
  requeues (which kills the job's tasks) while the writer still writes; a writer known to be
  gone (``files.claimant_gone``: its pid on this host, its claim's heartbeat elsewhere) ends
  that wait within seconds.

The rescue may run beside a live training thread (the hang watchdog's rescue: a stall can end
while it writes). It first freezes the boundary (``Boundary.freeze``: that thread stops at its
next optimizer step or boundary until the process exits), then checks it, and checks again
(``Boundary.generation`` unchanged) after waiting for the snapshots and after the write, before
the commit: a checkpoint of the boundary's step holds that step's tensors or is not committed.

Each rank logs one line with the outcome: the step committed and where, or why nothing was.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kempner_resilience.checkpoint import layout
from kempner_resilience.checkpoint.info import CheckpointError, CheckpointInfo
from kempner_resilience.config import RescueConfig
from kempner_resilience.core.log import get_logger
from kempner_resilience.rescue import files as rfiles
from kempner_resilience.rescue import replicas, sharded
from kempner_resilience.rescue.boundary import Boundary
from kempner_resilience.rescue.link import BuddyLink, buddy_offset, local_address
from kempner_resilience.rescue.save import write_rescue

__all__ = ["Rescuer", "RescueResult"]

log = get_logger(__name__)

CLAIM_WAIT_S = 3.0       # how long a rank that cannot write waits for another one to claim
GIVE_UP_S = 3.0          # how long a snapshot its holders offered without is still waited for
CONNECT_TIMEOUT_S = 60.0
FREEZE_WAIT_S = 5.0      # how long the freeze waits for a step boundary's mark to finish
_POLL_S = 0.02


@dataclass
class RescueResult:
    """What the rescue did, as this rank knows it."""

    step: int | None                  # the boundary step it was (or would have been) for
    info: CheckpointInfo | None       # the committed rescue checkpoint, by any rank
    writer: int | None                # the rank that wrote (or tried to write) it
    why: str | None                   # why nothing was committed
    seconds: float = 0.0


class Rescuer:
    """One rank's part in the rescue; made by ``start`` (collective), or None when off."""

    def __init__(self, config: RescueConfig, ckpt: Any, *, rank: int, world_size: int,
                 attempt: str) -> None:
        self.config = config
        self.ckpt = ckpt
        self.rank = rank
        self.world_size = world_size
        self.files = rfiles.RescueFiles(ckpt.paths, attempt)
        self.boundary = Boundary(ckpt.state)
        self.link = BuddyLink(rank, self._on_wake)
        self._lock = threading.Lock()
        self._woken = False
        self._offered: set[tuple[int, int]] = set()
        self.offset = 1                   # a rank's snapshots also live on rank + offset
        self.shards: sharded.ShardLayout | None = None   # sharded state (HSDP): who holds what
        self._running = threading.Event()
        self._finished = threading.Event()
        self._result: RescueResult | None = None

    # ---------------------------------------------------------------------------- set-up

    @classmethod
    def start(cls, config: RescueConfig, ckpt: Any, *, rank: int,
              world_size: int) -> "Rescuer | None":
        """Collective (the checkpoint manager's group): decide on every rank alike whether the
        rescue is possible, and connect the buddy links. Rank 0 logs why when it is not."""
        state = ckpt.state
        layout, why = sharded.detect(state, world_size)
        why = why or replicas.local_problem(state, sharded_ok=layout is not None)
        fp = replicas.fingerprint(state) if why is None else 0
        self = cls(config, ckpt, rank=rank, world_size=world_size, attempt="")
        self.shards = layout
        host = local_address()
        try:
            addr = self.link.listen(host)
        except OSError as e:
            why, addr = why or f"cannot open the rescue link on {host} ({e})", (host, 0)
        # Rank 0 names this attempt (its rescue files) and the links' shared secret.
        ids = (f"{int(time.time())}-{secrets.token_hex(4)}", secrets.token_bytes(16)) \
            if rank == 0 else None
        gathered = ckpt.comm.all_gather_object((why, fp, addr, socket.gethostname(), ids))
        whys = [f"rank {r}: {g[0]}" for r, g in enumerate(gathered) if g[0]]
        # Sharded: the ranks of one column hold the same local shards (replicas of them).
        columns = layout.columns if layout is not None else (0,) * world_size
        for column in set(columns):
            if not whys and len({g[1] for r, g in enumerate(gathered)
                                 if columns[r] == column}) > 1:
                whys = ["the modules not wrapped in DDP differ across ranks (not replicas)"
                        if layout is None else
                        f"the ranks holding shard column {column} hold different shards "
                        "(not replicas)"]
        if whys:
            self.link.close(clean=False)
            if rank == 0:
                log.warning("rescue off: %s", whys[0])
            return None
        attempt, secret = gathered[0][4]
        self.files = rfiles.RescueFiles(ckpt.paths, attempt)
        offset = buddy_offset([g[3] for g in gathered])
        self.offset = offset
        buddy, pred = (rank + offset) % world_size, (rank - offset) % world_size
        try:
            self.link.connect(buddy, pred, tuple(gathered[buddy][2]), secret, CONNECT_TIMEOUT_S)
        except OSError as e:
            log.warning("rescue link with ranks %d/%d failed (%s): a rescue after this rank "
                        "dies will lack its per-rank state", buddy, pred, e)
        self.boundary.attach()
        if rank == 0:
            rfiles.remove_stale(ckpt.paths, attempt)
            log.info("rescue on: %s; each rank's step state also lives on rank +%d; budget "
                     "%.0f s", f"{world_size} replicas" if layout is None else layout.describe(),
                     offset, config.budget_s)
        return self

    # ----------------------------------------------------------------------------- per step

    def mark(self, step: int) -> None:
        """At every step boundary (the training thread): snapshot, and send it to the buddy."""
        snap = self.boundary.mark(step)
        if snap is not None:
            self.link.send(step, snap.payload, snap.chunks)

    def freeze(self) -> bool:
        """Stop the training thread at its next optimizer step or boundary (any other thread
        than the caller), for good: the hang path calls it as soon as it decided."""
        return self.boundary.freeze(FREEZE_WAIT_S)

    def died(self) -> set[int]:
        """The ranks this rank knows died without a word (killed, or their node gone): its
        predecessor, when its link ended with neither a goodbye nor a wake. A rank that left
        on a failure, or a hung one, is never in it."""
        return {self.link.pred} if self.link.pred_died and self.link.pred >= 0 else set()

    def close(self, clean: bool = True) -> None:
        """The loop ended (or the run stops on purpose): no rescue from here on."""
        self.boundary.detach("the training loop has ended")
        self.link.close(clean=clean)

    # ------------------------------------------------------------------------- the rescue

    def _on_wake(self, reason: str) -> None:
        """Offer every snapshot this rank holds, and pass the wake on (once). Any thread."""
        with self._lock:
            first = not self._woken
            self._woken = True
        if first:
            log.warning("rescue: %s; offering this rank's step state", reason)
        self._offer()
        if first:
            self.link.wake()

    def _offer(self) -> None:
        items = [(self.rank, s) for s in self.boundary.snapshots()]
        items += [(self.link.pred, s) for s in self.link.held()]
        failed = False
        for rank, snap in items:
            step = snap.step
            if (rank, step) in self._offered:
                continue
            try:
                self.files.put(rank, step, snap.whole())
                self._offered.add((rank, step))
            except OSError as e:
                failed = True
                log.warning("rescue: cannot offer rank %d's state of step %d in %s: %s", rank,
                            step, self.files.dir, e)
        if self._woken:
            try:
                self.files.mark_offered(self.rank)
                # A link's end comes after its last byte: once the predecessor died without a
                # word, what this rank holds of it is all there will ever be, and the writer
                # need not wait for more (a live rank one boundary behind still gets its
                # GIVE_UP_S to reach its boundary).
                if self.died() and not failed:
                    self.files.mark_died(self.link.pred)
            except OSError:
                pass

    def rescue(self, reason: str, committed_step: int | None) -> RescueResult:
        """Run the rescue (the first caller in this process; a later one gets its result,
        waiting for it within the budget). Never raises; bounded by ``rescue.budget_s``."""
        with self._lock:
            first = not self._running.is_set()
            self._running.set()
        if not first:
            self._finished.wait(self.config.budget_s)
            return self._result or RescueResult(None, None, None, "the rescue is still running")
        t0 = time.monotonic()
        try:
            result = self._rescue(reason, committed_step, t0)
        except Exception as e:  # noqa: BLE001 - the failure exit must go on
            log.exception("rescue failed")
            result = RescueResult(self.boundary.step, None, None, f"{type(e).__name__}: {e}")
        result.seconds = time.monotonic() - t0
        self._result = result
        self._finished.set()
        return result

    def _rescue(self, reason: str, committed: int | None, t0: float) -> RescueResult:
        deadline = t0 + self.config.budget_s
        # Frozen before the check: the state checked is the state written.
        frozen = self.freeze()
        self._on_wake(f"this rank: {reason}")
        step = self.boundary.step
        generation = self.boundary.generation
        why = self.boundary.why_inconsistent()
        if not frozen:
            why = why or "the training thread did not leave its step boundary's mark"
        if why is None and step is not None and step <= (committed or 0):
            why = f"step {step} is already committed" if committed is not None else \
                "no step completed yet"
        if why is not None:
            log.warning("rescue: this rank cannot write one: %s", why)
            self._contribute(None, generation)
            return self._await_other(step, why, deadline)
        assert step is not None
        try:
            claimed = self.files.claim(self.rank, step)
        except OSError as e:
            log.warning("rescue: cannot claim it in %s: %s", self.files.dir, e)
            self._contribute(step, generation)
            return self._await_other(step, f"the claim could not be written ({e})", deadline)
        if not claimed:
            self._contribute(step, generation)
            return self._await_other(step, None, deadline)
        beat = self.files.heartbeat()
        try:
            return self._write(step, generation, reason, t0, deadline)
        finally:
            beat.stop()

    def _contribute(self, step: int | None, generation: int) -> None:
        """Sharded state: offer this rank's shards of boundary ``step`` (None: not at it)."""
        if self.shards is not None:
            who = self.files.claimant()
            writer = who.get("rank") if who else None
            if isinstance(writer, int) and 0 <= writer < self.world_size and \
                    self.shards.columns[writer] == self.shards.column:
                return      # the writer holds this rank's shards itself
            wanted = who.get("step") if who else None
            if step is not None and isinstance(wanted, int) and wanted != step:
                # The writer writes boundary `wanted` and this rank's shards are of another
                # (it finished a step more before its peer died, or one less): offered at
                # `step`, they would leave the writer waiting out its budget for a column
                # that never comes. Said instead: the writer gives up at once and the run
                # falls back to the newest committed checkpoint.
                log.warning("rescue: rank %s writes step %d and this rank's shards are of "
                            "step %d", writer, wanted, step)
                step = None
            sharded.offer(self.files.dir, self.ckpt.state, self.shards, self.rank, step,
                          lambda: self._moved(step, generation) if step is not None else None)

    def _moved(self, step: int, generation: int) -> str | None:
        """Why the live state is no longer that of boundary ``step`` (None: it still is)."""
        if self.boundary.generation != generation or self.boundary.step != step:
            return (f"the training thread moved past the boundary of step {step} while the "
                    "rescue ran")
        return self.boundary.why_inconsistent()

    def _await_other(self, step: int | None, own_why: str | None,
                     deadline: float) -> RescueResult:
        """Wait for the writer's outcome. Without a claim yet only rank 0 waits (briefly) for
        one: it requeues the job under SLURM, which would kill a writer still writing; any
        other rank leaves, which also wakes the ranks still stuck in a collective with it."""
        claim_end = time.monotonic() + (CLAIM_WAIT_S if self.rank == 0 else 0.0)
        gone = None
        while time.monotonic() < deadline:
            out = self.files.outcome()
            if out is not None:
                return self._from_outcome(out)
            who = self.files.claimant()
            if who is None and time.monotonic() >= claim_end:
                break
            if who is not None:
                gone = self.files.claimant_gone(who)
                if gone is not None:
                    out = self.files.outcome()      # it may have finished just before
                    if out is not None:
                        return self._from_outcome(out)
                    break
            time.sleep(_POLL_S)
        who = self.files.claimant()
        why = own_why or "no rank could write it"
        if who is not None:
            why = (f"rank {who.get('rank', '?')} claimed it but is gone ({gone}); nothing "
                   "committed" if gone else
                   f"rank {who.get('rank', '?')} claimed it but committed nothing within the "
                   "budget")
        log.warning("rescue skipped: %s; the newest committed checkpoint stays the resume point",
                    why)
        return RescueResult(step, None, who.get("rank") if who else None, why)

    def _from_outcome(self, out: dict[str, Any]) -> RescueResult:
        writer, step = out.get("writer"), out.get("step")
        if out.get("committed"):
            entry = layout.scan_one(Path(out["path"]))
            if entry is not None and entry.committed:
                log.warning("rescue: rank %s committed step %s at %s", writer, step, entry.path)
                return RescueResult(step, entry.info(), writer, None)
            why = f"rank {writer} reported a commit at {out['path']} that is not there"
        else:
            why = out.get("why") or "?"
        log.warning("rescue skipped: %s; the newest committed checkpoint stays the resume point",
                    why)
        return RescueResult(step, None, writer, why)

    def _write(self, step: int, generation: int, reason: str, t0: float,
               deadline: float) -> RescueResult:
        need = set(range(self.world_size))
        wait_end = t0 + self.config.budget_s / 2
        waited = time.monotonic()
        said = False
        hopeless: dict[int, float] = {}   # rank -> when its holders had offered without it
        # Sharded state: the shards of every other column, from one of its holders.
        layout = self.shards
        missing_cols: set[int] = set()
        while True:
            self._offer()          # snapshots that arrived from the predecessor meanwhile
            missing = need - self.files.ranks_at(step)
            if layout is not None:
                missing_cols = sharded.missing(self.files.dir, layout, step)
            now = time.monotonic()
            if (not missing and not missing_cols) or now >= min(wait_end, deadline):
                break
            offered = self.files.offered()
            for r in missing:
                if r in offered or (r + self.offset) % self.world_size in offered:
                    hopeless.setdefault(r, now)
            ranks_done = False
            if missing and missing <= hopeless.keys():    # only then can the dead matter
                dead = self.files.died()
                ranks_done = all(r in dead or now - hopeless[r] >= GIVE_UP_S for r in missing)
            cols_done = layout is not None and sharded.hopeless(
                self.files.dir, layout, missing_cols, offered, now - waited, GIVE_UP_S)
            if ranks_done or cols_done:     # either one is enough to give up
                break
            if not said and time.monotonic() - waited > 1.0:
                said = True
                what = [f"rank(s) {sorted(missing)}"] if missing else []
                what += [f"shard column(s) {sorted(missing_cols)}"] if missing_cols else []
                log.warning("rescue: waiting up to %.0f s for the state of step %d from %s "
                            "(have: %s)", wait_end - time.monotonic(), step, " and ".join(what),
                            self.files.listing())
            time.sleep(_POLL_S)
        waited = time.monotonic() - waited
        blobs = {r: self.files.get(r, step) for r in sorted(need - missing)}
        missing |= {r for r, b in blobs.items() if b is None}
        if missing:
            return self._done(step, None, self._why_missing(step, missing))
        shards = None
        if layout is not None:
            shards, why = sharded.collect(self.files.dir, layout, step, missing_cols)
            if why is not None:
                return self._done(step, None, why)
        moved = self._moved(step, generation) or ("another run took checkpoint.dir over (the "
                                                  "lease)" if self.ckpt.lease_lost else None)
        if moved is not None:
            return self._done(step, None, moved)
        cfg = self.ckpt.config
        extra = {**self.ckpt.manifest_extra,
                 "rescue": {"reason": reason, "writer_rank": self.rank,
                            "world_size": self.world_size, "attempt": self.files.dir.name,
                            **({} if layout is None else
                               {"sharded": {"mesh": layout.mesh, "columns": layout.count}}),
                            "waited_for_state_s": round(waited, 4),
                            "detected_to_write_s": round(time.monotonic() - t0, 4)}}
        try:
            info = write_rescue(self.ckpt.state, self.boundary, blobs, step,
                                paths=self.ckpt.paths, run_id=self.ckpt.run_id,
                                io_threads=cfg.io_threads, world_size=self.world_size,
                                extra=extra, shards=shards,
                                still_valid=lambda: self._moved(step, generation))
        except CheckpointError as e:
            return self._done(step, None, str(e))
        log.warning("rescue: committed step %d at %s, %.2f s after the failure (rank %d wrote "
                    "it: %s)", step, info.path, time.monotonic() - t0, self.rank, reason)
        return self._done(step, info, None)

    def _why_missing(self, step: int, missing: set[int]) -> str:
        """Why the state of ``step`` is not whole. A rank that died after its step's
        all-reduce but before its boundary (a long post-step phase: a weight sync, an eval) is
        one boundary behind the survivors: its buddy, alive, offered only the older boundary,
        and a checkpoint of mixed steps is never written. Otherwise the rank and its buddy are
        both gone or stuck."""
        offered, dead = self.files.offered(), self.files.died()
        behind = []
        for r in sorted(missing):
            held = [s for s in self.files.steps_of(r) if s < step]
            buddy = (r + self.offset) % self.world_size
            if held and (buddy in offered or r in offered):
                saw = " and saw it die" if r in dead else ""
                behind.append(f"rank {r} is one boundary behind, at step {held[-1]} (its buddy, "
                              f"rank {buddy}, holds that{saw})")
        head = f"no state of step {step} from rank(s) {sorted(missing)}"
        if len(behind) == len(missing):
            return (f"{head}: {'; '.join(behind)}; it died after its step's all-reduce, before "
                    "its boundary")
        return (f"{head} (each rank's RNG and data position live only on it and its buddy: "
                "both gone or stuck" + (f"; {'; '.join(behind)}" if behind else "") + ")")

    def _done(self, step: int, info: CheckpointInfo | None, why: str | None) -> RescueResult:
        out = {"committed": info is not None, "step": step, "writer": self.rank, "why": why,
               "path": None if info is None else str(info.path)}
        try:
            self.files.finish(out)
        except OSError as e:
            log.warning("rescue: cannot record the outcome in %s: %s", self.files.dir, e)
        if info is None:
            log.warning("rescue skipped: %s; the newest committed checkpoint stays the resume "
                        "point", why)
        return RescueResult(step, info, self.rank, why)
