"""Tensor records in ``torch.save`` format, built without ``torch.save``.

DCP's stock ``FileSystemReader`` hands each tensor's byte range to ``torch.load``, so every tensor
record must be a complete ``torch.save`` zip archive. ``torch.save`` itself costs ~0.2 ms per tensor
(seven small records, many small writes); here the archive around the raw bytes is generated
once per (dtype, shape) and cached, so a record costs a dict lookup plus a CRC of the data, which
we need anyway for the manifest. The layout mirrors what ``torch.save`` writes (stored entries,
data descriptors, 64-byte aligned data, same record names); ``torch.load`` reads it unchanged.

A record is ``prefix | raw tensor bytes | suffix``; only the suffix depends on the data (its CRC).
"""

from __future__ import annotations

import collections
import ctypes
import functools
import io
import pickle
import struct
import zlib
from dataclasses import dataclass

import torch

from kempner_resilience.checkpoint.crc import crc32_combine
from kempner_resilience.core.torch_private import (dtype_to_storage_type_map, element_size,
                                                   rebuild_tensor_v2)

__all__ = ["Record", "tensor_record", "bytes_view", "crc32_combine", "fast_path_ok", "encodable",
           "record_template", "finish_record"]

_ALIGN = 64                       # torch aligns record data to 64 bytes (mmap loads rely on it)
_ZIP32_LIMIT = 0xFFFF_0000        # above this a record would need zip64: use torch.save instead
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_DESC = struct.Struct("<IIII")
_EOCD = struct.Struct("<IHHHHIIH")
_FLAGS = 0x0808                   # bit 3: sizes/CRC in a data descriptor; bit 11: UTF-8 names


@dataclass(frozen=True)
class Record:
    """One tensor as ``prefix + data + suffix``; ``crc`` covers the whole record."""

    prefix: bytes
    data: memoryview
    suffix: bytes
    crc: int

    @property
    def length(self) -> int:
        return len(self.prefix) + self.data.nbytes + len(self.suffix)

    @property
    def data_offset(self) -> int:
        return len(self.prefix)


