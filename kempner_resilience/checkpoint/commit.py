"""The commit: rank 0 writes the manifest once every rank's files are durable, and the words
for a save that did not commit.

The manifest lists every file with its size and CRC-32 (data files also per record), the
ownership marker included, so ``verify`` and resume check everything the same way. Writing it
is the atomic rename in ``layout.write_manifest``: before it the directory is a partial save,
after it a checkpoint.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path
from typing import Any

import torch

from kempner_resilience.checkpoint import layout
from kempner_resilience.checkpoint.dircheck import disk_full, full_words
from kempner_resilience.checkpoint.info import CheckpointInfo, describe_error
from kempner_resilience.checkpoint.lease import Lease, LeaseLost
from kempner_resilience.core.version import __version__

__all__ = ["commit", "failure_text", "LOST_PREFIX"]

#: How a commit's or a save's status text says the lease was lost (all ranks raise LeaseLost).
LOST_PREFIX = "lease lost: "


def commit(path: Path, step: int, reason: str, gathered: list[Any], t0: float, blocked: float,
           world_size: int, manifest: dict[str, Any],
           extra: dict[str, Any] | None = None,
           lease: Lease | None = None) -> str | None:
    """Rank 0: write the manifest (filled into ``manifest``) if every rank succeeded, given
    each rank's ``(files, error)``; returns an error text or None. ``extra`` (the run id, the
    SLURM job id and restart count) is recorded too. ``lease`` (the directory's) is checked
    right before the manifest's rename, the commit itself: a run that lost it commits nothing,
    and the text then starts with ``LOST_PREFIX``."""
    errors = [f"rank {r}: {e}" for r, (_, e) in enumerate(gathered) if e]
    if errors:
        return "; ".join(errors)
    files: dict[str, Any] = {}
    for rank_files, _ in gathered:
        files.update(rank_files)
    try:
        marker = path / layout.MARKER_NAME
        files[layout.MARKER_NAME] = {"size": marker.stat().st_size,
                                     "crc32": layout.file_crc(marker), "rank": 0}
    except OSError as e:
        return describe_error(e)
    manifest.update({
        "format": layout.FORMAT, "step": step, "world_size": world_size,
        "reason": reason, "committed_at": time.time(),
        "nbytes": sum(m["size"] for n, m in files.items() if n.endswith(".distcp")),
        "save_seconds": time.monotonic() - t0, "blocked_seconds": blocked,
        "torch": torch.__version__, "host": socket.gethostname(),
        "kempner_resilience": __version__, **(extra or {}), "files": files})
    try:
        # The check runs once the manifest's bytes are durable, right before the rename: a
        # takeover during the write itself (seconds for a large save) is seen too.
        layout.write_manifest(path, manifest, None if lease is None else lease.check)
    except LeaseLost as e:
        return LOST_PREFIX + str(e)
    except OSError as e:
        return describe_error(e)
    return None


def failure_text(step: int, path: Path, status: str, root: Path,
                 previous: CheckpointInfo | None, keep_last: int | None = None) -> str:
    """What failed, the fix, and that the previous checkpoint is intact. A full disk says
    whether bytes or inodes ran out (``dircheck.note_inodes`` marked ``status``), and that
    ``keep_last`` checkpoints need room for one more while the next one is written."""
    keep = (f"the previous committed checkpoint {previous.path} (step {previous.step}) is intact"
            if previous else "there is no previous committed checkpoint")
    if disk_full(status):
        partial = "no partial directory was left" if path == root else \
            f"the partial {path} was removed"
        what, fix = full_words(status, root)
        room = "" if keep_last is None else (
            f" Retention deletes the oldest checkpoint only after the next one is committed, so "
            f"checkpoint.keep_last: {keep_last} needs room for {keep_last + 1} checkpoints there.")
        return (f"checkpoint of step {step} failed: {what}. {fix}; {partial} and {keep}.{room}")
    return (f"checkpoint of step {step} into {path} failed: {status}. The partial directory "
            f"was removed; {keep}.")
