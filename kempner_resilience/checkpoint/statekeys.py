"""Does the live state match what a checkpoint holds? Compared before anything is loaded.

DCP loads the keys of the destination state dict and ignores the rest of the checkpoint: a layer
removed from the model, or ``optim`` left out of ``state`` in a later version of the script,
resumed with exit 0 and no word, and ``keep_last`` saves later the only copies of those tensors
were gone. The other way round (a key the checkpoint lacks: an LR scheduler attached to the
optimizer since, which adds ``initial_lr`` to its param groups) failed in torch's words
("Missing key in checkpoint state_dict: optim.param_groups.0.initial_lr") and made resume fall
back to older checkpoints that lack it as well.

``compare`` finds both, and the tensors whose dtype changed (an fp32 checkpoint loaded into a
bf16 model is rounded: one warning line). ``refusal`` words the mismatch with its likely cause
and both ways out: the script that matches the checkpoint, or ``checkpoint.allow_partial_resume``
(which also pins the full checkpoint, see ``pinned``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

__all__ = ["KeyDiff", "compare", "objects", "refusal", "partial_note", "dtype_line", "BLOB_PREFIX"]

BLOB_PREFIX = "rank_state."      # the per-rank blobs (state.rank_key): never compared
_SHOW = 8                        # keys named in a message; the rest are counted


@dataclass
class KeyDiff:
    """What the checkpoint holds that the live state lacks (``dropped``: a resume would lose
    it), what the live state holds that the checkpoint lacks (``added``: a resume cannot fill
    it), and the tensors whose dtype differs (``dtypes``: key -> (saved, live))."""

    dropped: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    dtypes: dict[str, tuple[str, str]] = field(default_factory=dict)
    live: set[str] = field(default_factory=set)       # every key on each side, for the words
    saved: set[str] = field(default_factory=set)

    @property
    def mismatch(self) -> bool:
        return bool(self.dropped or self.added)


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def compare(template: Mapping[str, Any], saved: Mapping[str, Any]) -> KeyDiff:
    """The live load template (``TrainState.load_template``'s state dict, nested as DCP gets
    it) against a checkpoint's ``metadata.state_dict_metadata`` (flat keys -> storage
    metadata). The per-rank blobs are left out: their keys depend on the world size (see
    ``sharded.blob_source``); the objects inside them are compared once read (``objects``)."""
    flat, _ = flatten_state_dict(dict(template))
    live = {k: v for k, v in flat.items() if not k.startswith(BLOB_PREFIX)}
    keys = {k for k in saved if not k.startswith(BLOB_PREFIX)}
    diff = KeyDiff(dropped=sorted(keys - set(live)), added=sorted(set(live) - keys),
                   live=set(live), saved=keys)
    for k in sorted(keys & set(live)):
        value, props = live[k], getattr(saved[k], "properties", None)
        saved_dtype = getattr(props, "dtype", None)
        if isinstance(value, torch.Tensor) and saved_dtype is not None \
                and saved_dtype != value.dtype:
            diff.dtypes[k] = (_dtype_name(saved_dtype), _dtype_name(value.dtype))
    return diff


def objects(live: Iterable[str], saved: Iterable[str]) -> KeyDiff:
    """The objects of the per-rank blob (scheduler, data loader, ...) the checkpoint holds and
    the live state lacks. One the live state has and the checkpoint lacks is not a loss: it
    keeps its state (``TrainState.restore`` says so)."""
    return KeyDiff(dropped=sorted(set(saved) - set(live)), live=set(live), saved=set(saved))


def _listed(keys: list[str], show: int = _SHOW) -> str:
    more = f" and {len(keys) - show} more" if len(keys) > show else ""
    return ", ".join(keys[:show]) + more


def _tops(keys: Iterable[str]) -> set[str]:
    return {k.split(".", 1)[0] for k in keys}


def _scheduler_keys(keys: Iterable[str]) -> bool:
    # torch's LR schedulers write `initial_lr` into every param group when created.
    return any(".param_groups." in k and k.endswith(".initial_lr") for k in keys)


def _state_of_live_params(diff: KeyDiff) -> bool:
    """Every dropped key is optimizer state (``optim.state.<param>.<what>``) of a parameter
    the live model still has (``model.<param>``): the optimizer made no state for it."""
    params = {k.split(".", 1)[1] for k in diff.live if "." in k}
    for k in diff.dropped:
        top, _, rest = k.partition(".")
        head, _, param_what = rest.partition(".")
        if head != "state" or param_what.rpartition(".")[0] not in params:
            return False
    return bool(diff.dropped)


def _dropped_cause(diff: KeyDiff) -> str:
    if _scheduler_keys(diff.dropped) and all(".param_groups." in k for k in diff.dropped):
        return ("the optimizer had an LR scheduler when the checkpoint was written and has "
                "none now (schedulers add `initial_lr` to its param groups)")
    if _state_of_live_params(diff):
        return ("the optimizer has no state for parameters the model still has (frozen since "
                "the checkpoint: requires_grad=False?)")
    gone = sorted(_tops(diff.dropped) - _tops(diff.live))
    if gone:
        names = ", ".join(f"{n!r}" for n in gone)
        return (f"state[{names}] {'is' if len(gone) == 1 else 'are'} not in the state passed "
                "to ResilientRun but in the checkpoint (left out of `state`?)")
    return "the model or optimizer has fewer entries than when it was saved (a layer removed?)"


def _added_cause(diff: KeyDiff) -> str:
    if _scheduler_keys(diff.added):
        return ("an LR scheduler was attached to the optimizer since the checkpoint was "
                "written (schedulers add `initial_lr` to its param groups)")
    new = sorted(_tops(diff.added) - _tops(diff.saved))
    if new:
        names = ", ".join(f"{n!r}" for n in new)
        return f"state[{names}] was added to the state since the checkpoint was written"
    return "the model or optimizer has more entries than when it was saved (a layer added?)"


def _entries(n: int) -> str:
    return f"{n} {'entry' if n == 1 else 'entries'}"


def _grouped(keys: list[str], other_tops: set[str]) -> str:
    """The keys, a whole top-level name the other side lacks said once (``optim`` (24
    entries)) instead of its entries one by one."""
    whole = sorted(_tops(keys) - other_tops)
    rest = [k for k in keys if k.split(".", 1)[0] not in whole]
    named = [f"{t} ({_entries(sum(k.split('.', 1)[0] == t for k in keys))})" for t in whole]
    return _listed(named + rest)


def refusal(path: str, diff: KeyDiff) -> str:
    """Why ``path`` is not resumed from, its likely cause, and the two ways out."""
    live, saved = _tops(diff.live), _tops(diff.saved)
    parts = []
    if diff.dropped:
        parts.append(f"it holds {_entries(len(diff.dropped))} the live state lacks "
                     f"({_grouped(diff.dropped, live)}): {_dropped_cause(diff)}; resuming "
                     "would silently drop them, and later saves would lose them for good")
    if diff.added:
        parts.append(f"the live state has {_entries(len(diff.added))} the checkpoint lacks "
                     f"({_grouped(diff.added, saved)}): {_added_cause(diff)}")
    pin = (", and the full checkpoint is kept out of retention (pinned in "
           "checkpoint.dir/pinned.json)") if diff.dropped else ""
    return (f"refusing to resume from {path}: " + "; ".join(parts) + ". Fix: run the code that "
            "wrote this checkpoint (the same model and `state` keys), or, to resume only what "
            "both have, set checkpoint.allow_partial_resume: true (--set "
            "checkpoint.allow_partial_resume=true): entries the checkpoint lacks keep their "
            f"current values{pin}")


def partial_note(path: str, diff: KeyDiff) -> str:
    """The warning of a partial resume the user asked for."""
    parts = []
    if diff.dropped:
        parts.append(f"not loaded from it: {_grouped(diff.dropped, _tops(diff.live))} (the "
                     "full checkpoint is pinned: retention keeps it)")
    if diff.added:
        parts.append("keeping their current values (absent from it): "
                     f"{_grouped(diff.added, _tops(diff.saved))}")
    return f"partial resume from {path} (checkpoint.allow_partial_resume): " + "; ".join(parts)


def dtype_line(path: str, diff: KeyDiff) -> str | None:
    """One line for every tensor loaded into another dtype than it was saved in, or None."""
    if not diff.dtypes:
        return None
    pairs = Counter(diff.dtypes.values())
    what = ", ".join(f"{n} saved as {a} load into {b}" for (a, b), n in pairs.most_common())
    return (f"{path}: {len(diff.dtypes)} tensors change dtype ({what}; e.g. "
            f"{_listed(list(diff.dtypes), 3)}): values are converted to the live dtype "
            "(rounded when it is narrower)")
