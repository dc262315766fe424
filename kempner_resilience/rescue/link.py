"""The buddy link: each rank sends its step snapshot to one other rank, every step, so that a
dead rank's RNG streams and data position survive it.

Rank ``r`` sends to its buddy ``(r + offset) % world`` (``offset``: the ranks per node, so the
buddy is on another node) and receives from ``(r - offset) % world``, over a plain TCP
connection made at start. A gloo send/recv pair costs about a millisecond per step here; a
non-blocking ``sendmsg`` of ~12 KB costs a few microseconds on the training thread, and a
daemon thread receives (blocked in ``recv`` without the GIL) and keeps the last two snapshots.

Frames: ``kind, length, step`` then ``length`` bytes. ``SNAP`` carries a snapshot (after the
ids of the sealed chunks it refers to), ``CHUNK`` a sealed chunk (``rescue.chunks``: sent once,
before the first snapshot that refers to it; both ends keep it while one of the last two
snapshots refers to it), ``WAKE``
says "a rescue started: contribute" (passed on around the ring, so ranks stuck in a collective
with live peers learn of it too), ``BYE`` ends a link on purpose. A link that ends without
``BYE`` means its sender is gone: that wakes the receiver like ``WAKE``. A rank that leaves on
a failure sends ``WAKE`` before it closes (it rescued, or left on its own error), so a link that
ends with neither frame is a sender that died without a word (``pred_died``): killed, or its
node gone. The survivors tell their launcher which ranks those were. The connection is
authenticated with a token agreed over the process group at start, and the received bytes are
only unpickled by this package's rescue writer.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from typing import Callable, Mapping

from kempner_resilience.core.log import get_logger
from kempner_resilience.rescue.boundary import Snapshot

__all__ = ["BuddyLink", "local_address", "buddy_offset"]

log = get_logger(__name__)

SNAP, WAKE, BYE, CHUNK = 1, 2, 3, 4
_HEADER = struct.Struct("<BxxxIq")
_COUNT = struct.Struct("<I")             # a snapshot's chunk ids: their count, then each "<q"
_NO_CHUNKS = _COUNT.pack(0)
_NONE_SENT: tuple[frozenset[int], frozenset[int]] = (frozenset(), frozenset())
_HELLO = struct.Struct("<16sq")          # token, sender rank
_MAX_FRAME = 64 << 20
_MAX_PENDING = 8 << 20                   # unsent bytes before the link is given up


def local_address() -> str:
    """This host's address on the route to ``MASTER_ADDR`` (no packet is sent)."""
    target = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((target, 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def buddy_offset(hosts: list[str]) -> int:
    """How far a rank's buddy is: the most ranks any host runs (so the buddy lives on another
    node when ranks are placed node by node), or 1 when all ranks share one host."""
    counts: dict[str, int] = {}
    for h in hosts:
        counts[h] = counts.get(h, 0) + 1
    per_node = max(counts.values())
    return per_node if per_node < len(hosts) else 1


class BuddyLink:
    """This rank's two connections: to its buddy (sending) and from its predecessor
    (receiving, in a daemon thread). ``on_wake(reason)`` runs in that thread."""

    def __init__(self, rank: int, on_wake: Callable[[str], None]) -> None:
        self.rank, self.buddy, self.pred = rank, -1, -1
        self.token = b""
        self.on_wake = on_wake
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._out: socket.socket | None = None
        self._in: socket.socket | None = None
        self._lock = threading.Lock()
        self._pending = bytearray()
        self._held: tuple[Snapshot, ...] = ()
        self._chunks: dict[int, bytes] = {}           # received, by id
        # The chunk ids of the last two snapshots sent: what the buddy holds.
        self._sent = _NONE_SENT
        self._closing = False
        self._lost: str | None = None     # why the link to the buddy was given up
        self._lost_said = False
        self.pred_died = False            # the predecessor's link ended without BYE or WAKE
        self.sent_bytes = 0               # queued to the buddy so far, frame headers included
        self._thread: threading.Thread | None = None

    def listen(self, host: str) -> tuple[str, int]:
        """Open the receiving end; returns the address to give the predecessor."""
        self._listener.bind((host, 0))
        self._listener.listen(4)
        return host, self._listener.getsockname()[1]

    def connect(self, buddy: int, pred: int, addr: tuple[str, int], token: bytes,
                timeout_s: float) -> None:
        """Connect to the buddy at ``addr``, then accept the predecessor (every rank connects
        before it accepts, and the kernel completes a connection before ``accept``: no
        deadlock). ``token`` (agreed over the process group) authenticates both."""
        self.buddy, self.pred = buddy, pred
        self.token = token[:16].ljust(16, b"\0")
        out = socket.create_connection(addr, timeout=timeout_s)
        out.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        out.sendall(_HELLO.pack(self.token, self.rank))
        out.setblocking(False)
        self._out = out
        end = time.monotonic() + timeout_s
        while self._in is None:
            self._listener.settimeout(max(end - time.monotonic(), 0.01))
            conn, _ = self._listener.accept()     # socket.timeout past the deadline
            conn.settimeout(max(end - time.monotonic(), 0.01))
            try:
                token, rank = _HELLO.unpack(_recv_exact(conn, _HELLO.size))
            except (OSError, ConnectionError):
                conn.close()
                continue
            if token == self.token and rank == self.pred:
                conn.settimeout(None)
                self._in = conn
            else:
                log.warning("rescue link: refused a connection that is not rank %d's", self.pred)
                conn.close()
        self._listener.close()
        self._thread = threading.Thread(target=self._receive, name="kempner-rescue-link",
                                        daemon=True)
        self._thread.start()

    # -------------------------------------------------------------------------- sending

    def send(self, step: int, payload: bytes, chunks: Mapping[int, bytes] = {}) -> None:
        """Queue this boundary's snapshot to the buddy without blocking (the training thread),
        with the sealed chunks it refers to that the buddy does not hold yet. A link lost
        earlier is reported here, once: only a rank that trains on without it has lost
        something (see ``_drop``)."""
        if self._lost is not None and not self._lost_said:
            self._lost_said = True
            log.warning("rescue link to rank %d closed: %s; a rescue after this rank dies will "
                        "lack its per-rank state", self.buddy, self._lost)
        if not chunks and self._sent is _NONE_SENT:   # the per-step path of most runs
            self._send(SNAP, step, _NO_CHUNKS, payload)
            return
        held = self._sent[0] | self._sent[1]
        for cid, data in chunks.items():
            if cid not in held:
                self._send(CHUNK, cid, data)
        # The same tuple again once neither snapshot refers to a chunk: the fast path above.
        self._sent = (self._sent[1], frozenset(chunks)) if chunks or self._sent[1] else _NONE_SENT
        self._send(SNAP, step, _COUNT.pack(len(chunks)) + struct.pack(f"<{len(chunks)}q", *chunks),
                   payload)

    def wake(self) -> None:
        """Tell the buddy a rescue started (it passes it on)."""
        self._send(WAKE, -1, b"")

    def _send(self, kind: int, step: int, *parts: bytes) -> None:
        size = sum(len(p) for p in parts)
        with self._lock:
            out = self._out
            if out is None:
                return
            frame = [_HEADER.pack(kind, size, step), *parts]
            self.sent_bytes += _HEADER.size + size
            if self._pending:
                self._pending += b"".join(frame)
                self._flush(out)
                return
            try:
                sent = out.sendmsg(frame)
            except BlockingIOError:
                sent = 0
            except OSError:
                self._drop("the buddy's connection failed")
                return
            if sent < _HEADER.size + size:
                self._pending += b"".join(frame)[sent:]

    def _flush(self, out: socket.socket) -> None:
        try:
            sent = out.send(self._pending)
        except BlockingIOError:
            sent = 0
        except OSError:
            self._drop("the buddy's connection failed")
            return
        del self._pending[:sent]
        if len(self._pending) > _MAX_PENDING:
            self._drop(f"rank {self.buddy} stopped reading its snapshots")

    def _drop(self, why: str) -> None:
        # Not logged here: a send fails mostly because the buddy died, and then a rescue is
        # under way (its wake is what failed to send) and the warning would be false. The
        # next snapshot's ``send`` says it, if this rank trains on without its link.
        if self._out is not None and not self._closing:
            self._lost = why
        if self._out is not None:
            self._out.close()
        self._out = None
        self._pending.clear()

    def close(self, clean: bool = True) -> None:
        """End both connections; ``clean`` says goodbye first, so the buddy is not woken;
        otherwise the buddy is woken (``WAKE``): this rank leaves on a failure, it did not die."""
        with self._lock:
            self._closing = True
            out = self._out
            if out is not None and clean:
                try:
                    out.setblocking(True)
                    out.settimeout(1.0)
                    if self._pending:
                        out.sendall(self._pending)
                    out.sendall(_HEADER.pack(BYE, 0, -1))
                except OSError:
                    pass
            elif out is not None and not self._pending:
                try:            # never blocks: a failure ending must not wait on its buddy
                    out.send(_HEADER.pack(WAKE, 0, -1))
                except OSError:
                    pass
            if out is not None:
                out.close()
            self._out = None
        self._listener.close()
        if self._in is not None:
            try:
                self._in.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # ------------------------------------------------------------------------ receiving

    def held(self) -> list[Snapshot]:
        """The predecessor's last two snapshots, newest first."""
        return list(reversed(self._held))

    def _receive(self) -> None:
        conn = self._in
        assert conn is not None
        why = f"rank {self.pred}'s link closed without a goodbye (the rank is gone)"
        woken = died = False
        try:
            while True:
                kind, length, step = _HEADER.unpack(_recv_exact(conn, _HEADER.size))
                if length > _MAX_FRAME:
                    why = f"rank {self.pred} sent a malformed frame"
                    break
                payload = _recv_exact(conn, length) if length else b""
                if kind == SNAP:
                    snap = self._snapshot(step, payload)
                    if snap is None:
                        why = f"rank {self.pred} sent a snapshot without its chunks"
                        break
                    self._held = (self._held[-1:] + (snap,))
                    if self._chunks:     # keep what the two snapshots held refer to
                        keep = {cid for s in self._held for cid in s.chunks}
                        self._chunks = {c: d for c, d in self._chunks.items() if c in keep}
                elif kind == CHUNK:
                    self._chunks[step] = payload
                elif kind == WAKE:
                    woken = True
                    self.on_wake(f"a rescue started (passed on by rank {self.pred})")
                elif kind == BYE:
                    return
        except (OSError, ConnectionError):
            died = True
        finally:
            conn.close()
        if not self._closing:
            # A live rank wakes its buddy before it leaves on a failure (its rescue, or
            # ``close(clean=False)``): one that ended with neither a goodbye nor a wake died.
            self.pred_died = died and not woken
            self.on_wake(why)


    def _snapshot(self, step: int, frame: bytes) -> Snapshot | None:
        (n,) = _COUNT.unpack_from(frame)
        ids = struct.unpack_from(f"<{n}q", frame, _COUNT.size)
        try:
            chunks = {cid: self._chunks[cid] for cid in ids}
        except KeyError:
            return None
        return Snapshot(step, frame[_COUNT.size + 8 * n:], chunks)


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    while view.nbytes:
        got = conn.recv_into(view)
        if not got:
            raise ConnectionError("connection closed")
        view = view[got:]
    return bytes(buf)
