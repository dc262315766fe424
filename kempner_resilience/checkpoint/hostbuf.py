"""Host staging buffers for device (CUDA) state: allocated once at start, reused by every save
and every load.

Why: a CUDA tensor's bytes must be in host memory to be written. ``t.cpu()`` per tensor
allocates fresh pageable memory at every save, and the copy into it runs at 1.2-1.35 GiB/s on a
GPU node (first-touch page faults); into memory that already exists the same copy runs at
~10 GiB/s (pageable) or ~50 GiB/s (pinned, and without blocking the host). Pinning costs about
1 s per GiB, so the buffers are allocated when the run is set up, never on the signal path.

Layout: one ``Slot`` per I/O thread (``checkpoint.io_threads``), two chunk buffers per slot, all
chunks of one power-of-two size (the CUDA host allocator rounds a pinned block up to a power of
two: any other size would waste the difference), ``slots x 2 x chunk`` within
``checkpoint.staging_cap_gib``. A writer thread copies device bytes into one chunk (on a side
stream, not blocking) while it writes the other to disk; a reader thread reads the file into
one chunk while the other is copied to the device. A chunk is refilled only once what used it
(the write, the copy to the device) has completed (``Chunk.wait``).

Only the device specifics depend on CUDA: pinned memory, the side streams, events and
``non_blocking``. With ``KEMPNER_RESILIENCE_STAGE_CPU=1`` (for tests and benchmarks only) CPU
tensors go through the same chunks, so every other line of the pipeline (chunking, the ring,
CRCs over the staged bytes, resume through staging) runs on machines without a GPU.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Iterator

import torch

from kempner_resilience.checkpoint import recordfmt
from kempner_resilience.config import CheckpointConfig, StagingMode
from kempner_resilience.core.log import get_logger

__all__ = ["HostStaging", "Slot", "Chunk", "ENV_STAGE_CPU", "ENV_STAGE_CPU_GIBPS", "flat_bytes", "chunk_layout", "reserve"]

if TYPE_CHECKING:
    from kempner_resilience.checkpoint.directio import DirectPool
    from kempner_resilience.checkpoint.state import TrainState

log = get_logger(__name__)

ENV_STAGE_CPU = "KEMPNER_RESILIENCE_STAGE_CPU"
"""Set to 1 to stage CPU tensors too (tests and benchmarks: the pipeline without a GPU)."""

ENV_STAGE_CPU_GIBPS = "KEMPNER_RESILIENCE_STAGE_CPU_GIBPS"
"""With ``KEMPNER_RESILIENCE_STAGE_CPU=1`` (tests and benchmarks only): a CPU tensor's copy into a
chunk becomes a stand-in for the device-to-host copy: asynchronous (a copy thread per slot;
``Chunk.wait`` waits for it, as for a CUDA event) and paced to this many GiB/s for all slots
together (one link, as PCIe is one), so the overlap of copies and writes can be shown and
measured on a machine without a GPU."""


class _Link:
    """The stand-in's shared link: copies take turns at ``gibps`` (``ENV_STAGE_CPU_GIBPS``)."""

    def __init__(self, gibps: float) -> None:
        self.gibps = gibps
        self._free_at = 0.0
        self._lock = threading.Lock()

    def pace(self, nbytes: int) -> None:
        """Sleep until a copy of ``nbytes`` that queued now would be through the link."""
        with self._lock:
            start = max(time.monotonic(), self._free_at)
            self._free_at = done = start + nbytes / (self.gibps * 2**30)
        time.sleep(max(0.0, done - time.monotonic()))

_MAX_CHUNK = 8 << 20      # small enough that filling and draining the pipeline costs little
_GOOD_CHUNK = 4 << 20     # below this, per-chunk overheads (syscalls, events) start to show
_MIN_CHUNK = 4 << 10


def flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A 1-D uint8 view of a contiguous tensor's bytes, on its own device (no copy)."""
    flat = t.reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def _floor_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _ceil_pow2(n: int) -> int:
    return 1 << (max(n, 1) - 1).bit_length()


