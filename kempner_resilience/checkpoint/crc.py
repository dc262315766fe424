"""CRC-32 arithmetic shared by the writer, the reader and the integrity checks (no torch import,
so `kempner-resilience ls`/`verify` stay fast to start)."""

from __future__ import annotations

import ctypes
import sys
import zlib
from typing import Any, Iterator

__all__ = ["crc32", "crc32_combine"]


def _libraries(sonames: tuple[str, ...], short: str) -> Iterator[str | None]:
    """The library's sonames: on Linux ``ctypes.util.find_library`` finds nothing else (it
    returns the soname) and runs ``ldconfig -p``, then gcc and ld when that fails: processes
    at every rank's import. Elsewhere it is asked after them."""
    yield from sonames
    if not sys.platform.startswith("linux"):
        from ctypes.util import find_library

        yield find_library(short)


# zlib has crc32_combine in C, but Python's zlib module does not expose it.
def _load_libz():
    for name in _libraries(("libz.so.1", "libz.dylib"), "z"):
        if not name:
            continue
        try:
            lib = ctypes.CDLL(name)
            fn = lib.crc32_combine
            fn.restype = ctypes.c_ulong
            fn.argtypes = [ctypes.c_ulong, ctypes.c_ulong, ctypes.c_long]
            return fn
        except (OSError, AttributeError):
            continue
    return None


_LIBZ_COMBINE = _load_libz()


# The same CRC-32 as zlib's, from libdeflate when the system has it: carry-less multiply
# (PCLMUL) makes it 3-4x zlib 1.2's (9-12 vs 2.4-3.7 GiB/s measured here), and on a busy host
# the checksum's CPU time is what a verified resume loses to a plain read. ctypes releases the
# GIL for the call, as zlib.crc32 does.
def _load_libdeflate():
    for name in _libraries(("libdeflate.so.0",), "deflate"):
        if not name:
            continue
        try:
            fn = ctypes.CDLL(name).libdeflate_crc32
            fn.restype = ctypes.c_uint32
            fn.argtypes = [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t]
            return fn
        except (OSError, AttributeError):
            continue
    return None


_LIBDEFLATE_CRC = _load_libdeflate()
_FAST_MIN = 64 << 10      # below this the ctypes call costs more than it saves


def crc32(data: Any, value: int = 0) -> int:
    """``zlib.crc32(data, value)``, through libdeflate for large writable buffers."""
    n = memoryview(data).nbytes
    if _LIBDEFLATE_CRC is None or n < _FAST_MIN:
        return zlib.crc32(data, value)
    try:
        buf = (ctypes.c_char * n).from_buffer(data)
    except TypeError:       # read-only (bytes): zlib takes those
        return zlib.crc32(data, value)
    return int(_LIBDEFLATE_CRC(value & 0xFFFFFFFF, ctypes.addressof(buf), n))


def _gf2_times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _gf2_square(mat: list[int]) -> list[int]:
    return [_gf2_times(mat, mat[n]) for n in range(32)]


def _py_crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """zlib's crc32_combine in pure Python (fallback when libz cannot be loaded)."""
    if len2 <= 0:
        return crc1
    odd = [0xEDB88320] + [1 << n for n in range(31)]
    even = _gf2_square(odd)
    odd = _gf2_square(even)
    while True:
        even = _gf2_square(odd)
        if len2 & 1:
            crc1 = _gf2_times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _gf2_square(even)
        if len2 & 1:
            crc1 = _gf2_times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC-32 of ``A + B`` from ``crc(A)``, ``crc(B)`` and ``len(B)``: no second pass over data."""
    if len2 <= 0:
        return crc1
    if _LIBZ_COMBINE is not None:
        return int(_LIBZ_COMBINE(crc1, crc2, len2)) & 0xFFFFFFFF
    return _py_crc32_combine(crc1, crc2, len2)
