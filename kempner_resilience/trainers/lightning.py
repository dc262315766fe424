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
import functools
import operator
import os
import pickle
from typing import Any, Callable, Iterator, Mapping

import torch
from torch.utils.data import DataLoader, IterableDataset, RandomSampler

try:
    import pytorch_lightning as pl
    from pytorch_lightning.loops.fit_loop import _FitLoop
    from pytorch_lightning.loops.loop import _Loop
    from pytorch_lightning.loops.progress import _BaseProgress
    from pytorch_lightning.trainer.connectors.signal_connector import _SignalConnector
    from pytorch_lightning.utilities.combined_loader import _Stateful
except ImportError:        # the unified package only
    import lightning.pytorch as pl  # type: ignore[no-redef]
    from lightning.pytorch.loops.fit_loop import _FitLoop  # type: ignore[no-redef]
    from lightning.pytorch.loops.loop import _Loop  # type: ignore[no-redef]
    from lightning.pytorch.loops.progress import _BaseProgress  # type: ignore[no-redef]
    from lightning.pytorch.trainer.connectors.signal_connector import (  # type: ignore[no-redef]
        _SignalConnector)
    from lightning.pytorch.utilities.combined_loader import _Stateful  # type: ignore[no-redef]

from kempner_resilience.checkpoint.data import sampler_chain, seeded_generator
from kempner_resilience.config import ExitMode, ResilienceConfig
from kempner_resilience.core.log import get_logger
from kempner_resilience.rescue.boundary import FrozenStates
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
        loader.snapshot_state = self.snapshot_state
        # The pass's start states as snapshot_state gives them (each pass makes a new list).
        self._frozen = FrozenStates()

    def state_dict(self) -> dict[str, Any]:
        return self._position(snapshot=False)

    def snapshot_state(self) -> dict[str, Any]:
        """What ``state_dict`` gives, in the form the rescue's step snapshot pickles fast
        (``rescue.boundary``): the pass's start states are read once per pass."""
        return self._position(snapshot=True)

    def _position(self, snapshot: bool) -> dict[str, Any]:
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
        return {"batch": batch, "generators": self._frozen(p.start) if snapshot
                else [s.clone() for s in p.start]}

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

    The rescue snapshots it at every step boundary (``snapshot_state``): the counters' values
    read into one flat tuple from a map of the loop tree made once (``_LoopMap``), which
    pickles with the map's key structure as one prepared byte string and unpickles to what
    ``state_dict`` gives. Lightning's own ``fit_loop.state_dict()`` costs ~80 us a step here
    (most of it ``dataclasses.asdict``), and pickling its ~150 keys and numbers as much again.
    The first read is compared with Lightning's own; another Lightning that differs gets its
    own from then on."""

    def __init__(self, trainer: pl.Trainer) -> None:
        self.trainer = trainer
        self._fast: bool | None = None      # None: not compared with Lightning's yet
        self._map: _LoopMap | None = None

    def state_dict(self) -> dict[str, Any]:
        flat = self._read(snapshot=False)
        return self.trainer.fit_loop.state_dict() if flat is None else flat.state()

    def snapshot_state(self) -> Any:
        """What ``state_dict`` gives, in the form that pickles fast (``rescue.boundary``)."""
        flat = self._read(snapshot=True)
        return self.trainer.fit_loop.state_dict() if flat is None else flat

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.trainer.fit_loop.load_state_dict(dict(sd))

    def _read(self, snapshot: bool) -> _FlatLoops | None:
        """The loop state read field by field; with ``snapshot``, the loaders' positions in
        the form that pickles fast (``LoaderPosition.snapshot_state``)."""
        loop = self.trainer.fit_loop
        if self._fast is False:
            return None
        found = self._map
        if found is None or not found.holds(loop):
            found = self._map = _LoopMap(loop)
        if self._fast is None:     # compared as state_dict gives it: real tensors
            self._fast = _same(found.read(False).state(), loop.state_dict())
            if not self._fast:
                log.debug("Lightning's loop state differs from the one read field by field: "
                          "its own state_dict() is used")
                return None
        return found.read(snapshot)


class _FlatLoops:
    """The loop state as the map read it: its key structure (pickled once), the counters'
    values, and each loop's ``on_save_checkpoint``. Pickles to, and ``state()`` gives, the
    dict ``_Loop.state_dict`` gives."""

    __slots__ = ("skeleton", "values", "saves")

    def __init__(self, skeleton: bytes, values: tuple[Any, ...], saves: tuple[Any, ...]) -> None:
        self.skeleton, self.values, self.saves = skeleton, values, saves

    def __reduce__(self) -> tuple[Any, ...]:
        return _loops_from, (self.skeleton, self.values, self.saves)

    def state(self) -> dict[str, Any]:
        return _loops_from(self.skeleton, self.values, self.saves)


def _loops_from(skeleton: bytes, values: tuple[Any, ...], saves: tuple[Any, ...]
                ) -> dict[str, Any]:
    """The loop state dict from a ``_FlatLoops``: a key's entry is a loop's saved dict
    (``saves[i]``) or a counter's, whose leaves index ``values``."""
    return {key: saves[at] if kind == "save" else _fill(at, values)
            for key, kind, at in pickle.loads(skeleton)}


def _as_tuple(get: Callable[[Any], Any], obj: Any) -> tuple[Any]:
    return (get(obj),)