def chunk_layout(cap_bytes: int, threads: int, state_bytes: int) -> tuple[int, int]:
    """(slots, chunk bytes) for ``threads`` I/O threads within ``cap_bytes``: one slot of two
    chunks per thread, chunks a power of two, at most 8 MiB, no larger than a thread's share
    of the state needs (but at least 4 MiB when the cap allows). Below 8 KiB per slot, fewer
    slots (threads without one save as without staging); never less than one slot of 4 KiB
    chunks (8 KiB in all, whatever the cap)."""
    slots = max(1, threads)
    if cap_bytes // (2 * slots) < _MIN_CHUNK:
        return max(1, cap_bytes // (2 * _MIN_CHUNK)), _MIN_CHUNK
    chunk = min(_MAX_CHUNK, _floor_pow2(cap_bytes // (2 * slots)))
    share = _ceil_pow2(-(-max(state_bytes, 1) // (2 * slots)))
    return slots, min(chunk, max(share, _GOOD_CHUNK))


class Chunk:
    """One host buffer, its bytes as a memoryview, and what must finish before it is reused."""

    def __init__(self, buf: torch.Tensor) -> None:
        self.buf = buf
        self.view = recordfmt.bytes_view(buf)      # valid while self.buf lives
        self.nbytes = buf.numel()
        self._events: list[Any] = []             # CUDA events after the copies issued so far
        self._streams: set[Any] = set()          # side streams with copies not yet marked
        self.hold: list[torch.Tensor] = []       # device tensors an async copy still touches
        self.jobs: list[Future[None]] = []       # stand-in device copies (ENV_STAGE_CPU_GIBPS)

    def used_by(self, stream: Any) -> None:
        self._streams.add(stream)

    def seal(self) -> None:
        """Mark the end of the copies issued into/out of this chunk (``wait`` waits for them)."""
        for stream in self._streams:
            ev = torch.cuda.Event()
            ev.record(stream)
            self._events.append(ev)
        self._streams.clear()

    def wait(self) -> None:
        """Block until every copy into or out of this chunk has completed."""
        self.seal()
        for ev in self._events:
            ev.synchronize()
        self._events.clear()
        jobs, self.jobs = self.jobs, []
        for job in jobs:
            job.result()
        self.hold.clear()


class Slot:
    """What one I/O thread stages through: two chunks and, on CUDA, its own side streams."""

    def __init__(self, chunks: list[Chunk], link: _Link | None = None) -> None:
        self.chunks = chunks
        # The stand-in for the device copy (tests and benchmarks): one copy thread, paced.
        self._link = link
        self._copier = ThreadPoolExecutor(1, thread_name_prefix="ckpt-stand-in-copy") \
            if link is not None else None
        self.staged_bytes = 0
        self._streams: dict[int, Any] = {}
        self._ready: set[int] = set()
        self._caller_streams: dict[int, Any] = {}

    def begin(self, caller_streams: dict[int, Any] | None = None) -> None:
        """Start one file: the side streams first wait for the work queued on
        ``caller_streams`` (device index -> the stream the caller's thread used), else on each
        device's current stream, so no copy reads or overwrites memory a kernel still uses."""
        self._ready.clear()
        self._caller_streams = caller_streams or {}

    def _stream(self, device: torch.device) -> Any:
        idx = device.index if device.index is not None else torch.cuda.current_device()
        stream = self._streams.get(idx)
        if stream is None:
            stream = self._streams[idx] = torch.cuda.Stream(device=idx)
        if idx not in self._ready:
            stream.wait_stream(self._caller_streams.get(idx) or torch.cuda.current_stream(idx))
            self._ready.add(idx)
        return stream

    def prepare(self, device: torch.device) -> None:
        """Create the side stream for ``device`` now (at set-up, not during a save)."""
        if device.type == "cuda":
            idx = device.index if device.index is not None else torch.cuda.current_device()
            if idx not in self._streams:
                self._streams[idx] = torch.cuda.Stream(device=idx)

    def to_host(self, chunk: Chunk, offset: int, src: torch.Tensor) -> None:
        """Copy the uint8 tensor ``src`` into ``chunk`` at ``offset`` (CUDA: asynchronous)."""
        self._copy(chunk.buf[offset:offset + src.numel()], src, chunk, src)

    def to_device(self, dst: torch.Tensor, chunk: Chunk, offset: int) -> None:
        """Copy ``chunk`` bytes at ``offset`` into the uint8 tensor ``dst`` (CUDA: asynchronous,
        from pinned memory without blocking; the chunk is reused only after ``chunk.wait``)."""
        self._copy(dst, chunk.buf[offset:offset + dst.numel()], chunk, dst)

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, chunk: Chunk,
              device_side: torch.Tensor) -> None:
        # The device tensor is held until the chunk's event: the copy may still be reading it.
        if device_side.is_cuda:
            stream = self._stream(device_side.device)
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
            chunk.used_by(stream)
            chunk.hold.append(device_side)
        elif self._copier is not None:
            chunk.jobs.append(self._copier.submit(self._paced_copy, dst, src))
        else:
            dst.copy_(src)
        self.staged_bytes += dst.numel()

    def _paced_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """The stand-in device copy: the bytes, done when the shared link has carried them."""
        assert self._link is not None
        dst.copy_(src)
        self._link.pace(dst.numel())

    def quiesce(self) -> None:
        """Wait for every copy of this slot (the end of a file, or of a failed save)."""
        for chunk in self.chunks:
            chunk.wait()


def caller_streams() -> dict[int, Any]:
    """The calling thread's current stream on its current CUDA device (empty when CUDA was
    never used): I/O threads order their copies after the work queued there. Other devices
    are not touched (asking for their streams could create a context on each GPU)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return {}
    return {torch.cuda.current_device(): torch.cuda.current_stream()}


class HostStaging:
    """The host buffers of one ``CheckpointManager``: ``lease()`` one slot per I/O thread.

    Built by ``allocate``; ``mode`` is what was allocated (``pinned`` falls back to
    ``pageable``), ``nbytes`` the host memory it holds. ``wants(t)`` says whether a tensor's
    bytes go through it (CUDA tensors; CPU tensors too with ``stage_cpu``).
    """

    def __init__(self, slots: list[Slot], mode: StagingMode, chunk_bytes: int, *,
                 stage_cpu: bool = False) -> None:
        self.slots = slots
        self.mode = mode
        self.chunk_bytes = chunk_bytes
        self.stage_cpu = stage_cpu
        self._free = list(reversed(slots))
        self._lock = threading.Lock()

    @classmethod
    def allocate(cls, mode: StagingMode, cap_bytes: int, threads: int, state_bytes: int, *,
                 stage_cpu: bool = False, device: torch.device | None = None) -> "HostStaging":
        """Allocate (and touch) the buffers now. ``pinned`` without CUDA, or when pinning
        fails, gives ``pageable`` with one info line saying so."""
        if mode is StagingMode.OFF:
            raise ValueError("staging is off: nothing to allocate")
        nslots, chunk = chunk_layout(cap_bytes, threads, state_bytes)
        if mode is StagingMode.PINNED and not torch.cuda.is_available():
            log.info("checkpoint.staging: pinned needs CUDA, which is not available here; "
                     "using pageable host buffers")
            mode = StagingMode.PAGEABLE
        bufs: list[torch.Tensor] = []
        if mode is StagingMode.PINNED:
            try:
                bufs = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True)
                        for _ in range(2 * nslots)]
            except RuntimeError as e:
                log.info("checkpoint.staging: pinning %d MiB of host memory failed (%s); "
                         "using pageable host buffers", 2 * nslots * chunk >> 20,
                         str(e).splitlines()[0] if str(e) else type(e).__name__)
                bufs = []
                mode = StagingMode.PAGEABLE
        if mode is StagingMode.PAGEABLE:
            # Touched now: first-touch page faults would otherwise slow the first save.
            bufs = [torch.zeros(chunk, dtype=torch.uint8) for _ in range(2 * nslots)]
        gibps = float(os.environ.get(ENV_STAGE_CPU_GIBPS, "0") or 0) if stage_cpu else 0.0
        link = _Link(gibps) if gibps > 0 else None
        slots = [Slot([Chunk(bufs[2 * i]), Chunk(bufs[2 * i + 1])], link)
                 for i in range(nslots)]
        if device is not None:
            for slot in slots:
                slot.prepare(device)
        return cls(slots, mode, chunk, stage_cpu=stage_cpu)

    @property
    def nbytes(self) -> int:
        """Host memory held by the buffers."""
        return sum(c.nbytes for s in self.slots for c in s.chunks)

    @property
    def staged_bytes(self) -> int:
        """Bytes copied through the buffers so far (saves and loads)."""
        return sum(s.staged_bytes for s in self.slots)

    def data_ptrs(self) -> list[int]:
        """Addresses of the buffers (they never change: the same memory serves every save)."""
        return [c.buf.data_ptr() for s in self.slots for c in s.chunks]

    def describe(self) -> str:
        """``pinned, 0.06 GiB host buffers (4 x 2 x 8 MiB)``."""
        return (f"{self.mode.value}, {self.nbytes / 2**30:.2f} GiB host buffers "
                f"({len(self.slots)} x 2 x {self._size(self.chunk_bytes)})")

    @staticmethod
    def _size(n: int) -> str:
        return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"

    def wants(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s bytes go through the buffers."""
        return t.is_cuda or (self.stage_cpu and t.device.type == "cpu")

    @contextlib.contextmanager
    def lease(self) -> Iterator[Slot | None]:
        """One slot for the calling thread, or None when all are taken (more I/O threads than
        slots, or a save abandoned in another thread still holds one): the caller then works
        without staging. The slot's copies have all completed when it is given back."""
        with self._lock:
            slot = self._free.pop() if self._free else None
        try:
            yield slot
        finally:
            if slot is not None:
                try:
                    slot.quiesce()
                finally:
                    with self._lock:
                        self._free.append(slot)


def reserve(config: CheckpointConfig, state: "TrainState", rank: int,
            direct: "DirectPool | None" = None) -> HostStaging | None:
    """The staging buffers for this rank's device state, allocated now, before any signal can
    come (pinning costs ~1 s per GiB), and logged by rank 0; None without device state or with
    ``checkpoint.staging: off``. They fit in ``checkpoint.staging_cap_gib`` less what the
    ``O_DIRECT`` write buffers (``direct``, allocated first) hold, and the log line says both.
    ``KEMPNER_RESILIENCE_STAGE_CPU=1`` stages CPU state too: for tests and benchmarks of the
    pipeline on machines without a GPU."""
    device_bytes, kind = state.device_nbytes()
    stage_cpu = os.environ.get(ENV_STAGE_CPU, "") == "1"
    say = log.info if rank == 0 else log.debug
    plus = f", plus {direct.describe()}" if direct is not None else ""
    if config.staging is StagingMode.OFF:
        if device_bytes:
            say("staging: off, %.2f GiB of %s state is copied into fresh host memory at every "
                "save%s", device_bytes / 2**30, (kind or "").upper(), plus)
        return None
    if not device_bytes and not stage_cpu:
        if direct is not None:
            log.debug("checkpoint writes: %s (checkpoint.staging_cap_gib=%g)", direct.describe(),
                      config.staging_cap_gib)
        return None
    t0 = time.monotonic()
    state_bytes = device_bytes or state.nbytes()
    device = next((p.device for m in state.modules.values() for p in m.parameters()), None)
    cap = int(config.staging_cap_gib * 2**30) - (direct.nbytes if direct is not None else 0)
    staging = HostStaging.allocate(config.staging, max(cap, 0), config.io_threads,
                                   state_bytes, stage_cpu=stage_cpu, device=device)
    what = f"{kind.upper()} state" if device_bytes and kind else \
        f"CPU state ({ENV_STAGE_CPU}=1: for tests and benchmarks)"
    say("staging: %s for %.2f GiB of %s%s (checkpoint.staging_cap_gib=%g), allocated in %.2f s",
        staging.describe(), state_bytes / 2**30, what, plus, config.staging_cap_gib,
        time.monotonic() - t0)
    return staging
