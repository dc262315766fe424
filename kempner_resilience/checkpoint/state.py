"""What a checkpoint holds, and how it is captured from and restored into the training objects.

The DCP state dict has three kinds of entries:

* ``<name>`` for each ``nn.Module`` (plain or DDP) and each optimizer, through
  ``torch.distributed.checkpoint.state_dict`` (it strips DDP's ``module.`` prefix and keys
  optimizer state by parameter name, so checkpoints move between plain and DDP models);
* ``<name>`` for each object that holds an FSDP2/HSDP model or optimizer (a ``Stateful`` "app
  state" that calls ``get_state_dict``/``set_state_dict`` on an FSDP2 model and its optimizer, as in
  DCP's tutorial and torchtitan's ``ModelWrapper``): its state dict as DCP entries, so it is
  resharded at load like a module's, then handed to its ``load_state_dict``;
* ``rank_state.rank<r>``: one opaque blob per rank with the step, the RNG states (python
  ``random``, numpy, torch CPU, CUDA), the ``state_dict()`` of every other object (scheduler,
  data iterator, ...) and each DDP's gradient bucket layout (see ``ddp_buckets``). The key is
  rank-unique on purpose: DCP deduplicates non-tensor values that share a key across ranks, so
  with a shared key rank 0 could load rank 1's RNG or data position.

A blob instead of nested entries because DCP can only load keys that the destination state dict
already has with the same structure; a data iterator's state may change shape between saves.
"""

from __future__ import annotations

import io
import random
from typing import Any, Iterator, Mapping

import torch
from torch import nn
from torch.utils.data import DataLoader
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from kempner_resilience.checkpoint.carried import PendingGrads, unsaved_schedulers
from kempner_resilience.checkpoint.data import (LoaderEntry, ResumableLoader, is_stateful_loader,
                                                plain_loader_error, warn_global_seed)
from kempner_resilience.checkpoint.ddp_buckets import RECORD_KEY, BucketLayouts
from kempner_resilience.checkpoint.delegated import is_delegated
from kempner_resilience.checkpoint.generators import (GeneratorEntry, UnsavedGenerators,
                                                      held_generators)
from kempner_resilience.checkpoint.info import CheckpointError
from kempner_resilience.checkpoint.sharded import (blob_source, local, saved_ranks,
                                                   sharded_parts, world_change_line)
from kempner_resilience.core.log import get_logger, rank as log_rank

try:  # numpy is optional
    import numpy as _np
except ImportError:  # pragma: no cover - numpy is installed here
    _np = None

log = get_logger(__name__)

__all__ = ["TrainState", "capture_rng", "restore_rng", "rank_key"]

_OPTS = StateDictOptions(full_state_dict=False, cpu_offload=False)


def rank_key(rank: int) -> str:
    """The DCP key of one rank's private blob."""
    return f"rank_state.rank{rank}"


def capture_rng() -> dict[str, Any]:
    """Every global RNG stream this process uses."""
    out: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if _np is not None:
        out["numpy"] = _np.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def restore_rng(states: Mapping[str, Any]) -> None:
    """Put back what ``capture_rng`` returned (streams missing on either side are skipped)."""
    if "python" in states:
        random.setstate(states["python"])
    if "torch" in states:
        torch.set_rng_state(states["torch"])
    if "numpy" in states and _np is not None:
        _np.random.set_state(states["numpy"])
    if "cuda" in states and torch.cuda.is_available():
        cuda = states["cuda"]
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all(cuda)
        else:
            log.warning("not restoring CUDA RNG: saved for %d devices, %d visible", len(cuda),
                        torch.cuda.device_count())


def _import_what_state_dicts_need() -> None:
    """Import now what torch's ``get_model_state_dict`` imports on its first call: for a module
    with nested names it checks for ``torch.compile``'s wrapper, which imports ``torch._dynamo``
    (0.45-0.55 s here). At set-up, not in the first save: that may be the emergency save of a
    run preempted before its first periodic one, with the deadline running."""
    try:
        import torch._dynamo  # noqa: F401
    except Exception as e:       # a broken optional part of torch: the save imports it later
        log.debug("torch._dynamo could not be imported in advance: %s", e)


