"""Does a checkpoint's data position still mean the same samples for this loader, and does the
loader's state cover every random number its samplers draw?

A ``ResumableLoader`` saves where it is as (epoch, batches taken, its generators' states). That
position only means the same samples when the batch size, the dataset's length and the sampler
(its kind, its rank's slice, its shuffle and seed) are the ones it was saved with: resumed with
batch size 4 instead of 8, "batch 12" is sample 48 instead of 96, and 48 samples are trained
twice. ``describe`` records what the position depends on; ``changes`` names what differs at
resume; ``rebatch`` carries a position across a changed batch size to the same sample.

A sampler that shuffles with a random source the loader's state does not hold resumes its epoch
in another order: a python ``random.Random`` or a numpy generator among its attributes
(``foreign_rngs``), or torch's, python's or numpy's global RNG drawn from as its epoch starts
(``GlobalDraws``: after a resume the global streams are the checkpoint's, not those of the
epoch's start). torch generators under any attribute name are saved by the loader itself
(``torch_generators``).
"""

from __future__ import annotations

import itertools
import random
from typing import Any, Callable, Iterator

import torch

from kempner_resilience.core.log import get_logger, rank

try:  # numpy is optional
    import numpy as _np
except ImportError:  # pragma: no cover - numpy is installed here
    _np = None

log = get_logger(__name__)

__all__ = ["describe", "changes", "rebatch", "torch_generators", "foreign_rngs",
           "GlobalDraws"]

# The sampler attributes that decide which indices a rank gets, in which order.
_SAMPLER_KEYS = ("num_replicas", "rank", "shuffle", "seed", "drop_last", "replacement",
                 "num_samples", "batch_size")


def _plain(value: Any) -> bool:
    return isinstance(value, (bool, int, float, str)) or value is None


def describe(loader: Any, samplers: list[Any]) -> dict[str, Any]:
    """What a saved position depends on: batch size, dataset length, batches per epoch and
    each sampler's kind and settings (plain values only)."""
    length: int | None = None
    batches: int | None = None
    try:                       # a dataset or sampler without __len__: nothing to compare
        length = len(loader.dataset)
        batches = len(loader)
    except TypeError:
        pass
    kinds = []
    for s in samplers:
        entry = {"type": type(s).__qualname__}
        for key in _SAMPLER_KEYS:
            value = getattr(s, key, None)
            if _plain(value) and value is not None:
                entry[key] = value
        kinds.append(entry)
    return {"batch_size": loader.batch_size, "dataset_len": length,
            "batches": batches, "samplers": kinds}


def changes(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What differs between a saved ``describe`` and this loader's, as ``what saved -> now``."""
    out = []
    for key, words in (("batch_size", "batch size"), ("dataset_len", "dataset length")):
        if saved.get(key) != now.get(key):
            out.append(f"{words} {saved.get(key)} -> {now.get(key)}")
    old, new = saved.get("samplers", []), now.get("samplers", [])
    if [s.get("type") for s in old] != [s.get("type") for s in new]:
        out.append("sampler " + "/".join(s.get("type", "?") for s in old) + " -> "
                   + "/".join(s.get("type", "?") for s in new))
    else:
        for a, b in zip(old, new):
            for key in sorted(set(a) | set(b)):
                if key not in ("type", "batch_size") and a.get(key) != b.get(key):
                    out.append(f"{a['type']}.{key} {a.get(key)} -> {b.get(key)}")
    return out


def rebatch(batch: int, old_size: int, new_size: int) -> tuple[int, int]:
    """A position of ``batch`` batches of ``old_size`` in batches of ``new_size``: the batch to
    go on from and how many samples it trains again (0 when the sizes divide evenly)."""
    samples = batch * old_size
    new = samples // new_size
    return new, samples - new * new_size


def torch_generators(samplers: list[Any]) -> list[torch.Generator]:
    """Every torch generator the samplers hold, whatever its attribute's name: the loader
    saves them all (``generator`` is the name torch's own samplers use)."""
    out: list[torch.Generator] = []
    for s in samplers:
        for value in list(vars(s).values()) if hasattr(s, "__dict__") else []:
            if isinstance(value, torch.Generator) and all(value is not g for g in out):
                out.append(value)
    return out


def foreign_rngs(samplers: list[Any]) -> list[str]:
    """``Sampler.attribute (kind)`` for each random source a sampler holds that is not a torch
    generator: nothing saves it, so a resumed epoch is shuffled otherwise."""
    kinds: list[tuple[type, str]] = [(random.Random, "python random.Random")]
    if _np is not None:
        kinds += [(_np.random.Generator, "numpy Generator"),
                  (_np.random.RandomState, "numpy RandomState")]
    found = []
    for s in samplers:
        for name, value in (vars(s).items() if hasattr(s, "__dict__") else ()):
            for cls, words in kinds:
                if isinstance(value, cls):
                    found.append(f"{type(s).__name__}.{name} ({words})")
    return found


def _global_states() -> tuple[Any, ...]:
    states: tuple[Any, ...] = (torch.random.get_rng_state(), random.getstate())
    if _np is not None:
        states += (_np.random.get_state()[1].copy(),)
    return states


def _same(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    return torch.equal(a[0], b[0]) and a[1] == b[1] and \
        (len(a) < 3 or bool((a[2] == b[2]).all()))


class GlobalDraws:
    """Watches a sampler's first pass, once: a sampler that draws from a global RNG as its
    epoch starts (``torch.randperm(n)`` without a generator, ``random.shuffle``) is warned
    about. The global streams are compared before ``iter(sampler)`` and after its first item,
    which is where a shuffling sampler draws its order; no dataset read happens in between."""

    def __init__(self, name: Callable[[], str]) -> None:
        self._name = name
        self._done = False

    def start(self, sampler: Any) -> Iterator[Any]:
        """``iter(sampler)``; the first time, checked around its first item."""
        if self._done:
            return iter(sampler)
        self._done = True
        before = _global_states()
        it = iter(sampler)
        first = next(it, _END)
        if not _same(before, _global_states()) and rank() == 0:
            log.warning("%s: its sampler draws from a global RNG (torch, random or numpy) as "
                        "its epoch starts; after a resume those streams are the checkpoint's, "
                        "so the resumed epoch comes in another order. Give the sampler a "
                        "torch.Generator of its own (the loader saves it)", self._name())
        return iter(()) if first is _END else itertools.chain((first,), it)


_END = object()
