"""CRC-32 arithmetic shared by the writer, the reader and the integrity checks (no torch import,
so `kempner-resilience ls`/`verify` stay fast to start)."""

from __future__ import annotations

import ctypes
import ctypes.util

__all__ = ["crc32_combine"]


# zlib has crc32_combine in C, but Python's zlib module does not expose it.
def _load_libz():
    for name in (ctypes.util.find_library("z"), "libz.so.1", "libz.dylib"):
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
