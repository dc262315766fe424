"""Checkpoints retention must keep whatever ``keep_last`` says: ``checkpoint.dir/pinned.json``.

A partial resume (``checkpoint.allow_partial_resume``) loads only part of a checkpoint; the
entries it left out exist nowhere else. The checkpoint it resumed from is therefore pinned here
by rank 0 before training goes on, and retention never deletes a pinned directory. The file is
small JSON, written whole (``fileio.write_atomic``), and a person may edit it: removing an entry
(or the file) hands that checkpoint back to retention.

A pin file that cannot be read does not mean "nothing pinned": ``read`` raises and retention
deletes nothing until it is fixed or removed.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from kempner_resilience.core.fileio import parse_json, read_bounded, write_atomic
from kempner_resilience.core.runpaths import RunPaths

__all__ = ["pin", "read"]

_MAX_BYTES = 1 << 20       # thousands of pins; a larger file is not ours


def _load(paths: RunPaths) -> list[dict[str, Any]]:
    file = paths.pinned
    try:
        raw = read_bounded(file, _MAX_BYTES)      # a FIFO never blocks, /dev/zero is refused
    except FileNotFoundError:
        return []
    except OSError as e:
        raise OSError(f"{file} cannot be read ({e.strerror or e}); retention deletes nothing "
                      "until it is removed") from None
    try:
        pins = parse_json(raw)["pinned"]
        if not isinstance(pins, list) or not all(
                isinstance(p, dict) and isinstance(p.get("dir"), str) for p in pins):
            raise ValueError("'pinned' must be a list of {\"dir\": ...} entries")
    except (ValueError, KeyError, TypeError) as e:
        raise OSError(f"{file} cannot be read ({type(e).__name__}: {str(e)[:200]}); retention "
                      "deletes nothing until it is fixed or removed") from None
    return pins


def read(paths: RunPaths) -> set[Path]:
    """The pinned step directories of the run (empty when there is no pin file). Raises
    OSError when the file exists but cannot be read or parsed (see the module docstring)."""
    return {paths.root / Path(p["dir"]).name for p in _load(paths)}


def pin(paths: RunPaths, step_dir: Path, why: str) -> None:
    """Record ``step_dir`` (a directory directly in the run's directory) as pinned, with ``why``.
    Rank 0 only; raises OSError when it cannot be written (the caller must not go on: an
    unpinned partial resume would lose the full checkpoint to retention)."""
    pins = _load(paths)      # unreadable: raised, never overwritten (its pins would be lost)
    if any(Path(p["dir"]).name == step_dir.name for p in pins):
        return
    pins.append({"dir": step_dir.name, "why": why[:500], "pinned_at": time.time()})
    write_atomic(paths.pinned, json.dumps({"format": 1, "pinned": pins}, indent=1) + "\n")
