"""Checkpointing: fast checksummed DCP saves, atomic commits, exact resume.

``CheckpointManager`` is the entry point; see ``manager.py``. Files are standard DCP checkpoints
(``torch.distributed.checkpoint.load`` with a stock ``FileSystemReader`` reads them); a step
directory counts only once its ``MANIFEST.json`` commit exists.

``CheckpointManager`` is imported on first use: it pulls in torch and DCP (about a second),
which `kempner-resilience ls`/`verify` do not need.
"""

from typing import Any

from kempner_resilience.checkpoint.info import (
    CheckpointCommitted,
    CheckpointCorrupt,
    CheckpointDirError,
    CheckpointError,
    CheckpointInfo,
    LineageDamagedError,
    SavePeerLost,
)
from kempner_resilience.checkpoint.layout import MANIFEST_NAME

__all__ = ["CheckpointManager", "CheckpointInfo", "CheckpointError", "CheckpointCommitted",
           "CheckpointCorrupt", "CheckpointDirError", "LineageDamagedError", "SavePeerLost",
           "MANIFEST_NAME"]


def __getattr__(name: str) -> Any:
    if name == "CheckpointManager":
        from kempner_resilience.checkpoint.manager import CheckpointManager

        return CheckpointManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
