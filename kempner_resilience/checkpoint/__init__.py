"""Checkpointing: fast checksummed DCP saves, atomic commits, exact resume.

``CheckpointManager`` is the entry point; see ``manager.py``. Files are standard DCP checkpoints
(``torch.distributed.checkpoint.load`` with a stock ``FileSystemReader`` reads them); a step
directory counts only once its ``MANIFEST.json`` commit exists.
"""

from kempner_resilience.checkpoint.info import CheckpointCorrupt, CheckpointError, CheckpointInfo
from kempner_resilience.checkpoint.layout import MANIFEST_NAME
from kempner_resilience.checkpoint.manager import CheckpointManager

__all__ = ["CheckpointManager", "CheckpointInfo", "CheckpointError", "CheckpointCorrupt",
           "MANIFEST_NAME"]
