"""Hugging Face Accelerate: an ``Accelerator`` script under ``ResilientRun`` in three lines.

```python
model, optim, loader, sched = accelerator.prepare(model, optim, loader, sched)
run = ResilientAccelerate(cfg, accelerator, state={"model": model, "optim": optim,   # +1
                                                   "sched": sched, "data": loader})
with run:                                                                          # +2
    for step, batch in zip(run.steps(total), run.data):                            # +3
        with accelerator.accumulate(model): ...; accelerator.backward(loss); optim.step()
```

Launch it with ``kempner-resilience accelerate launch ...`` (``integrations/accelerate_launch``).

Why a subclass of ``ResilientRun`` and not ``accelerator.save_state``: the run's engine already
does what ``save_state`` lacks (the stop agreed at one step on every rank, the atomic
checksummed commit, the lease, retention, requeue); what Accelerate adds is only where its state
lives, so this class puts that state into ``state``:

* a prepared ``DataLoaderShard`` becomes ``AcceleratedLoader``: its position (epoch, batches
  handed out, and its generators as the epoch began) is saved, and a resume skips the trained
  batches at the index sampler (nothing loaded for them), where ``skip_first_batches`` loads
  and drops them. Its base ``DataLoader`` gets a seeded generator of its own: without one it
  draws its workers' seed from torch's global RNG at every epoch, and a resumed run draws once
  more than the run it continues (the documented resume is then not bitwise). A shuffling
  sampler without a generator (one process: Accelerate shards nothing) shares it, for the
  same reason.
* ``accelerator.scaler`` (mixed precision) and the objects given to
  ``accelerator.register_for_checkpointing`` go in as ``scaler`` and ``custom_<i>``.
* the prepared model (DDP) goes in as it is; an ``AcceleratedOptimizer`` or
  ``AcceleratedScheduler`` as the optimizer or scheduler it wraps (the wrapper's ``step`` is
  theirs, and its ``state_dict`` theirs too).

``run.data`` is the one prepared loader of the state (``run.loaders[name]`` with several).
Take the step first, then the batch (``zip(run.steps(n), run.data)``): a stop then leaves no
batch taken and not trained.
"""

from __future__ import annotations

import os
from typing import Any, Iterator, Mapping

import torch
from torch.utils.data import IterableDataset, RandomSampler

from kempner_resilience.config import ExitMode, ResilienceConfig
from kempner_resilience.checkpoint.data import sampler_chain, seeded_generator
from kempner_resilience.core.log import get_logger
from kempner_resilience.rescue.boundary import FrozenStates
from kempner_resilience.run.resilient import ResilientRun

__all__ = ["ResilientAccelerate", "AcceleratedLoader", "is_prepared_loader"]

log = get_logger(__name__)


# Accelerate's optimizer and scheduler wrappers, and the attribute holding what they wrap:
# the wrapped objects go in the state (AcceleratedOptimizer never calls Optimizer.__init__, so
# it has no step hooks; a wrapped scheduler is the one that drives the optimizer).
_WRAPPERS = {"AcceleratedOptimizer": "optimizer", "AcceleratedScheduler": "scheduler"}


def is_prepared_loader(value: Any) -> bool:
    """A data loader ``Accelerator.prepare`` returned (``DataLoaderShard``/``Dispatcher``):
    a wrapper around a plain ``DataLoader``, its ``base_dataloader``."""
    return "base_dataloader" in getattr(value, "__dict__", {})


