"""Rank-aware logging: every record of ours says which rank wrote it, or, in a launcher or an
agent (not a rank), which of those wrote it."""

from __future__ import annotations

import logging
import os

ROOT = "kempner_resilience"

# Set by a launcher's or an agent's entry point (``set_role``). A process-wide global, not an
# environment variable: the ranks it starts must not inherit it, and a launcher that was itself
# started with RANK/SLURM_PROCID in its environment (an srun task, a batch shell) is no rank.
_role: str | None = None


def rank() -> int:
    """This process's global rank as the launcher set it (0 when not distributed)."""
    for var in ("RANK", "SLURM_PROCID"):
        val = os.environ.get(var)
        if val is not None and val.strip().isdigit():
            return int(val)
    return 0


def set_role(role: str | None) -> str | None:
    """Say that this process is not a rank but ``role`` (``launcher``, ``agent``, ...): its
    lines are labelled ``[role]`` instead of ``[rank N]``. None: a rank again. Returns the
    role before (a caller running in someone else's process puts it back)."""
    global _role
    previous, _role = _role, role
    return previous


def label() -> str:
    """Who writes this process's lines: ``rank N``, or the role ``set_role`` gave it."""
    return _role if _role is not None else f"rank {rank()}"


class _RankAdapter(logging.LoggerAdapter):
    def process(self, msg, kwargs):
        return f"[{label()}] {msg}", kwargs


def get_logger(name: str) -> logging.LoggerAdapter:
    """A logger under ``kempner_resilience`` whose messages start with ``[rank N]`` (or the
    process's role, see ``set_role``)."""
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