def _take_grads(optim: torch.optim.Optimizer) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The optimizer's parameters' gradients, taken off them (put back by the caller)."""
    taken = []
    for group in optim.param_groups:
        for param in group["params"]:
            if param.grad is not None:
                taken.append((param, param.grad))
                param.grad = None
    return taken


def _params(module: nn.Module) -> set[int]:
    return {id(p) for p in module.parameters()}


class TrainState:
    """The user's ``{"model": ..., "optim": ..., "sched": ..., "data": ...}`` classified.

    Modules and optimizers go through DCP's state_dict API, and so does an object that holds an
    FSDP2/HSDP module (``apps``: its own ``state_dict()``/``load_state_dict()``); every other
    value must have ``state_dict()`` and ``load_state_dict()`` (CheckpointError at construction
    otherwise) and goes into the rank's blob. A
    plain ``DataLoader`` is refused with the fix named (``ResumableLoader``); a
    ``StatefulDataLoader`` is kept with its sampler's epoch (``data.LoaderEntry``); a
    ``torch.Generator`` is kept with its state (``generators.GeneratorEntry``).
    With ``ddp_buckets``, the gradient bucket layout of every DDP among the modules is saved and
    offered back at resume (``buckets``, ``loaded_buckets``).
    """

    def __init__(self, state: Mapping[str, Any], *, ddp_buckets: bool = True) -> None:
        self.modules: dict[str, nn.Module] = {}
        self.optims: dict[str, tuple[torch.optim.Optimizer, nn.Module]] = {}
        self.others: dict[str, Any] = {}
        self.apps: dict[str, Any] = {}      # Stateful objects of sharded state (see above)
        self.delegated: dict[str, Any] = {}  # saved and loaded by other processes
        self._app_parts: list[tuple[nn.Module | None, torch.optim.Optimizer | None]] = []
        for name, value in state.items():
            if not isinstance(name, str) or not name or "." in name or name.startswith("rank_state"):
                raise CheckpointError(f"state key {name!r} is not allowed: use a plain name "
                                      "without dots, e.g. 'model', 'optim'")
            if isinstance(value, nn.Module):
                self.modules[name] = value
            elif is_delegated(value):
                # Saved and loaded by other processes (a Ray worker group's actors), into the
                # step directory's subdirectory ``name`` (``delegated.py``).
                self.delegated[name] = value
            elif isinstance(value, torch.optim.Optimizer):
                pass    # paired with its module below
            elif is_stateful_loader(value):
                # torchdata's StatefulDataLoader: its sampler's epoch goes along, and the
                # resumed iterator is built before the global RNG is restored (see data.py).
                self.others[name] = LoaderEntry(value)
            elif isinstance(value, DataLoader):
                raise plain_loader_error(name)
            elif isinstance(value, torch.Generator):
                self.others[name] = GeneratorEntry(value)     # its state, set back at resume
            elif callable(getattr(value, "state_dict", None)) and callable(
                    getattr(value, "load_state_dict", None)):
                # Sharded state pickled into one rank's blob could not be resharded, and
                # every rank would write its copy: DTensors go through DCP.
                modules, optims = sharded_parts(value)
                if modules or optims:
                    self.apps[name] = value
                    self._app_parts += [(m, None) for m in modules] + [(None, o) for o in optims]
                    continue
                self.others[name] = value
                warn_global_seed(name, value)
            elif isinstance(value, dict):
                # What get_state_dict returns is a snapshot of names and tensors: a resume
                # must put it back into the model (set_state_dict), which a dict cannot do.
                raise CheckpointError(
                    f"state[{name!r}] is a dict (a state dict?): pass the model and optimizer "
                    "themselves, e.g. state={'model': model, 'optim': optim} (ResilientRun calls "
                    "get_state_dict at every save and set_state_dict at resume), or an object "
                    "with state_dict()/load_state_dict() that calls them")
            else:
                raise CheckpointError(
                    f"state[{name!r}] is a {type(value).__name__}, which has no state_dict()/"
                    "load_state_dict(); pass an nn.Module, an optimizer, or an object with both "
                    "methods (wrap plain values in a small class)")
        for name, value in state.items():
            if isinstance(value, torch.optim.Optimizer):
                self.optims[name] = (value, self._owner(name, value))
        # Gradients accumulated but not applied at a save go with it (``carried.py``).
        self.grads = PendingGrads({n: o for n, (o, _) in self.optims.items()})
        # The script's own generators left out of the state, named once drawn from.
        self.generators = UnsavedGenerators()
        self._schedulers_checked = False
        self.buckets = BucketLayouts(self.modules if ddp_buckets else {})
        self.loaded_buckets: dict[str, Any] | None = None
        self._nbytes: int | None = None     # counted in the training thread (see nbytes)
        self.fresh_optims: list[str] = []   # optimizers without state at the last tensor_state
        if self.modules or self.optims or self.apps:
            _import_what_state_dicts_need()

    def _owner(self, name: str, optim: torch.optim.Optimizer) -> nn.Module:
        ids = {id(p) for g in optim.param_groups for p in g["params"]}
        for module in self.modules.values():
            if ids <= _params(module):
                return module
        raise CheckpointError(f"state[{name!r}]: no module in the state owns all of this "
                              "optimizer's parameters; add the model to the state too")

    def nbytes(self) -> int:
        """Bytes of tensor state on this rank (DTensors: their local shards; optimizer state
        not created yet counted as 2x the parameters, as for Adam): the size estimate for space
        checks and deadlines.

        Counted once, then again at each ``capture`` (the training thread, at a step
        boundary); other calls return that count. A background save asks from its own thread,
        while the training thread is mid-step: an FSDP2 module's ``state_dict()`` then runs its
        hooks on parameters that are being unsharded, and the next backward failed
        ("setStorage ... out of bounds for storage of size 0")."""
        if self._nbytes is None:
            self._nbytes = self._count_bytes()
        return self._nbytes

    def every_module(self) -> list[nn.Module]:
        """The modules, and those inside app states."""
        return [*self.modules.values(), *(m for m, _ in self._app_parts if m is not None)]

    def _sized(self) -> Iterator[tuple[torch.Tensor, int]]:
        """(tensor, times) for every tensor the state saves: modules' state, optimizer state or,
        before the optimizer has any, its parameters twice (as for Adam); the modules and
        optimizers inside app states too."""
        modules = self.every_module()
        optims = [*((o, list(m.parameters())) for o, m in self.optims.values()),
                  *((o, [p for g in o.param_groups for p in g["params"]])
                    for _, o in self._app_parts if o is not None)]
        for m in modules:
            for t in m.state_dict().values():
                if isinstance(t, torch.Tensor):
                    yield t, 1
        for optim, params in optims:
            st = [t for s in optim.state.values() for t in s.values()
                  if isinstance(t, torch.Tensor)]
            for t in st or params:
                yield t, 1 if st else 2

    def _count_bytes(self) -> int:
        return sum(times * local(t).numel() * t.element_size() for t, times in self._sized())

    def device_nbytes(self) -> tuple[int, str | None]:
        """Bytes of this rank's tensor state on an accelerator (DTensors: their local shards;
        optimizer state not created yet counted as in ``nbytes``), and that device's type
        (``"cuda"``), or (0, None) when all of it is in CPU memory."""
        total, kind = 0, None
        for t, times in self._sized():
            mine = local(t)        # a DTensor's shard on this rank
            if mine.device.type not in ("cpu", "meta"):
                total += times * mine.numel() * mine.element_size()
                kind = kind or mine.device.type
        return total, kind

    def tensor_state(self) -> dict[str, Any]:
        """The modules', optimizers' and apps' DCP state dicts: the live tensors (no copy).

        An optimizer that has not stepped yet has no state; ``get_optimizer_state_dict`` makes
        one by running a step with zero gradients (Adam's step count is then 1, and the first
        real step would be its second: another bias correction, other weights). So such an
        optimizer is left as it was found: its state dict here holds that made-up state (the
        shapes a load needs), the live optimizer none, and ``fresh_optims`` names it, so that
        a checkpoint taken before the first step restores an optimizer that has not stepped
        (``capture`` records the names, ``restore`` clears their state again)."""
        sd: dict[str, Any] = {}
        self.fresh_optims = []
        for name, module in self.modules.items():
            sd[name] = get_model_state_dict(module, options=_OPTS)
        for name, (optim, module) in self.optims.items():
            fresh = not optim.state
            # torch makes the state up only when no parameter has a gradient; in the first
            # gradient-accumulation window they do, and a checkpoint taken there had no state
            # while the fresh optimizer at resume makes one up: the load was refused (live state
            # with entries the checkpoint lacks). The gradients step aside meanwhile.
            grads = _take_grads(optim) if fresh else []
            try:
                with self.grads.paused():    # torch's made-up step applies no real gradient
                    sd[name] = get_optimizer_state_dict(module, optim, options=_OPTS)
            finally:
                for param, grad in grads:
                    param.grad = grad
            if fresh:
                optim.state.clear()     # the state dict keeps the made-up tensors it needs
                self.fresh_optims.append(name)
        for name, app in self.apps.items():
            sd[name] = app.state_dict()
        return sd

    def loop_starts(self) -> None:
        """The training loop's first step begins: each ``ResumableLoader`` learns how many
        batches the loop carries in (its look-ahead), an LR scheduler left out of the state is
        named, and the script's generators left out of it are watched (``generators.py``)."""
        for obj in self.others.values():
            if isinstance(obj, ResumableLoader):
                obj.loop_starts()
        self.check_schedulers()
        self.generators.watch(held_generators(self.others.values()))

    def check_schedulers(self) -> None:
        """Rank 0, once (at the loop's start, else at the first save): an optimizer in the
        state that an LR scheduler drives, with the scheduler not in the state."""
        if self._schedulers_checked:
            return
        self._schedulers_checked = True
        names = unsaved_schedulers({n: o for n, (o, _) in self.optims.items()}, self.others)
        if names and log_rank() == 0:
            log.warning("an LR scheduler drives optimizer %s but is not in the state: a resume "
                        "starts its schedule again (the learning rate jumps). Add it: "
                        "state={..., \"sched\": scheduler}", ", ".join(repr(n) for n in names))

    def capture(self, step: int, rank: int) -> dict[str, Any]:
        """The DCP state dict for a save. Tensors are the live ones (no copy); the rank's blob
        also holds the gradients of an unfinished accumulation window (``carried.py``)."""
        self.check_schedulers()
        pending = self.grads.pending()     # before tensor_state: it may step a fresh optimizer
        sd = self.tensor_state()
        self._nbytes = self._count_bytes()
        blob = {"step": step, "rng": capture_rng(),
                "objects": {n: o.state_dict() for n, o in self.others.items()},
                "fresh_optims": list(self.fresh_optims)}
        self.generators.check(blob["objects"])
        if pending:
            blob["grads"] = pending
            self.grads.say(step, pending)
        if self.buckets.ddps:
            blob[RECORD_KEY] = self.buckets.record()
        buf = io.BytesIO()
        torch.save(blob, buf)
        sd[rank_key(rank)] = buf.getvalue()
        return sd

    def load_template(self, rank: int, saved_keys: set[str], world_size: int = 1
                      ) -> tuple[dict[str, Any], str | None]:
        """A state dict DCP loads into in place, and which rank's blob it holds.

        DCP reshards tensors (FSDP2/HSDP at another mesh, DDP at another world size); per-rank
        state cannot be resharded: at another world size rank r takes saved rank r's blob, or
        ``r % saved`` when the checkpoint was written by fewer ranks (``sharded.blob_source``),
        and rank 0 says so once.
        """
        sd = self.tensor_state()
        saved = saved_ranks(saved_keys)
        source = blob_source(rank, world_size, saved)
        if rank == 0 and (line := world_change_line(world_size, saved)) is not None:
            log.warning("%s", line)
        if saved == 0:
            log.warning("checkpoint has no per-rank state: RNG/scheduler/data state not "
                        "restored")
        key = None if source is None else rank_key(source)
        if key is not None and key not in saved_keys:
            log.warning("checkpoint has no state for rank %d: RNG/scheduler/data state not "
                        "restored", source)
            key = None
        if key is not None:
            sd[key] = b""
        return sd, key

    @staticmethod
    def read_blob(sd: dict[str, Any], blob_key: str | None) -> dict[str, Any] | None:
        """This rank's loaded blob (step, RNG streams, objects), or None without one."""
        if blob_key is None:
            return None
        return torch.load(io.BytesIO(sd[blob_key]), map_location="cpu", weights_only=False)

    def restore(self, sd: dict[str, Any], blob_key: str | None,
                blob: dict[str, Any] | None = None) -> int | None:
        """Apply a loaded state dict (``blob``: its blob, when already read with
        ``read_blob``); returns the saved step (None without a blob)."""
        for name, module in self.modules.items():
            set_model_state_dict(module, sd[name], options=_OPTS)
        for name, (optim, module) in self.optims.items():
            set_optimizer_state_dict(module, optim, sd[name], options=_OPTS)
        for name, app in self.apps.items():
            app.load_state_dict(sd[name])
        if blob is None:
            blob = self.read_blob(sd, blob_key)
        if blob is None:
            return None
        for name in blob.get("fresh_optims", ()):
            if name in self.optims:     # saved before its first step: it has not stepped
                self.optims[name][0].state.clear()
        for name, obj in self.others.items():
            if name in blob["objects"]:
                obj.load_state_dict(blob["objects"][name])
            else:
                log.warning("checkpoint has no state for %r; left as is", name)
        self.grads.restore(blob.get("grads"))
        # Last: a loader's load_state_dict may draw from the global RNG (a StatefulDataLoader
        # builds its iterator there); the checkpoint's streams overwrite that draw.
        restore_rng(blob["rng"])
        self.loaded_buckets = blob.get(RECORD_KEY)
        return int(blob["step"])