class _Skip:
    """The base loader's batch sampler, with the first ``skip`` batches of its next pass left
    out (index lists only); every other attribute is the sampler's (``set_epoch``,
    ``batch_size``, ``sampler``), which Accelerate's loader reads through it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.skip = 0

    def __iter__(self) -> Iterator[Any]:
        it = iter(self.inner)
        skip, self.skip = self.skip, 0
        for _ in range(skip):
            if next(it, None) is None:
                return
        yield from it

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class AcceleratedLoader:
    """An endless stream of batches from a prepared ``DataLoaderShard`` that a checkpoint
    resumes mid-epoch, bitwise (see the module doc). ``next(data)`` gives the next batch;
    ``data.epoch``, ``data.batch`` where it is; ``len(data)`` the batches per epoch."""

    def __init__(self, loader: Any) -> None:
        if not is_prepared_loader(loader):
            raise TypeError(f"AcceleratedLoader wraps a loader from Accelerator.prepare, not a "
                            f"{type(loader).__name__}")
        if type(loader).__name__ == "DataLoaderDispatcher":
            raise ValueError("a dispatched loader (Accelerator(dispatch_batches=True), or an "
                             "IterableDataset) cannot resume mid-epoch here: pass "
                             "DataLoaderConfiguration(dispatch_batches=False) to the Accelerator")
        base = loader.base_dataloader
        if isinstance(base.dataset, IterableDataset) or base.batch_sampler is None:
            raise ValueError("AcceleratedLoader resumes map-style datasets loaded in batches; "
                             "an IterableDataset has no indices to skip to")
        self.loader = loader
        if base.generator is None:
            # One draw from the global RNG now, before a resume restores it (see module doc).
            base.generator = seeded_generator()
        samplers = sampler_chain(base.batch_sampler)
        for s in samplers:
            # One process (no BatchSamplerShard, whose sampler Accelerate seeds): a shuffling
            # sampler without a generator draws its seed from the global RNG at every epoch.
            if isinstance(s, RandomSampler) and s.generator is None:
                s.generator = base.generator
        self._skip = _Skip(base.batch_sampler)
        # DataLoader refuses a new batch sampler after __init__ (a guard for users changing it
        # mid-iteration); Accelerate's loader reads it only when an epoch begins.
        object.__setattr__(base, "batch_sampler", self._skip)
        gens = [base.generator, getattr(loader, "synchronized_generator", None),
                *(getattr(s, "generator", None) for s in samplers)]
        self._generators = list({id(g): g for g in gens
                                 if isinstance(g, torch.Generator)}.values())
        self.epoch = 0
        self.batch = 0
        self._epoch_rng: list[torch.Tensor] | None = None
        # _epoch_rng as snapshot_state gives it (a new epoch, or a resume, makes a new list).
        self._frozen = FrozenStates()
        self._it: Iterator[Any] | None = None

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> "AcceleratedLoader":
        return self

    def __next__(self) -> Any:
        for _ in range(2):    # an epoch resumed at its very end yields nothing: the next one
            if self._it is None:
                self._start_epoch()
            try:
                out = next(self._it)
            except StopIteration:
                self._it = None
                self.epoch, self.batch, self._epoch_rng = self.epoch + 1, 0, None
                continue
            self.batch += 1
            return out
        raise RuntimeError("the data loader yields no batches")

    def _start_epoch(self) -> None:
        if self._epoch_rng is None:
            self._epoch_rng = [g.get_state() for g in self._generators]
        else:                      # a restored epoch: rebuild it from the same states
            for g, s in zip(self._generators, self._epoch_rng):
                g.set_state(s)
        self.loader.set_epoch(self.epoch)
        self._skip.skip = self.batch
        self._it = iter(self.loader)

    def state_dict(self) -> dict[str, Any]:
        rng = self._epoch_rng if self._epoch_rng is not None else \
            [g.get_state() for g in self._generators]
        return {"epoch": self.epoch, "batch": self.batch,
                "generators": [s.clone() for s in rng]}

    def snapshot_state(self) -> dict[str, Any]:
        """What ``state_dict`` gives, in the form the rescue's step snapshot pickles fast
        (``rescue.boundary``): the epoch's generator states are read once per epoch."""
        if self._epoch_rng is None:
            return self.state_dict()
        return {"epoch": self.epoch, "batch": self.batch,
                "generators": self._frozen(self._epoch_rng)}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        if len(sd["generators"]) != len(self._generators):
            raise ValueError(f"the data position in the checkpoint has {len(sd['generators'])} "
                             f"generators, this loader {len(self._generators)}: was the "
                             "DataLoader built or prepared differently?")
        self._it = None
        self.epoch, self.batch = int(sd["epoch"]), int(sd["batch"])
        self._epoch_rng = [s.clone() for s in sd["generators"]]


