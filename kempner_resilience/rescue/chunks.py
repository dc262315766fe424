"""A step snapshot's parts that stay the same for many steps, encoded and sent once.

A Hugging Face Trainer's log history is part of its state, and it only grows: with a log line
every step, 10,000 lines are a megabyte of JSON in every step's snapshot (0.7 ms a step here,
and a megabyte a step to the buddy). ``GrowingText`` keeps such text as sealed ``Chunk``s (16
KiB or more each, encoded once) and an open tail. A snapshot refers to a sealed chunk by its id
(``encode`` collects them), the buddy link sends each chunk once and the buddy keeps it while a
snapshot it holds refers to it. ``pack`` makes a snapshot whole again, for a file.
"""

from __future__ import annotations

import itertools
import pickle
from typing import Any, Mapping

__all__ = ["Chunk", "GrowingText", "pack", "unpack", "reduce_chunk", "resolver"]

_PACKED = b"KRC\x01"            # a pickle starts with b"\x80": never this
_SEAL_BYTES = 16 << 10
_ids = itertools.count(1)


class Chunk:
    """Bytes that never change, with an id unique in this process."""

    __slots__ = ("id", "data")

    def __init__(self, data: bytes) -> None:
        self.id = next(_ids)
        self.data = data

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # A plain pickle (outside ``encode``) holds the bytes themselves.
        return _chunk_data, (self.data,)


def _chunk_data(data: bytes) -> bytes:
    return data


def _chunk_ref(chunk_id: int) -> bytes:
    """What ``encode``'s pickler names for a chunk; ``decode`` resolves it from the chunks the
    snapshot came with (its unpickler's ``find_class``), never by calling this."""
    raise ValueError(f"the rescue snapshot refers to chunk {chunk_id}: decode it with "
                     "rescue.boundary.decode")


def reduce_chunk(chunk: Chunk, refs: dict[int, bytes]) -> tuple[Any, tuple[Any, ...]]:
    """How ``encode``'s pickler writes ``chunk``: by id, noted in ``refs``."""
    refs[chunk.id] = chunk.data
    return _chunk_ref, (chunk.id,)


class GrowingText:
    """Text that is only appended to, as sealed chunks and an open tail.

    ``append`` adds text; ``value(tail)`` is the whole text plus ``tail`` (for a checkpoint);
    ``parts(tail)`` the same for a snapshot: it unpickles to that string, and pickles the sealed
    chunks by id. ``clear`` starts over (the text was replaced, not appended to)."""

    __slots__ = ("_sealed", "_open", "_open_bytes")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._sealed: list[Chunk] = []
        self._open: list[str] = []
        self._open_bytes = 0

    def append(self, text: str) -> None:
        self._open.append(text)
        self._open_bytes += len(text)
        if self._open_bytes >= _SEAL_BYTES:
            self._sealed.append(Chunk("".join(self._open).encode()))
            self._open, self._open_bytes = [], 0

    def value(self, tail: str = "") -> str:
        return "".join([*(c.data.decode() for c in self._sealed), *self._open, tail])

    def parts(self, head: str = "", tail: str = "") -> "_Joined":
        return _Joined(head, self._sealed, "".join([*self._open, tail]))


class _Joined:
    """A string in parts (``GrowingText.parts``): it unpickles to the string."""

    __slots__ = ("head", "sealed", "tail")

    def __init__(self, head: str, sealed: list[Chunk], tail: str) -> None:
        self.head, self.sealed, self.tail = head, list(sealed), tail

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return _join, (self.head, self.sealed, self.tail)


def _join(head: str, sealed: list[bytes], tail: str) -> str:
    return "".join([head, *(b.decode() for b in sealed), tail])


def resolver(chunks: Mapping[int, bytes]) -> Any:
    """``_chunk_ref`` for an unpickler of a snapshot that came with ``chunks``."""
    def chunk(chunk_id: int) -> bytes:
        if chunk_id not in chunks:
            raise ValueError(f"the rescue snapshot refers to chunk {chunk_id}, which it was not "
                             "sent with")
        return chunks[chunk_id]
    return chunk


def pack(payload: bytes, chunks: Mapping[int, bytes]) -> bytes:
    """A snapshot with the chunks it refers to, whole (for a file): the same bytes for the same
    snapshot, whoever packs it."""
    if not chunks:
        return payload
    return _PACKED + pickle.dumps((sorted(chunks.items()), payload),
                                  protocol=pickle.HIGHEST_PROTOCOL)


def unpack(blob: bytes) -> tuple[bytes, dict[int, bytes]]:
    """``pack``'s inverse: the snapshot and its chunks."""
    if not blob.startswith(_PACKED):
        return blob, {}
    items, payload = pickle.loads(blob[len(_PACKED):])
    return payload, dict(items)
