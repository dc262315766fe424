"""Rank-aware logging: every record of ours says which rank wrote it."""

from __future__ import annotations

import logging
import os

ROOT = "kempner_resilience"


def rank() -> int:
    """This process's global rank as the launcher set it (0 when not distributed)."""
    for var in ("RANK", "SLURM_PROCID"):
        val = os.environ.get(var)
        if val is not None and val.strip().isdigit():
            return int(val)
    return 0


class _RankAdapter(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        return f"[rank {rank()}] {msg}", kwargs


def get_logger(name: str) -> logging.LoggerAdapter:
    """A logger under ``kempner_resilience`` whose messages start with ``[rank N]``."""
    if not name.startswith(ROOT):
        name = f"{ROOT}.{name}"
    return _RankAdapter(logging.getLogger(name), {})


def announce(logger: logging.LoggerAdapter, msg: str, *args: object) -> None:
    """Log a line the user must see once per run (resumed or fresh) at INFO, or at WARNING when
    logging was never configured: Python then shows nothing below WARNING, and a resume that
    looks like a fresh start is how users lose track of their runs."""
    if logger.isEnabledFor(logging.INFO):
        logger.info(msg, *args)
    else:
        logger.warning(msg, *args)


def configure(level: int | str = logging.INFO) -> None:
    """For scripts and the CLI (never called by the library itself): log ours to stderr."""
    logger = logging.getLogger(ROOT)
    if not any(getattr(h, "_kempner", False) for h in logger.handlers):
        h = logging.StreamHandler()
        h._kempner = True  # type: ignore[attr-defined]
        h.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s",
                                         "%H:%M:%S"))
        logger.addHandler(h)
    logger.setLevel(level)