def _check_processes(accelerator: Any) -> None:
    """Refuse an Accelerator that runs as one process where the launcher started several.

    Started by a launcher that sets ``WORLD_SIZE`` but not Accelerate's own variables (torchrun,
    ``kempner-resilience launch``, check-resume) on a machine without CUDA, the Accelerator
    runs alone (no ``ACCELERATE_USE_CPU``): every rank would train on the whole dataset and the
    ranks' checkpoints would not be one model's."""
    world = os.environ.get("WORLD_SIZE", "1")
    processes = int(getattr(accelerator, "num_processes", 1))
    if world.isdigit() and int(world) > 1 and processes == 1:
        raise ValueError(f"the launcher started {world} ranks (WORLD_SIZE={world}) but the "
                         "Accelerator runs as 1 process: each rank would train alone. On CPU "
                         "set ACCELERATE_USE_CPU=1 (what `accelerate launch --cpu` sets) or "
                         "pass Accelerator(cpu=True); on GPUs make CUDA visible to every rank")


class ResilientAccelerate(ResilientRun):
    """``ResilientRun`` for a script that trains with an ``accelerate.Accelerator``.

    Args:
        config: as for ``ResilientRun`` (a ``ResilienceConfig``, a YAML path, a mapping, or
            None for the defaults / ``$KEMPNER_RESILIENCE_CONFIG``).
        accelerator: the script's ``Accelerator``, after ``prepare``.
        state: the prepared objects, e.g. ``{"model": model, "optim": optim, "sched": sched,
            "data": loader}``; prepared loaders become ``AcceleratedLoader`` (``run.data``).
        overrides, exit_mode, run_id: as for ``ResilientRun``.
    """

    def __init__(self, config: ResilienceConfig | str | os.PathLike[str] | Mapping[str, Any]
                 | None, accelerator: Any, state: Mapping[str, Any] | None = None, *,
                 overrides: tuple[str, ...] = (), exit_mode: ExitMode | str | None = None,
                 run_id: str | None = None) -> None:
        if not hasattr(accelerator, "prepare") or not hasattr(accelerator, "state"):
            raise TypeError(f"accelerator must be an accelerate.Accelerator, not a "
                            f"{type(accelerator).__name__}")
        _check_processes(accelerator)
        self.accelerator = accelerator
        self.loaders: dict[str, AcceleratedLoader] = {}
        full: dict[str, Any] = {}
        for name, value in (state or {}).items():
            if is_prepared_loader(value):
                value = self.loaders[name] = AcceleratedLoader(value)
            elif type(value).__name__ in _WRAPPERS:
                value = getattr(value, _WRAPPERS[type(value).__name__])
            full[name] = value
        scaler = getattr(accelerator, "scaler", None)
        if scaler is not None and not any(v is scaler for v in full.values()):
            full["scaler"] = scaler
        for i, obj in enumerate(getattr(accelerator, "_custom_objects", [])):
            if not any(v is obj for v in full.values()):
                full[f"custom_{i}"] = obj
        super().__init__(config, full if state is not None else None, overrides=overrides,
                         exit_mode=exit_mode, run_id=run_id)

    @property
    def data(self) -> AcceleratedLoader:
        """The prepared loader of the state, resumable (``next(run.data)``)."""
        if len(self.loaders) != 1:
            raise AttributeError(f"run.data needs exactly one prepared loader in the state "
                                 f"(there are {len(self.loaders)}): use run.loaders[name]")
        return next(iter(self.loaders.values()))
