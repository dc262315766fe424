"""One committed checkpoint as flat, classified entries, read without a live state.

``check-resume`` compares two runs' checkpoints of the same step entry by entry, and its
diagnosis needs to know what each entry is: a module's weight, an optimizer's moment, its
learning rate, a scheduler's position, a data loader's position, an RNG stream. The DCP part
(modules, optimizers, FSDP apps) is read with torch's own converter (no process group, no
template); each rank's blob (``rank_state.rank<r>``: RNG streams, the other objects'
``state_dict()``) is unpacked, so its entries are compared one by one instead of as one opaque
byte string.
"""

from __future__ import annotations

import enum
import io
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from kempner_resilience.checkpoint.ddp_buckets import RECORD_KEY as DDP_BUCKETS
from kempner_resilience.checkpoint.statekeys import BLOB_PREFIX

__all__ = ["Kind", "Snapshot", "read_snapshot"]

# Learning-rate entries of an optimizer's param groups: what an LR scheduler writes.
_LR_FIELDS = {"lr", "initial_lr"}
# A scheduler's own state (torch.optim.lr_scheduler.LRScheduler.state_dict()).
_SCHEDULER_FIELDS = {"last_epoch", "_last_lr", "base_lrs", "_step_count"}
# Words in a data loader's state: ResumableLoader's (epoch, batch), StatefulDataLoader's
# (_num_yielded, _sampler_iter_yielded, ...), a sampler's.
_LOADER_WORDS = ("epoch", "batch", "yielded", "sampler", "loader")


class Kind(enum.Enum):
    """What a checkpoint entry is, as the diagnosis needs it."""

    MODEL = "model"                # a module's parameter or buffer
    OPTIMIZER = "optimizer"        # an optimizer's state (moments, step counts)
    LR = "learning rate"           # an optimizer param group's lr / initial_lr
    SCHEDULER = "scheduler"        # an LR scheduler object's state
    LOADER = "data position"       # a data loader's (or sampler's) position
    RNG = "RNG stream"             # a global RNG stream, or a generator an object saves
    OBJECT = "object"              # another object's state_dict() entry
    META = "bookkeeping"           # the step, ...
    # DDP's gradient-bucket layout (checkpoint/ddp_buckets.py): recorded once DDP logs it, so
    # a resumed process records none for a while where an uninterrupted one has it. What it
    # determines, how gradients are summed, shows in the model and optimizer entries.
    LAYOUT = "DDP bucket layout"


@dataclass(frozen=True)
class Snapshot:
    """The entries of one checkpoint: flat key -> value, and each key's kind."""

    step: int
    path: Path
    entries: Mapping[str, Any]
    kinds: Mapping[str, Kind]


def _flatten(prefix: str, value: Any, out: dict[str, Any]) -> None:
    """Dicts, and lists that hold dicts or tensors, become keys; anything else is one value
    (a Python RNG state, a list of floats)."""
    if isinstance(value, Mapping):
        for k, v in value.items():
            _flatten(f"{prefix}.{k}" if prefix else str(k), v, out)
    elif isinstance(value, (list, tuple)) and any(isinstance(v, (Mapping, torch.Tensor))
                                                  for v in value):
        for i, v in enumerate(value):
            _flatten(f"{prefix}.{i}", v, out)
    else:
        out[prefix] = value


#: What a log records of the wall clock (the Trainer's ``eval_runtime``,
#: ``train_samples_per_second``): two runs never agree on it, and no training step reads it.
_CLOCK_SUFFIXES = ("_runtime", "_per_second")


def _json_opened(flat: dict[str, Any]) -> dict[str, Any]:
    """An object that keeps its state as JSON text (the Trainer's ``TrainerState``) compared
    field by field, so a difference names its field, with the wall-clock fields left out."""
    out: dict[str, Any] = {}
    for k, v in flat.items():
        if not (k.endswith(".json") and isinstance(v, str)):
            out[k] = v
            continue
        try:
            parsed = json.loads(v)
        except ValueError:
            out[k] = v
            continue
        fields: dict[str, Any] = {}
        _flatten(k, parsed, fields)
        out.update((f, x) for f, x in fields.items() if not f.endswith(_CLOCK_SUFFIXES))
    return out


def _is_generator(key: str) -> bool:
    """A generator's state inside an object's (``objects.noise.generator``, a loader's
    ``objects.data.generators.0``): an RNG stream, whatever the object it belongs to."""
    parts = key.split(".")
    return parts[-1] in ("generator", "generators") or \
        (len(parts) > 1 and parts[-2] == "generators" and parts[-1].isdigit())


def _is_optimizer(value: Any) -> bool:
    # An optimizer's "state" is empty (and left out by DCP) until it keeps any (plain SGD).
    return isinstance(value, Mapping) and "param_groups" in value


def _object_kind(state: Any) -> Kind:
    keys = {str(k) for k in state} if isinstance(state, Mapping) else set()
    if keys & _SCHEDULER_FIELDS:
        return Kind.SCHEDULER
    if any(w in k.lower() for k in keys for w in _LOADER_WORDS):
        return Kind.LOADER
    return Kind.OBJECT


def _blob(key: str, value: Any, entries: dict[str, Any], kinds: dict[str, Kind]) -> None:
    """One rank's blob, as ``rank<r>:rng.torch``, ``rank<r>:objects.sched.last_epoch``, ..."""
    if isinstance(value, (bytes, bytearray)):
        value = torch.load(io.BytesIO(value), map_location="cpu", weights_only=False)
    rank = key[len(BLOB_PREFIX):]
    if not isinstance(value, Mapping):
        entries[rank] = value
        kinds[rank] = Kind.META
        return
    for part, content in value.items():
        flat: dict[str, Any] = {}
        if part == "objects" and isinstance(content, Mapping):
            for name, state in content.items():
                kind = _object_kind(state)
                one: dict[str, Any] = {}
                _flatten(f"objects.{name}", state, one)
                for k, v in _json_opened(one).items():
                    entries[f"{rank}:{k}"] = v
                    kinds[f"{rank}:{k}"] = Kind.RNG if _is_generator(k) else kind
            continue
        _flatten(str(part), content, flat)
        for k, v in flat.items():
            entries[f"{rank}:{k}"] = v
            kinds[f"{rank}:{k}"] = Kind.RNG if part == "rng" else \
                Kind.LAYOUT if part == DDP_BUCKETS else Kind.META


def read_snapshot(step_dir: Path, step: int) -> Snapshot:
    """The committed checkpoint in ``step_dir`` (of ``step``) as a ``Snapshot``."""
    with tempfile.TemporaryDirectory(prefix="kr-check-resume-") as tmp:
        out = Path(tmp) / "state.pt"
        dcp_to_torch_save(step_dir, out)
        sd = torch.load(out, map_location="cpu", weights_only=False)
    entries: dict[str, Any] = {}
    kinds: dict[str, Kind] = {}
    for key, value in sd.items():
        if key.startswith(BLOB_PREFIX):
            _blob(key, value, entries, kinds)
            continue
        flat: dict[str, Any] = {}
        _flatten(key, value, flat)
        optimizer = _is_optimizer(value)
        for k, v in flat.items():
            entries[k] = v
            if not optimizer:
                kinds[k] = Kind.MODEL
            else:
                kinds[k] = Kind.LR if k.rsplit(".", 1)[-1] in _LR_FIELDS and \
                    ".param_groups." in k else Kind.OPTIMIZER
    return Snapshot(step, step_dir, entries, kinds)
