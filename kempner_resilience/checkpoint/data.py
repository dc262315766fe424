"""Data loaders that resume where they stopped, mid-epoch, without touching the global RNG.

Two ways to put a loader in ``ResilientRun``'s state:

* ``ResumableLoader(loader)`` wraps a plain ``torch.utils.data.DataLoader`` (any map-style
  dataset; ``DistributedSampler``, ``RandomSampler``, ``SequentialSampler`` or a batch sampler).
  It is an endless stream of batches: ``next(data)`` returns the next batch and starts the next
  epoch (``sampler.set_epoch(epoch)``) when one ends. Its ``state_dict()`` holds the epoch, the
  batches taken in it and its generators' states as the epoch began; on resume it rebuilds that
  epoch and skips the batches already trained on at the sampler, as index lists (no sample is
  loaded to be thrown away), so ``drop_last`` and the rank's slice come out as before.
* torchdata's ``StatefulDataLoader`` goes into the state as it is (``LoaderEntry`` below saves
  its sampler's epoch with it and builds its iterator during the restore).

Why the RNG matters: a ``DataLoader`` without a ``generator`` draws its workers' base seed from
torch's global RNG each time an iterator is built (``RandomSampler`` draws a seed the same way).
A resumed run builds one more iterator than the run it continues, after the global RNG was
restored, so every later dropout mask differs. ``ResumableLoader`` gives the loader (and a
``RandomSampler`` without one) generators of its own, seeded from the global RNG when it is
made, before any restore; ``LoaderEntry`` builds the resumed iterator before the global RNG is
put back, so that draw is overwritten.

With ``num_workers > 0`` each worker seeds itself from the base seed (``base_seed + worker_id``),
which comes from the restored generator: random augmentation in workers repeats exactly. With
``persistent_workers=True`` the base seed is drawn at the loader's first pass only, so a process
resumed in a later epoch draws it from a copy of the generator: the saved generators, the epoch's
order and every batch stay the uninterrupted run's. The workers keep their RNG across epochs,
which no checkpoint holds: the augmentation they draw after a resume is then not the
uninterrupted run's (StatefulDataLoader saves worker state).

torch is imported by this module; torchdata never is (it is optional: the ``data`` extra).
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset

from kempner_resilience.checkpoint.info import CheckpointError
from kempner_resilience.checkpoint.loaderfit import (GlobalDraws, changes, describe,
                                                     foreign_rngs, rebatch, torch_generators)
from kempner_resilience.core.log import get_logger, rank

log = get_logger(__name__)

__all__ = ["ResumableLoader", "LoaderEntry", "is_stateful_loader", "plain_loader_error",
           "warn_global_seed", "sampler_chain", "seeded_generator"]

_VERSION = 2      # 2: the loader's shape saved with the position (1 still loads)


def is_stateful_loader(value: Any) -> bool:
    """A DataLoader that saves its own position (torchdata's ``StatefulDataLoader``)."""
    return isinstance(value, DataLoader) and callable(getattr(value, "state_dict", None)) \
        and callable(getattr(value, "load_state_dict", None))


def plain_loader_error(name: str) -> CheckpointError:
    """What to do with a plain DataLoader put in the state."""
    return CheckpointError(
        f"state[{name!r}] is a plain DataLoader, which cannot say where it is in an epoch, so a "
        f"resume would start the epoch again. Wrap it and iterate the wrapper: "
        f"`{name} = kempner_resilience.ResumableLoader(loader)`, then `next({name})` in the "
        "loop (it calls sampler.set_epoch itself), or use torchdata's StatefulDataLoader "
        "(pip install 'kempner-resilience[data]')")


def warn_global_seed(name: str, value: Any) -> None:
    """Warn when a hand-written data object in the state holds a DataLoader that seeds itself
    from torch's global RNG: its resumed iterator draws once more than the uninterrupted run,
    and every random number after it (dropout) differs. A ``ResumableLoader`` is not such an
    object: the DataLoader it wraps keeps no generator, the twin it draws batches from has one
    (warning about it was a false alarm on every rank, for the quickstart's own line)."""
    if isinstance(value, ResumableLoader):
        return
    loaders = [v for v in vars(value).values() if isinstance(v, DataLoader)] \
        if hasattr(value, "__dict__") else []
    if any(d.generator is None for d in loaders) and rank() == 0:
        log.warning("state[%r] holds a DataLoader without its own generator: each iterator it "
                    "builds draws a seed from torch's global RNG, so a resumed run does not "
                    "repeat the uninterrupted one (dropout differs). Wrap the DataLoader in "
                    "kempner_resilience.ResumableLoader instead, or pass "
                    "generator=torch.Generator().manual_seed(...) and save its state", name)


def _samplers(loader: DataLoader) -> list[Any]:
    """The loader's sampler objects, outermost first, without repeats."""
    out: list[Any] = []
    for s in (loader.batch_sampler, getattr(loader.batch_sampler, "sampler", None),
              loader.sampler):
        if s is not None and all(s is not o for o in out):
            out.append(s)
    return out


def _global_seed() -> int:
    # One draw, when the wrapper is made: before ResilientRun restores the global RNG, so a
    # resumed run's stream after the restore is the uninterrupted run's.
    return int(torch.empty((), dtype=torch.int64).random_().item())


def seeded_generator() -> torch.Generator:
    """A generator for a loader that has none, seeded by one draw from the global RNG now
    (before a resume restores it: the resumed run's global stream stays the uninterrupted
    run's). The trainer adapters' loaders get theirs from here too."""
    return torch.Generator().manual_seed(_global_seed())


def sampler_chain(*roots: Any) -> list[Any]:
    """Every sampler under ``roots`` (a batch sampler, a sampler; wrappers such as
    Accelerate's ``BatchSamplerShard`` followed through their ``batch_sampler`` and
    ``sampler``), outermost first, each once."""
    out: list[Any] = []
    todo = list(roots)
    while todo:
        s = todo.pop(0)
        if s is None or any(s is o for o in out):
            continue
        out.append(s)
        todo += [getattr(s, "batch_sampler", None), getattr(s, "sampler", None)]
    return out


class _SkipFirst:
    """The index sampler of the loader, with the first ``skip`` items of its next pass left
    out (index lists only: nothing is loaded for them); its first pass is watched for draws
    from a global RNG (``loaderfit.GlobalDraws``)."""

    def __init__(self, inner: Any, draws: GlobalDraws) -> None:
        self.inner = inner
        self.skip = 0
        self._draws = draws

    def __iter__(self) -> Iterator[Any]:
        it = self._draws.start(self.inner)
        skip, self.skip = self.skip, 0
        for _ in range(skip):
            if next(it, _END) is _END:
                return
        yield from it

    def __len__(self) -> int:
        return len(self.inner)


_END = object()


class ResumableLoader:
    """An endless stream of batches from ``loader`` that a checkpoint can resume mid-epoch.

    ``next(data)`` returns the next batch; at the end of an epoch the next one starts, with
    ``set_epoch(epoch)`` called on every sampler that has it (``DistributedSampler``). Put it in
    ``ResilientRun``'s state (``{"data": data}``); ``len(data)`` is the batches per epoch,
    ``data.epoch`` and ``data.batch`` where it is.

    ``loader`` stays untouched except for two things: a ``RandomSampler`` (or another sampler
    with a ``generator`` attribute) without a generator gets one, and the loader's
    ``DistributedSampler`` gets ``set_epoch`` calls. Batches come from a shallow twin of the
    loader (same dataset, workers, collate function) whose index sampler can skip.

    The saved position is the batches handed to steps that finished, not the batches fetched:
    a loop that takes its batch before the step begins (``zip(data, run.steps(n))``, or a
    batch fetched before the loop and carried into the next step) holds batches that no
    finished step trained on. ``ResilientRun`` tells the loader when its loop starts
    (``loop_starts``): the batches taken since the loader was made or restored are that
    look-ahead, left out of every saved position; the resumed script takes them again the same
    way before its first step. A resume whose batch size, dataset length or sampler differs
    from the checkpoint's is named in a warning (``loaderfit``); a changed batch size goes on
    from the same sample.
    """

    def __init__(self, loader: DataLoader) -> None:
        if is_stateful_loader(loader):
            raise CheckpointError("this DataLoader saves its own position (a "
                                  "StatefulDataLoader): put it in the state as it is, without "
                                  "ResumableLoader")
        if not isinstance(loader, DataLoader):
            raise CheckpointError(f"ResumableLoader wraps a torch DataLoader, not a "
                                  f"{type(loader).__name__}")
        if isinstance(loader.dataset, IterableDataset):
            raise CheckpointError("ResumableLoader cannot skip into an IterableDataset (it has "
                                  "no indices); use torchdata's StatefulDataLoader with a "
                                  "dataset that has state_dict()/load_state_dict()")
        self.loader = loader
        samplers = _samplers(loader)
        self._set_epoch = [s for s in samplers if callable(getattr(s, "set_epoch", None))]
        fixed = []
        for s in samplers:
            if hasattr(s, "generator") and s.generator is None:
                # Without one, RandomSampler draws a seed from the global RNG every epoch.
                s.generator = torch.Generator().manual_seed(_global_seed())
                fixed.append(type(s).__name__)
        twin = copy.copy(loader)
        twin._iterator = None
        if loader.generator is None:
            # The workers' base seed would come from the global RNG at every iterator.
            twin.generator = torch.Generator().manual_seed(_global_seed())
            fixed.append("DataLoader")
        self._index = _SkipFirst(loader._index_sampler, GlobalDraws(self._name))
        # DataLoader refuses a new sampler after __init__ (its check guards users against
        # changing one mid-iteration); the twin is ours and has never been iterated.
        object.__setattr__(twin, "batch_sampler" if loader._auto_collation else "sampler",
                           self._index)
        self._twin = twin
        # torch's samplers call theirs `generator`; one of another name is saved all the same.
        self._generators = list({id(g): g for g in
                                 [twin.generator, *(getattr(s, "generator", None)
                                                    for s in samplers),
                                  *torch_generators(samplers)]
                                 if isinstance(g, torch.Generator)}.values())
        if fixed:
            log.info("data loader: gave %s its own seeded generator (instead of torch's global "
                     "RNG), saved with the checkpoint", ", ".join(fixed))
        unsaved = foreign_rngs(samplers)
        if unsaved and rank() == 0:
            log.warning("%s: its sampler shuffles with %s, which no checkpoint saves: a resumed "
                        "epoch comes in another order. Give the sampler a torch.Generator "
                        "instead (the loader saves it)", self._name(), ", ".join(unsaved))
        self._shape = describe(loader, samplers)
        self.epoch = 0
        self.batch = 0           # batches of this epoch handed out
        self._epoch_rng: list[torch.Tensor] | None = None    # generator states as it began
        self._it: Iterator[Any] | None = None
        # Earlier epochs (epoch, its generator states as it began, its batches): a saved
        # position that leaves out a look-ahead may fall back into the epoch before.
        self._past: list[tuple[int, list[torch.Tensor], int]] = []
        self._taken = 0          # batches handed out since made or restored
        self._lookahead = 0      # of those, taken before the loop's first step (loop_starts)
        self._said_far = False   # a look-ahead longer than the epochs kept, said once

    def _name(self) -> str:
        return f"ResumableLoader over {type(self.loader.dataset).__name__}"

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> "ResumableLoader":
        return self

    def __next__(self) -> Any:
        for _ in range(2):    # an epoch resumed at its very end yields nothing: the next one
            if self._it is None:
                self._start_epoch()
            try:
                out = next(self._it)
            except StopIteration:
                self._it = None
                self._past = [*self._past[-1:], (self.epoch, self._epoch_rng or [], self.batch)]
                self.epoch, self.batch = self.epoch + 1, 0
                self._epoch_rng = None
                continue
            self.batch += 1
            self._taken += 1
            return out
        raise RuntimeError("the data loader yields no batches (an empty dataset, or drop_last "
                           "with fewer samples than one batch)")

    def _start_epoch(self) -> None:
        if self._epoch_rng is None:
            self._epoch_rng = [g.get_state() for g in self._generators]
        else:                    # a restored epoch: rebuild it from the same states
            for g, s in zip(self._generators, self._epoch_rng):
                g.set_state(s)
        for s in self._set_epoch:
            s.set_epoch(self.epoch)
        self._index.skip = self.batch
        self._it = self._pass()

    def _pass(self) -> Iterator[Any]:
        """The twin's iterator for this epoch. With persistent workers the loader draws its
        workers' base seed from its generator at its first pass only: the uninterrupted run
        drew it at epoch 0, and a process resumed in a later epoch would draw once more from
        the restored generator, which a ``RandomSampler`` made by ``shuffle=True`` shares (the
        epoch then comes in another order). That process draws the seed from a copy instead:
        the saved generators stay where the uninterrupted run had them, and so do the
        batches."""
        twin = self._twin
        if not (twin.persistent_workers and twin.num_workers > 0 and twin._iterator is None
                and self.epoch > 0):
            return iter(twin)
        own = twin.generator
        copy_ = torch.Generator()
        copy_.set_state(own.get_state())
        twin.generator = copy_
        try:
            return iter(twin)
        finally:
            twin.generator = own

    def loop_starts(self) -> None:
        """The training loop's first step begins: the batches taken since this loader was made
        or restored are carried into the loop, not trained yet (see the class docstring)."""
        self._lookahead = self._taken
        if self._lookahead:
            log.debug("data loader: %d batch(es) taken before the first step, left out of "
                      "the saved position", self._lookahead)

    def _trained_position(self) -> tuple[int, int, list[torch.Tensor]]:
        """(epoch, batch, generator states as that epoch began) of the batches handed to
        finished steps: the position fetched, less the look-ahead."""
        now = self._epoch_rng if self._epoch_rng is not None else \
            [g.get_state() for g in self._generators]
        epoch, batch, back, rng = self.epoch, self.batch, self._lookahead, now
        past = list(self._past)
        while back > batch and past:
            back -= batch
            epoch, rng, batch = past.pop()
        if back > batch:          # more look-ahead than two epochs: keep the fetched position
            if not self._said_far:
                self._said_far = True
                log.warning("%s: %d batches taken before the first step, more than it can "
                            "leave out of the saved position; the resume skips them",
                            self._name(), self._lookahead)
            return self.epoch, self.batch, now
        return epoch, batch - back, rng

    def state_dict(self) -> dict[str, Any]:
        epoch, batch, rng = self._trained_position()
        return {"version": _VERSION, "epoch": epoch, "batch": batch,
                "generators": [s.clone() for s in rng], "shape": dict(self._shape)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if sd.get("version") not in (1, _VERSION) or \
                len(sd["generators"]) != len(self._generators):
            raise CheckpointError(
                f"the data position in the checkpoint does not fit this loader (version "
                f"{sd.get('version')!r}, {len(sd.get('generators', []))} generators; this "
                f"loader has {len(self._generators)}): was the DataLoader built differently?")
        if self._taken and rank() == 0:
            log.warning("%s handed out %d batch(es) before the checkpoint was restored into "
                        "it: those came from the loader's start, not from where the run "
                        "stopped. Take batches inside `with ResilientRun(...)`", self._name(),
                        self._taken)
        self._it = None          # an iterator of the epoch before the restore is stale
        self.epoch, self.batch = int(sd["epoch"]), int(sd["batch"])
        self._epoch_rng = [s.clone() for s in sd["generators"]]
        self._past, self._taken, self._lookahead = [], 0, 0
        if "shape" in sd:        # version 1 saved no shape
            self._check_shape(sd["shape"])

    def _check_shape(self, saved: dict[str, Any]) -> None:
        """A checkpoint saved by a loader with another batch size, dataset or sampler: named
        in one warning (rank 0). Only the batch size changed: go on from the same sample."""
        changed = changes(saved, self._shape)
        if not changed:
            return
        old, new = saved.get("batch_size"), self._shape["batch_size"]
        words = ""
        if len(changed) == 1 and isinstance(old, int) and isinstance(new, int):
            at, again = rebatch(self.batch, old, new)
            words = (f"; it goes on from the same sample, {self.batch * old} of epoch "
                     f"{self.epoch} (batch {at})"
                     + (f", {again} sample(s) of it trained again" if again else ""))
            self.batch = at
        else:
            words = ("; the saved position (epoch %d, batch %d) now means other samples: the "
                     "rest of this epoch is not the one the checkpoint's run would have "
                     "trained" % (self.epoch, self.batch))
        if rank() == 0:
            log.warning("%s resumes from a checkpoint saved with another loader: %s%s",
                        self._name(), ", ".join(changed), words)


class LoaderEntry:
    """A ``StatefulDataLoader`` as a state entry: its own state plus its sampler's epoch
    (``DistributedSampler.set_epoch`` is not part of the loader's state, and the resumed
    iterator's order depends on it). ``load_state_dict`` builds the resumed iterator at once,
    so its seed draw from the global RNG happens before the checkpoint's RNG is put back."""

    def __init__(self, loader: DataLoader) -> None:
        self.loader = loader
        self._epochs = [s for s in _samplers(loader) if callable(getattr(s, "set_epoch", None))]

    def state_dict(self) -> dict[str, Any]:
        return {"loader": self.loader.state_dict(),
                "sampler_epochs": [getattr(s, "epoch", None) for s in self._epochs]}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if set(sd) != {"loader", "sampler_epochs"}:      # the loader's own state, saved alone
            sd = {"loader": sd, "sampler_epochs": []}
        for s, epoch in zip(self._epochs, sd["sampler_epochs"]):
            if epoch is not None:
                s.set_epoch(epoch)
        self.loader.load_state_dict(sd["loader"])
        # The next iter(loader) returns this iterator (StatefulDataLoader keeps the one
        # state_dict() built); TrainState.restore puts the global RNG back after this.
        self.loader.state_dict()
