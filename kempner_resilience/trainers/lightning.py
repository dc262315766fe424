"""PyTorch Lightning: a ``LightningModule`` trained by ``Trainer.fit`` under ``ResilientRun``.

```python
from kempner_resilience.trainers.lightning import ResilientCallback      # +1
trainer = pl.Trainer(max_steps=n, strategy="ddp", accelerator="cpu", devices=2,
                     callbacks=[ResilientCallback(cfg)])                   # +2
trainer.fit(model, loader)
```

Launch it with ``kempner-resilience torchrun --nproc-per-node N train.py``: Lightning takes
torchelastic's environment (no launcher of its own), and our agent hands every signal to every
rank. Lightning's own launcher makes rank 0 the parent of the others and SIGKILLs it when a
child ends with a code that is not 0 (a stop's 75): the callback warns when it sees it.

What the callback does, on Lightning's hooks (the run's engine does the rest, as for any
``ResilientRun``):

* ``setup``: Lightning's signal handlers are left out (its connector replaced by one that
  installs none). Its SIGTERM handler broadcast a tensor from inside the handler and
  "bypassed" the signal (the run went on, then exited 0 with nothing saved); its SLURM USR1
  handler saved ``hpc_ckpt_*.ckpt`` inside the handler and requeued whatever that save did.
* ``on_fit_start`` (after the strategy set up the model and optimizers, before Lightning's
  loop): a ``fit(ckpt_path=...)`` is refused (Lightning would restore it over the run's
  resume right after this hook); the train loader is built and made resumable (``LoaderPosition``), the run is
  entered: the lease, then the resume from the newest committed checkpoint, into the model
  (the DDP wrapper as it is), the optimizers, the LR schedulers, the precision plugin's
  state, Lightning's loops (``fit_loop.state_dict()``, which holds the loader's position, as
  Lightning keeps a resumable loader's), and the RNG streams of every rank.
* ``on_train_batch_end`` after an optimizer step (``trainer.global_step`` moved): a step
  boundary of ``run.steps()``: heartbeat, periodic save, and the stop agreed on every rank.
  A stop saves, requeues, and leaves with the run's code (75 / 130 / 143): the ``SystemExit``
  goes through Lightning's exception path (its teardown runs) and out of ``trainer.fit``, so the
  script's code after ``fit`` (a "final" save) never runs after a stop.
* ``on_fit_end``: the run ends as completed; ``on_exception``: as failed.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterator, Mapping

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

try:
    import pytorch_lightning as pl
    from pytorch_lightning.loops.loop import _Loop
    from pytorch_lightning.loops.progress import _BaseProgress
    from pytorch_lightning.trainer.connectors.signal_connector import _SignalConnector
except ImportError:        # the unified package only
    import lightning.pytorch as pl  # type: ignore[no-redef]
    from lightning.pytorch.loops.loop import _Loop  # type: ignore[no-redef]
    from lightning.pytorch.loops.progress import _BaseProgress  # type: ignore[no-redef]
    from lightning.pytorch.trainer.connectors.signal_connector import (  # type: ignore[no-redef]
        _SignalConnector)

from kempner_resilience.checkpoint.data import sampler_chain, seeded_generator
from kempner_resilience.config import ExitMode, ResilienceConfig
from kempner_resilience.core.log import get_logger
from kempner_resilience.run.resilient import ResilientRun

__all__ = ["ResilientCallback", "LoaderPosition"]

log = get_logger(__name__)


class _NoSignals(_SignalConnector):
    """Lightning's signal connector with nothing installed: the run's handlers stay in place
    (see the module doc), and ``trainer.received_sigterm`` stays False."""

    def register_signal_handlers(self) -> None:
        self.received_sigterm = False

    def teardown(self) -> None:
        pass


class _Pass:
    """The loader's batch sampler: each pass begins (``iter``) eagerly, before the loader draws
    its workers' base seed from its generator, so the generators' states taken there are the
    pass's start; a resumed pass is rebuilt from those states and skips the trained batches
    by index (nothing is loaded for them). Every other attribute is the sampler's
    (``sampler``, ``set_epoch``, ``batch_size``), which Lightning and the loader read."""

    def __init__(self, inner: Any, generators: list[torch.Generator]) -> None:
        self.inner = inner
        self.generators = generators
        self.start: list[torch.Tensor] | None = None    # the states as this pass began
        self.resume: tuple[int, list[torch.Tensor]] | None = None

    def __iter__(self) -> Iterator[Any]:
        skip = 0
        if self.resume is not None:
            # Kept until the pass is read: an iterator Lightning builds and drops (setup_data's
            # own) must not use it up.
            skip, states = self.resume
            for g, s in zip(self.generators, states):
                g.set_state(s)
        self.start = [g.get_state() for g in self.generators]
        return self._batches(iter(self.inner), skip)

    def _batches(self, it: Iterator[Any], skip: int) -> Iterator[Any]:
        self.resume = None
        for _ in range(skip):
            if next(it, None) is None:
                return
        yield from it

    def __len__(self) -> int:
        return len(self.inner)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":       # not set yet (a copy being built): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)


class LoaderPosition:
    """Where the fit's train ``DataLoader`` is: the batches of the current epoch already
    trained (Lightning's own count) and its generators' states as the epoch began.

    It makes the loader resumable the way Lightning expects (the loader gets ``state_dict`` /
    ``load_state_dict``, so ``fit_loop.state_dict()`` carries the position and Lightning
    counts the skipped batches); a resume rebuilds the epoch from the saved states and skips
    the trained batches at the batch sampler. The loader gets a seeded generator of its own
    (one draw from torch's global RNG, before a resume restores it), and a ``RandomSampler``
    without one uses it: otherwise each epoch draws from the global RNG, and a resumed run
    draws once more than the run it continues (not bitwise).
    """

    def __init__(self, loader: DataLoader, trainer: pl.Trainer) -> None:
        if isinstance(loader.dataset, IterableDataset) or loader.batch_sampler is None:
            raise ValueError(
                "the train DataLoader cannot resume mid-epoch here: an IterableDataset (or a "
                "loader without a batch sampler) has no indices to skip to. Use a map-style "
                "Dataset with batch_size, or torchdata's StatefulDataLoader")
        self.trainer = trainer
        if loader.generator is None:
            loader.generator = seeded_generator()
        samplers = sampler_chain(loader.batch_sampler, loader.sampler)
        for s in samplers:
            if isinstance(s, RandomSampler) and s.generator is None:
                s.generator = loader.generator
        gens = [loader.generator, *(getattr(s, "generator", None) for s in samplers)]
        generators = list({id(g): g for g in gens if isinstance(g, torch.Generator)}.values())
        self._pass = _Pass(loader.batch_sampler, generators)
        # DataLoader refuses a new batch sampler after __init__ (a guard for a change while
        # it iterates); it reads it only when an iterator begins.
        object.__setattr__(loader, "batch_sampler", self._pass)
        loader.state_dict = self.state_dict
        loader.load_state_dict = self.load_state_dict

    def state_dict(self) -> dict[str, Any]:
        p = self._pass
        # Batches of this epoch handed to training, resumed ones counted (Lightning's count:
        # a loader's own would include what its workers prefetched).
        batch = int(self.trainer.fit_loop.epoch_loop.batch_progress.current.ready)
        if p.start is None or batch >= self.trainer.num_training_batches:
            # The epoch's last batch: Lightning resumes this as the next epoch's start (its
            # restart resets the batch count and moves the epoch on), so the position is that
            # start: no batch to skip, and the generators as they are now, which is where the
            # next pass would begin (nothing draws from them between passes). The epoch's own
            # start with its 16 batches to skip would skip the whole next epoch instead.
            return {"batch": 0, "generators": [g.get_state() for g in p.generators]}
        return {"batch": batch, "generators": [s.clone() for s in p.start]}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        if len(sd["generators"]) != len(self._pass.generators):
            raise ValueError(f"the data position in the checkpoint has "
                             f"{len(sd['generators'])} generators, this loader "
                             f"{len(self._pass.generators)}: was the DataLoader built "
                             "differently?")
        self._pass.resume = (int(sd["batch"]), [s.clone() for s in sd["generators"]])


class _Loops:
    """Lightning's fit loop (epoch, batch and optimizer-step counters, the loader position) as
    a state entry; its ``load_state_dict`` marks it restarting, as Lightning's own resume.

    ``state_dict`` runs at every step boundary (the rescue's snapshot). It walks the loops as
    Lightning's ``_Loop.state_dict`` does, with each progress counter read field by field
    instead of through ``dataclasses.asdict`` (most of the ~80 us that call takes). The first
    call compares it with Lightning's own; another Lightning that differs gets its own from
    then on."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self._fast: bool | None = None      # None: not compared with Lightning's yet

    def state_dict(self) -> dict[str, Any]:
        loop = self.trainer.fit_loop
        if self._fast is False:
            return loop.state_dict()
        sd = _loop_state(loop, {}, "")
        if self._fast is None:
            theirs = loop.state_dict()
            self._fast = sd.keys() == theirs.keys() and all(
                sd[k] == theirs[k] for k in sd if not k.endswith("state_dict"))
            if not self._fast:
                log.debug("Lightning's loop state differs from the one read field by field: "
                          "its own state_dict() is used")
                return theirs
        return sd

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.trainer.fit_loop.load_state_dict(dict(sd))


_ATOMS = (int, float, bool, str, type(None))
_FIELDS: dict[type, tuple[str, ...]] = {}
_KINDS: dict[type, int] = {}           # a type found in a loop: 1 progress, 2 loop, 0 other


def _loop_state(loop: Any, out: dict[str, Any], prefix: str) -> dict[str, Any]:
    """``loop.state_dict()`` as Lightning's ``_Loop`` writes it, its progress faster."""
    out[prefix + "state_dict"] = loop.on_save_checkpoint()
    for k, v in loop.__dict__.items():
        kind = _KINDS.get(type(v))
        if kind is None:
            kind = _KINDS[type(v)] = 1 if isinstance(v, _BaseProgress) else \
                2 if isinstance(v, _Loop) else 0
        if kind == 1:
            out[prefix + k] = _progress(v)
        elif kind == 2:
            _loop_state(v, out, f"{prefix}{k}.")
    return out


def _progress(obj: Any) -> dict[str, Any]:
    """``dataclasses.asdict(obj)`` for a progress counter: numbers and nested counters read
    field by field (the same dict); anything else through ``asdict`` itself."""
    names = _FIELDS.get(type(obj))
    if names is None:
        names = _FIELDS[type(obj)] = tuple(f.name for f in dataclasses.fields(obj))
    out = {}
    for name in names:
        v = getattr(obj, name)
        if type(v) in _ATOMS:
            out[name] = v
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            out[name] = _progress(v)
        else:
            return dataclasses.asdict(obj)
    return out


class _Precision:
    """The precision plugin's state (a mixed-precision scaler)."""

    def __init__(self, plugin: Any) -> None:
        self.plugin = plugin

    def state_dict(self) -> dict[str, Any]:
        return self.plugin.state_dict()

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.plugin.load_state_dict(dict(sd))


class ResilientCallback(pl.Callback):
    """A ``ResilientRun`` around ``Trainer.fit``, as a Lightning callback (see the module doc).

    Args:
        config: as for ``ResilientRun`` (a ``ResilienceConfig``, a YAML path, a mapping, or
            None for the defaults / ``$KEMPNER_RESILIENCE_CONFIG``).
        overrides, exit_mode, run_id: as for ``ResilientRun``.

    ``callback.run`` is the run once ``fit`` started (``run.run_id``, ``run.resumed_from``).
    """

    def __init__(self, config: ResilienceConfig | str | os.PathLike[str] | Mapping[str, Any]
                 | None = None, *, overrides: tuple[str, ...] = (),
                 exit_mode: ExitMode | str | None = None, run_id: str | None = None) -> None:
        super().__init__()
        self._args = (config, overrides, exit_mode, run_id)
        self.run: ResilientRun | None = None
        self._steps: Iterator[int] | None = None
        self._seen = -1
        self._open = False

    # ------------------------------------------------------------------ Lightning's hooks

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if trainer.reload_dataloaders_every_n_epochs:
            raise ValueError("reload_dataloaders_every_n_epochs with a ResilientCallback: the "
                             "train loader's position is kept on the loader built at the start; "
                             "leave reload_dataloaders_every_n_epochs at 0")
        env = getattr(trainer.strategy, "cluster_environment", None)
        if trainer.world_size > 1 and env is not None and not env.creates_processes_externally:
            log.warning("Lightning started the other ranks as children of this one: its "
                        "observer SIGKILLs this rank when one of them exits with a stop's code. "
                        "Launch with `kempner-resilience torchrun --nproc-per-node %d ...`",
                        trainer.num_devices)
        trainer._signal_connector = _NoSignals(trainer)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.ckpt_path:    # known from here on; Lightning would restore it over ours
            raise ValueError(f"trainer.fit(ckpt_path={trainer.ckpt_path!r}) with a "
                             "ResilientCallback: leave ckpt_path out, the run resumes from the "
                             "newest committed checkpoint in checkpoint.dir")
        config, overrides, exit_mode, run_id = self._args
        run = ResilientRun(config, self._state(trainer, pl_module), overrides=overrides,
                           exit_mode=exit_mode, run_id=run_id)
        run.__enter__()          # the lease, then the resume (Lightning's loops included)
        self.run, self._open = run, True
        # The resumed loops hold the loader's position; Lightning hands it to the loader in
        # setup_data, which ran before the resume (the loader had to be made resumable first).
        trainer.fit_loop._load_combined_loader_states()
        if trainer.fit_loop._data_fetcher is not None:
            # setup_data built the first epoch's iterator before the loader was made resumable
            # (and before the resume): build it again, as Lightning's own iter() would.
            iter(trainer.fit_loop._data_fetcher)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert self.run is not None
        total = trainer.estimated_stepping_batches
        self._steps = self.run.steps(int(total) if total != float("inf") else 2**62)
        self._seen = trainer.global_step
        self._boundary()           # a stop asked during the set-up: before the first step

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step != self._seen:     # an optimizer step ran: a step boundary
            self._seen = trainer.global_step
            self._boundary()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A validation changes what callbacks carry (ModelCheckpoint's best, EarlyStopping's
        # patience): check-resume stops across one (run.event; a real job ignores it). The
        # sanity check before the first step is no eval of the training.
        if self.run is not None and not trainer.sanity_checking:
            self.run.event("eval")

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._close(None)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self._close(exception)

    # ------------------------------------------------------------------ the run

    def _state(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        """What the checkpoint holds; builds the train loader and makes it resumable."""
        loop = trainer.fit_loop
        loop.setup_data()         # Lightning's own call (it returns early when run again)
        combined = loop._combined_loader
        loaders = [] if combined is None else combined.flattened
        if len(loaders) > 1:
            raise ValueError(f"{len(loaders)} train loaders: a ResilientCallback resumes one "
                             "mid-epoch; combine the datasets into one DataLoader")
        for dl in loaders:
            if isinstance(dl, DataLoader) and not callable(getattr(dl, "state_dict", None)):
                LoaderPosition(dl, trainer)
        model = trainer.strategy.model
        state: dict[str, Any] = {"model": model if isinstance(model, torch.nn.Module)
                                 else pl_module}
        for i, optim in enumerate(trainer.optimizers):
            state["optim" if i == 0 else f"optim_{i}"] = optim
        for i, cfg in enumerate(trainer.lr_scheduler_configs):
            state["sched" if i == 0 else f"sched_{i}"] = cfg.scheduler
        if trainer.precision_plugin.state_dict():
            state["precision"] = _Precision(trainer.precision_plugin)
        state["loops"] = _Loops(trainer)
        return state

    def _boundary(self) -> None:
        """One step boundary of ``run.steps()``: a stop leaves from here (``SystemExit``)."""
        if self._steps is None:
            return
        try:
            next(self._steps)
        except StopIteration:     # the last step ran: the loop's own ending
            self._steps = None

    def _close(self, exc: BaseException | None) -> None:
        if not self._open or self.run is None:
            return
        self._open = False
        self.run.__exit__(type(exc) if exc is not None else None, exc,
                          exc.__traceback__ if exc is not None else None)
