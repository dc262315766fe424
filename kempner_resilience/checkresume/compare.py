"""Two snapshots of the same step compared entry by entry: which differ, and by how much.

Exactness is bitwise (a resumed run that is "close" still diverges over a week of training):
tensors are equal when their dtype, shape and bytes are; anything else when ``==`` says so,
element by element for sequences and NumPy arrays (an RNG state holds both). For floating-point
tensors and numbers the largest absolute difference is given, the size of the damage a user can
weigh; for integer tensors (an RNG state's bytes) only the count of differing elements means
anything.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kempner_resilience.checkresume.snapshot import Kind, Snapshot

__all__ = ["EntryDiff", "diff_snapshots", "equal_values"]


@dataclass(frozen=True)
class EntryDiff:
    """One entry that differs between the reference and the checked run at one step."""

    key: str
    kind: Kind
    what: str                      # "max abs diff 2.7e-03", "only in the reference", ...
    max_abs: float | None = None   # floating-point entries: the largest absolute difference


def equal_values(a: Any, b: Any) -> bool:
    """Bitwise for tensors, element by element for sequences and arrays, ``==`` otherwise."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return _bytes(a) == _bytes(b)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(equal_values(x, y) for x, y in zip(a, b))
    if hasattr(a, "__array__") and hasattr(b, "__array__") and not isinstance(a, (int, float)):
        import numpy as np

        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    try:
        return bool(a == b)
    except Exception:              # a value whose == is not a bool (an odd object): by repr
        return repr(a) == repr(b)


def _bytes(t: torch.Tensor) -> bytes:
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8).numpy().tobytes() if t.numel() else b""


def _describe(a: Any, b: Any) -> tuple[str, float | None]:
    """Words for how ``a`` (reference) and ``b`` differ, and the max abs diff when numeric."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return (f"{str(a.dtype).removeprefix('torch.')}{tuple(a.shape)} vs "
                    f"{str(b.dtype).removeprefix('torch.')}{tuple(b.shape)}"), None
        if a.is_floating_point():
            d = float((a.double() - b.double()).abs().max()) if a.numel() else 0.0
            return f"max abs diff {d:.3g}", d
        n = int((a != b).sum())
        return f"{n} of {a.numel()} elements differ", None
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) \
            and not isinstance(a, bool) and not isinstance(b, bool):
        d = abs(float(a) - float(b))
        return f"{a!r} vs {b!r}", d
    return "differs", None


def diff_snapshots(ref: Snapshot, got: Snapshot) -> list[EntryDiff]:
    """The entries of ``got`` that differ from ``ref`` (both of the same step), in key order."""
    out: list[EntryDiff] = []
    for key in sorted(set(ref.entries) | set(got.entries)):
        kind = ref.kinds.get(key) or got.kinds[key]
        if key not in got.entries:
            out.append(EntryDiff(key, kind, "only in the uninterrupted run's checkpoint"))
        elif key not in ref.entries:
            out.append(EntryDiff(key, kind, "only in the interrupted run's checkpoint"))
        elif not equal_values(ref.entries[key], got.entries[key]):
            what, d = _describe(ref.entries[key], got.entries[key])
            out.append(EntryDiff(key, kind, what, d))
    return out
