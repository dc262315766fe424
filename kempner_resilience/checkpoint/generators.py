"""The script's own ``torch.Generator``s: saved when put in the state, named when left out.

A script that draws noise, a dropout mask or an augmentation from a generator of its own
(``noise = torch.Generator().manual_seed(1234)``) carries that generator's position from one
step to the next. Left out of the state, a resumed run starts it again from where the script
made it, and everything it draws after the resume differs from the uninterrupted run's. The
checkpoints cannot show it (the generator is in none of them): only the model and optimizer
differ, which looks like a prefetched batch. So the run measures it.

* ``GeneratorEntry`` puts a generator in the state as it is: ``state={..., "noise": noise}``.
* ``UnsavedGenerators`` looks, when the loop starts, at the generators the script's own frames
  hold (the locals of every caller outside this package and the installed libraries, and
  their module's globals). At each save, one that was drawn from since the loop started and
  whose state is nowhere in the checkpoint is named, once, on rank 0. A generator the state
  saves otherwise (a ``ResumableLoader``'s, a ``StatefulDataLoader``'s, one an object's
  ``state_dict()`` returns) is not named.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from types import FrameType
from typing import Any, Iterable, Mapping

import torch

from kempner_resilience.core.log import get_logger, rank

log = get_logger(__name__)

__all__ = ["GeneratorEntry", "UnsavedGenerators", "script_generators", "held_generators",
           "UNSAVED_GENERATOR"]

#: The words of the warning, which check-resume passes on as the cause.
UNSAVED_GENERATOR = "is drawn from in the loop but is not in the state"

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class GeneratorEntry:
    """A ``torch.Generator`` as a state entry: its state saved, and set back at resume."""

    def __init__(self, generator: torch.Generator) -> None:
        self._generator = generator

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self._generator.get_state()}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self._generator.set_state(sd["generator"])


def _library_dirs() -> tuple[str, ...]:
    """Where code that is not the script's lives: this package, the standard library and the
    installed packages (torch, pytest, a trainer library)."""
    paths = sysconfig.get_paths()
    dirs = {_PACKAGE, *(paths.get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib"))}
    return tuple(os.path.abspath(d) + os.sep for d in dirs if d)


def _script_frames(frame: FrameType | None) -> Iterable[FrameType]:
    libs = _library_dirs()
    while frame is not None:
        name = frame.f_code.co_filename
        if not name.startswith("<") and not os.path.abspath(name).startswith(libs):
            yield frame
        frame = frame.f_back


def script_generators(frame: FrameType | None = None
                      ) -> dict[int, tuple[str, str, torch.Generator]]:
    """id -> (variable, file, generator) for the ``torch.Generator``s the script's frames on
    the stack hold, from ``frame`` (the caller's by default) outward: their locals and their
    module's globals."""
    out: dict[int, tuple[str, str, torch.Generator]] = {}
    for f in _script_frames(frame or sys._getframe(1)):
        where = os.path.basename(f.f_code.co_filename)
        for names in (f.f_locals, f.f_globals):
            for var, value in list(names.items()):
                if isinstance(value, torch.Generator) and id(value) not in out:
                    out[id(value)] = (var, where, value)
    return out


def held_generators(objects: Iterable[Any]) -> list[torch.Generator]:
    """The generators that state objects save themselves: a ``GeneratorEntry``'s, a
    ``ResumableLoader``'s, and a ``StatefulDataLoader``'s (its loader's and sampler's)."""
    from kempner_resilience.checkpoint.data import LoaderEntry, ResumableLoader, sampler_chain

    out: list[torch.Generator] = []
    for obj in objects:
        if isinstance(obj, GeneratorEntry):
            out.append(obj._generator)
        elif isinstance(obj, ResumableLoader):
            out += obj._generators
        elif isinstance(obj, LoaderEntry):
            loader = obj.loader
            out += [g for s in (loader, *sampler_chain(loader.batch_sampler, loader.sampler))
                    if isinstance(g := getattr(s, "generator", None), torch.Generator)]
    return out


def _tensors(value: Any) -> Iterable[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


class UnsavedGenerators:
    """The script's generators that the state does not save, watched from the loop's start;
    one drawn from by the loop is named at the next save (rank 0, once)."""

    def __init__(self) -> None:
        self._watched: list[tuple[str, str, torch.Generator, torch.Tensor]] = []

    def watch(self, saved: Iterable[torch.Generator], frame: FrameType | None = None) -> None:
        """At the loop's start: note the script's generators (seen from ``frame`` outward)
        that are not ``saved`` (by the state), as they are now."""
        skip = {id(g) for g in saved} | {id(torch.default_generator)}
        found = script_generators(frame or sys._getframe(1))
        self._watched = [(var, where, g, g.get_state())
                         for key, (var, where, g) in found.items() if key not in skip]

    def check(self, objects: Mapping[str, Any]) -> None:
        """At a save (``objects``: the state objects' saved states): name the watched
        generators drawn from since the loop started whose state the save does not hold."""
        drawn = [w for w in self._watched if not torch.equal(w[2].get_state(), w[3])]
        if not drawn:
            return
        states = [t for t in _tensors(objects) if t.dtype == torch.uint8]
        unsaved = [(var, where) for var, where, g, _ in drawn
                   if not any(t.shape == (n := g.get_state()).shape and torch.equal(t, n)
                              for t in states)]
        # A generator drawn from and saved stays saved; one named is named once.
        self._watched = [] if unsaved else [w for w in self._watched
                                                   if all(w is not d for d in drawn)]
        if unsaved and rank() == 0:
            var = unsaved[0][0]
            log.warning("torch.Generator %s %s: a resume starts it again from where the "
                        "script made it, so what the loop draws from it (noise, a dropout "
                        "mask, an augmentation, a shuffle) differs from the uninterrupted "
                        "run's. Add it: state={..., %r: %s}", ", ".join(
                            f"{v!r} ({w})" for v, w in unsaved), UNSAVED_GENERATOR, var, var)
