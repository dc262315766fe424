"""Setting a damaged checkpoint aside: renamed, kept for inspection, never counted again.

A committed checkpoint whose bytes prove it damaged at resume (``CheckpointDamaged``: a checksum
that does not match, a truncated or missing file) would otherwise stay the "newest committed"
one: every later resume tries it first, and retention keeps it as the newest and deletes the good
ones below it (``keep_last`` counts it). Rank 0 renames it to
``.damaged-step_000000030-<why>``: the name no longer matches the step pattern, so neither
``scan`` (so ``ls``), resume, retention nor ``clean_trash`` ever sees it again, and it is left on
disk for the user to inspect and delete. A ``DAMAGED.txt`` in it says why.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

from kempner_resilience.core.fileio import fsync_dir
from kempner_resilience.core.log import get_logger
from kempner_resilience.core.runpaths import RunPaths

__all__ = ["NOTE_NAME", "set_aside", "why_word"]

log = get_logger(__name__)

NOTE_NAME = "DAMAGED.txt"

# The first pattern found in the failure names the directory: short, and enough to tell a flipped
# byte from a cut-off file at a glance (the full text is in DAMAGED.txt and the log).
_WORDS = (("checksum mismatch", "checksum"), ("truncated", "truncated"),
          ("ends early", "truncated"), ("manifest says", "size"), ("longer than", "size"),
          ("missing", "missing-file"))


def why_word(why: str) -> str:
    """One word for the directory name: what the failure says is wrong."""
    for pattern, word in _WORDS:
        if pattern in why:
            return word
    return "damaged"


def set_aside(path: Path, why: str) -> Path | None:
    """Rename the damaged checkpoint ``path`` aside (rank 0) and log it; its new path, or None
    when it could not be renamed (then it stays where it is: resume already skips it, and the
    run protects it from its own retention)."""
    word, n = why_word(why), 0
    target = path.parent / RunPaths.damaged_name(path.name, word)
    while os.path.lexists(target):          # the same step damaged twice: keep both
        n += 1
        target = path.parent / RunPaths.damaged_name(path.name, word, n)
    try:
        os.rename(path, target)
        fsync_dir(path.parent)
    except OSError as e:
        log.warning("cannot set the damaged checkpoint %s aside (%s); it stays, and resume "
                    "keeps skipping it", path, e.strerror or e)
        return None
    with contextlib.suppress(OSError):      # a note for whoever looks; its absence is harmless
        (target / NOTE_NAME).write_text(
            f"{time.strftime('%Y-%m-%d %H:%M:%S')}: resume found {path.name} damaged and set "
            f"it aside:\n{why}\n")
    log.warning("checkpoint %s is damaged (%s); set it aside as %s (kept for inspection, never "
                "resumed from or counted by retention again; delete it when done)",
                path, why, target.name)
    return target