def _fill(template: dict[str, Any], values: tuple[Any, ...]) -> dict[str, Any]:
    return {k: values[v] if type(v) is int else _fill(v, values) for k, v in template.items()}


class _LoopMap:
    """Where the fit loop's state is, found once: each loop's ``on_save_checkpoint`` and each
    progress counter, under the key ``_Loop.state_dict`` gives it, in its order; each counter's
    fields (numbers, or nested counters) read by one ``attrgetter``.

    ``holds`` checks at every read that the same loops and counters are still in the same
    places (one identity test each, ~2 us): Lightning resets and loads its counters in place.
    The fit loop's own ``on_save_checkpoint`` (the loaders' states) is read without its
    per-call ``isinstance`` test against a runtime protocol (~10 us): which loaders have a
    state is found once per list of loaders."""

    def __init__(self, root: Any) -> None:
        self.root = root
        self.links: list[tuple[Any, str, Any]] = []       # (owner, attribute, loop/counter)
        self.skeleton: list[tuple[str, str, Any]] = []    # (key, "save"/"counter", where)
        self.saves: list[Callable[[], Any]] = []
        self.getters: list[tuple[Callable[[Any], Any], Any]] = []    # (attrgetter, counter)
        self.count = 0                                    # values read per call
        self._loaders: list[Any] | None = None
        self._stateful: list[Any] = []
        self._snapshot = False      # this read is the rescue's snapshot (``read``)
        self._walk(root, "")
        self.pickled = pickle.dumps(self.skeleton, protocol=pickle.HIGHEST_PROTOCOL)

    def _walk(self, loop: Any, prefix: str) -> None:
        save = loop.on_save_checkpoint
        if type(loop).on_save_checkpoint is _FitLoop.on_save_checkpoint \
                and _FitLoop.__mro__[1].on_save_checkpoint is _Loop.on_save_checkpoint:
            save = functools.partial(self._fit_loop_save, loop)
        self._save(prefix + "state_dict", save)
        for k, v in loop.__dict__.items():
            if isinstance(v, _BaseProgress):
                self.links.append((loop, k, v))
                self._counter(prefix + k, v)
            elif isinstance(v, _Loop):
                self.links.append((loop, k, v))
                self._walk(v, f"{prefix}{k}.")

    def _save(self, key: str, get: Callable[[], Any]) -> None:
        self.skeleton.append((key, "save", len(self.saves)))
        self.saves.append(get)

    def _counter(self, key: str, obj: Any) -> None:
        paths: list[str] = []
        template = self._template(obj, "", paths)
        if template is None:       # a field that is no number nor counter: read it whole
            self._save(key, functools.partial(_progress, obj))
            return
        self.skeleton.append((key, "counter", template))
        get = operator.attrgetter(*paths)
        if len(paths) == 1:         # attrgetter of one name gives the value, not a tuple
            get = functools.partial(_as_tuple, get)
        self.getters.append((get, obj))
        self.count += len(paths)

    def _template(self, obj: Any, prefix: str, paths: list[str]) -> dict[str, Any] | None:
        out: dict[str, Any] = {}
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            if type(v) in _ATOMS:
                out[f.name] = self.count + len(paths)
                paths.append(prefix + f.name)
            elif dataclasses.is_dataclass(v) and not isinstance(v, type):
                self.links.append((obj, f.name, v))
                inner = self._template(v, f"{prefix}{f.name}.", paths)
                if inner is None:
                    return None
                out[f.name] = inner
            else:
                return None
        return out

    def holds(self, root: Any) -> bool:
        return root is self.root and all(owner.__dict__.get(k) is v
                                         for owner, k, v in self.links)

    def read(self, snapshot: bool) -> _FlatLoops:
        """The counters' values and the loops' saved dicts; with ``snapshot``, the loaders'
        states as their ``snapshot_state`` gives them, where they have one."""
        values: tuple[Any, ...] = ()
        for get, obj in self.getters:
            values += get(obj)
        self._snapshot = snapshot
        return _FlatLoops(self.pickled, values, tuple(get() for get in self.saves))

    def _fit_loop_save(self, loop: Any) -> dict[str, Any]:
        """``_FitLoop.on_save_checkpoint``."""
        out: dict[str, Any] = {}          # _Loop.on_save_checkpoint's
        combined = loop._combined_loader
        if combined is not None:
            loaders = combined.flattened
            if loaders is not self._loaders:
                self._loaders = loaders
                self._stateful = [dl for dl in loaders if isinstance(dl, _Stateful)]
            states = [dl.snapshot_state() if self._snapshot and hasattr(dl, "snapshot_state")
                      else dl.state_dict() for dl in self._stateful]
            if states:
                out["combined_loader"] = states
        return out


_ATOMS = (int, float, bool, str, type(None))
_FIELDS: dict[type, tuple[str, ...]] = {}      # a progress type's field names, once seen


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
        elif type(v) in _FIELDS or (dataclasses.is_dataclass(v) and not isinstance(v, type)):
            out[name] = _progress(v)
        else:
            return dataclasses.asdict(obj)
    return out


def _same(a: Any, b: Any) -> bool:
    """Equal values, tensors by value (a loader position holds generator states)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k])
                                                                    for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return type(a) is type(b) and a == b


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
