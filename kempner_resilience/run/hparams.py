"""The optimizer settings a resume replaces: what the script set, against what the checkpoint
restored.

Loading an optimizer's state dict restores its ``param_groups`` hyperparameters (learning rate,
momentum, weight decay, ...) over the values the script just passed to the constructor. That is
what exact resume needs, and a surprise for anyone who re-runs a script with a new learning rate
in an old directory: the start line names every setting the checkpoint replaced.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["snapshot", "differences"]

# A start line, not a dump: the first few differences, then how many more.
_MAX_SHOWN = 6


def _plain(value: Any) -> bool:
    """A hyperparameter worth comparing: a number, a flag, a string, None, or a tuple of those
    (``betas``). Tensors (a capturable ``lr``) and parameter lists are left out."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    return isinstance(value, tuple) and all(_plain(v) for v in value)


def snapshot(state: Mapping[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """``{state key: [group settings, ...]}`` for every optimizer in ``state`` (anything with
    ``param_groups``), without the parameters."""
    out: dict[str, list[dict[str, Any]]] = {}
    for key, value in state.items():
        groups = getattr(value, "param_groups", None)
        if not isinstance(groups, list):
            continue
        out[str(key)] = [{k: v for k, v in g.items() if k != "params" and _plain(v)}
                         for g in groups if isinstance(g, dict)]
    return out


def differences(before: dict[str, list[dict[str, Any]]],
                after: dict[str, list[dict[str, Any]]]) -> list[str]:
    """``["optim.lr 0.1 (script: 0.01)", ...]``: each setting the load changed, named by state
    key (and group index when an optimizer has several groups)."""
    out: list[str] = []
    for key, groups in after.items():
        old_groups = before.get(key, [])
        for i, group in enumerate(groups):
            old = old_groups[i] if i < len(old_groups) else {}
            where = key if len(groups) == 1 else f"{key}[{i}]"
            for name, value in group.items():
                if name in old and old[name] != value:
                    out.append(f"{where}.{name} {value!r} (script: {old[name]!r})")
    if len(out) > _MAX_SHOWN:
        out = out[:_MAX_SHOWN] + [f"and {len(out) - _MAX_SHOWN} more"]
    return out
