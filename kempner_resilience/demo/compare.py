"""Is the resumed run's result bitwise the uninterrupted one's? Comparisons of saved weights."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping

__all__ = ["flatten", "compare_weights", "weights_digest"]


def flatten(obj: Any, prefix: str = "", out: dict[str, Any] | None = None) -> dict[str, Any]:
    """Nested dicts/lists/tuples -> ``{"model.0.weight": tensor, "optim.state[0]": ...}``."""
    out = {} if out is None else out
    if isinstance(obj, dict):
        for k, v in obj.items():
            flatten(v, f"{prefix}.{k}" if prefix else str(k), out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            flatten(v, f"{prefix}[{i}]", out)
    else:
        out[prefix] = obj
    return out


def compare_weights(a: Path | str, b: Path | str) -> tuple[int, int, list[str]]:
    """(equal tensors, total, keys that differ) of two saved dicts, compared bitwise."""
    import torch

    fa = flatten(torch.load(a, weights_only=True))
    fb = flatten(torch.load(b, weights_only=True))
    diff = []
    for k in sorted(set(fa) | set(fb)):
        if k not in fa or k not in fb:
            diff.append(k)
        elif isinstance(fa[k], torch.Tensor):
            if not (isinstance(fb[k], torch.Tensor) and torch.equal(fa[k], fb[k])):
                diff.append(k)
        elif fa[k] != fb[k]:
            diff.append(k)
    total = len(set(fa) | set(fb))
    return total - len(diff), total, diff


def weights_digest(path: str | os.PathLike[str]) -> str:
    """sha256 over every tensor (names, dtypes, shapes, bytes) in a ``torch.save`` file:
    equal digests mean bitwise-equal weights and optimizer state."""
    import hashlib

    import torch

    h = hashlib.sha256()

    def walk(prefix: str, obj: Any) -> None:
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous().reshape(-1)
            h.update(f"{prefix}:{t.dtype}:{tuple(obj.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(obj, Mapping):
            for k in sorted(obj, key=str):
                walk(f"{prefix}.{k}", obj[k])
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(obj):
                walk(f"{prefix}[{i}]", v)
        else:
            h.update(f"{prefix}={obj!r}".encode())

    walk("", torch.load(path, map_location="cpu", weights_only=True))
    return h.hexdigest()