def bytes_view(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without a copy (works for every dense dtype).

    The view does not keep ``t`` alive: the caller must hold ``t`` while the bytes are used.
    (A ctypes array over the data pointer costs ~4 us; going through numpy ~12-16 us, which is
    most of the per-tensor cost for small tensors.)
    """
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B")


def fast_path_ok(t: torch.Tensor) -> bool:
    """Whether ``tensor_record`` can encode ``t`` (plain dense CPU tensor of a known dtype)."""
    return t.device.type == "cpu" and encodable(t)


def encodable(t: torch.Tensor) -> bool:
    """Whether ``t``'s raw bytes, wherever they live, make one of our records (a plain dense
    tensor of a known dtype, small enough for zip32): a device tensor then needs only a copy of
    its bytes to the host, which ``hostbuf`` stages."""
    return (t.layout == torch.strided and not t.is_quantized
            and not t.is_conj() and not t.is_neg() and t.dtype in _storage_types()
            and type(t) in (torch.Tensor, torch.nn.Parameter)
            and t.numel() * t.element_size() < _ZIP32_LIMIT)


@functools.lru_cache(maxsize=1)
def _storage_types() -> dict[torch.dtype, str]:
    return dict(dtype_to_storage_type_map())


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(shape):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def _pickle_for(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """The ``data.pkl`` ``torch.save`` writes for a contiguous tensor whose storage is key '0'."""
    storage_type = getattr(torch, _storage_types()[dtype])
    numel = 1
    for s in shape:
        numel *= s
    sentinel = object()
    rebuild_args = (sentinel, 0, shape, _contiguous_stride(shape), False,
                    collections.OrderedDict())

    class _Tensor:
        def __reduce__(self):
            return (rebuild_tensor_v2, rebuild_args)

    class _Pickler(pickle.Pickler):
        def persistent_id(self, obj):
            return ("storage", storage_type, "0", "cpu", numel) if obj is sentinel else None

    buf = io.BytesIO()
    _Pickler(buf, protocol=2).dump(_Tensor())
    return buf.getvalue()


def _local_header(name: bytes, offset: int) -> bytes:
    pad = (-(offset + _LOCAL.size + len(name) + 4)) % _ALIGN
    extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
    return _LOCAL.pack(0x04034B50, 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(name), len(extra)) + name + extra


@functools.lru_cache(maxsize=4096)
def _template(dtype: torch.dtype, shape: tuple[int, ...]) -> tuple[bytes, int, bytes, tuple[int, int]]:
    """(prefix, crc(prefix), suffix template, offsets of the data CRC inside the suffix)."""
    nbytes = element_size(dtype)
    for s in shape:
        nbytes *= s
    out = bytearray()
    central: list[tuple[bytes, int, int, int]] = []
    small = [("data.pkl", _pickle_for(dtype, shape)), (".format_version", b"1"),
             (".storage_alignment", str(_ALIGN).encode()), ("byteorder", b"little"),
             ("version", b"3\n")]
    for name, payload in small:
        off = len(out)
        full = b"archive/" + name.encode()
        out += _local_header(full, off) + payload
        crc = zlib.crc32(payload)
        out += _DESC.pack(0x08074B50, crc, len(payload), len(payload))
        central.append((full, off, crc, len(payload)))
    data_off = len(out)
    out += _local_header(b"archive/data/0", data_off)
    prefix = bytes(out)
    central.append((b"archive/data/0", data_off, 0, nbytes))

    suffix = bytearray(_DESC.pack(0x08074B50, 0, nbytes, nbytes))
    crc_at = [4]
    cd_start = len(prefix) + nbytes + len(suffix)
    cd = bytearray()
    for full, off, crc, size in central:
        if full == b"archive/data/0":
            crc_at.append(len(suffix) + len(cd) + 16)
        cd += _CENTRAL.pack(0x02014B50, 0, 0, _FLAGS, 0, 0, 0, crc, size, size, len(full),
                            0, 0, 0, 0, 0, off) + full
    suffix += cd
    suffix += _EOCD.pack(0x06054B50, 0, 0, len(central), len(central), len(cd), cd_start, 0)
    return prefix, zlib.crc32(prefix), bytes(suffix), (crc_at[0], crc_at[1])


def record_template(dtype: torch.dtype, shape: tuple[int, ...]
                    ) -> tuple[bytes, int, bytes, tuple[int, int]]:
    """(prefix, crc(prefix), suffix template, where the data CRC goes in the suffix) of the
    record of a contiguous tensor: for writers that see the data in pieces (``finish_record``)."""
    return _template(dtype, tuple(int(s) for s in shape))


def _suffix(template: bytes, at: tuple[int, int], data_crc: int) -> bytes:
    suffix = bytearray(template)
    packed = struct.pack("<I", data_crc)
    suffix[at[0]:at[0] + 4] = packed
    suffix[at[1]:at[1] + 4] = packed
    return bytes(suffix)


def finish_record(prefix_crc: int, template: bytes, at: tuple[int, int], data_crc: int,
                  nbytes: int) -> tuple[bytes, int]:
    """(suffix, CRC of the whole record) once the data's CRC is known."""
    suffix = _suffix(template, at, data_crc)
    crc = crc32_combine(crc32_combine(prefix_crc, data_crc, nbytes), zlib.crc32(suffix),
                        len(suffix))
    return suffix, crc


def tensor_record(t: torch.Tensor) -> Record:
    """Encode a contiguous CPU tensor (see ``fast_path_ok``); computes the data CRC (GIL released)."""
    shape = tuple(int(s) for s in t.shape)
    prefix, prefix_crc, template, at = _template(t.dtype, shape)
    data = bytes_view(t)
    data_crc = zlib.crc32(data)
    if data.nbytes <= _RECRC_BELOW:
        # A second pass over a small buffer is cheaper than two combine calls through ctypes.
        suffix_b = _suffix(template, at, data_crc)
        crc = zlib.crc32(suffix_b, zlib.crc32(data, prefix_crc))
    else:
        suffix_b, crc = finish_record(prefix_crc, template, at, data_crc, data.nbytes)
    return Record(prefix, data, suffix_b, crc)


_RECRC_BELOW = 16 << 10
