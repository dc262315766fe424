"""RunPaths: the one object that names every entry of a run's directory (``checkpoint.dir``).

A run's directory holds more than its checkpoints: the run's identity, the lease, the ledger,
the pins, the bad nodes, the restart decisions, the rescue files, the forced-exit markers and
the ranks' endings and the names a checkpoint is renamed to when it is deleted or set aside. Every module that reads or
writes one of them takes a ``RunPaths`` and asks it for the path, so that the names are spelled
once, here, and nothing else reads ``checkpoint.dir`` from the configuration
(``tests/test_architecture.py`` checks both). The model is submitit's ``JobPaths``.

The names are on-disk format: existing runs' directories must keep working, so a name never
changes here without a migration.

What lies inside one entry is the format of that entry's owner, not named here: the files of a
step directory (``MANIFEST.json``, ``OWNER.json``, DCP's files: ``checkpoint/layout.py``) and of
one rescue attempt's directory (``rescue/files.py``).

This module lives in ``core/``, with no import from the package, because the modules that name
entries span every layer below ``run/``: ``checkpoint/``, ``slurm/`` (bad nodes, the restart
decisions), ``rescue/``, ``integrations/`` (the torchrun agents' memory) and ``stop/`` (the
forced-exit markers). ``from_config`` reads the configuration by its attribute path only, so
``core/`` still does not import ``config/``.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["RunPaths"]

_STEP_RE = re.compile(r"^step_(\d{9,})(?:\.(\d+))?$")
_DAMAGED_RE = re.compile(r"^\.damaged-(step_\d{9,}(?:\.\d+)?)-[a-z-]+(?:\.\d+)?$")


@dataclass(frozen=True)
class RunPaths:
    """Every entry of one run's directory ``root`` (absolute when built from the config).

    Build it once: ``RunPaths.from_config(cfg)`` in a training process, ``RunPaths(Path(arg))``
    where a directory comes from outside the config (a CLI argument, the supervisor channel's
    report of the run's directory)."""

    root: Path

    def __post_init__(self) -> None:
        # A str given by a caller would make every ``root / name`` a TypeError far away.
        if not isinstance(self.root, Path):
            object.__setattr__(self, "root", Path(self.root))

    # ----- building it

    @classmethod
    def from_config(cls, cfg: Any) -> RunPaths:
        """The run's directory of a ``ResilienceConfig`` (``cfg.checkpoint.dir``, made absolute
        when the config was validated)."""
        return cls.from_checkpoint_config(cfg.checkpoint)

    @classmethod
    def from_checkpoint_config(cls, ckpt_cfg: Any) -> RunPaths:
        """The run's directory of a ``CheckpointConfig`` (its ``dir``): what a
        ``CheckpointManager`` built from that section alone is given."""
        return cls(Path(ckpt_cfg.dir))

    @classmethod
    def of(cls, where: RunPaths | str | os.PathLike[str]) -> RunPaths:
        """``where`` as a ``RunPaths``: only for the few public functions documented to take
        a directory path (kept for their users); everything inside the package passes one."""
        return where if isinstance(where, RunPaths) else cls(Path(where))

    def __str__(self) -> str:
        # Log lines and messages show the directory itself. No ``__fspath__``: a function
        # that still joins a name onto the directory must fail, not spell the name again.
        return str(self.root)

    # ----- checkpoints

    @staticmethod
    def step_name(step: int, attempt: int = 0) -> str:
        """``step_000000010`` for the first attempt at a step, ``step_000000010.1`` for the
        next (a save never writes into an existing directory)."""
        return f"step_{step:09d}" + (f".{attempt}" if attempt else "")

    @staticmethod
    def parse_step_name(name: str) -> tuple[int, int] | None:
        """(step, attempt) for a step directory's name, else None."""
        m = _STEP_RE.match(name)
        return (int(m.group(1)), int(m.group(2) or 0)) if m else None

    def step_dir(self, step: int, attempt: int = 0) -> Path:
        """The directory of one save of ``step``."""
        return self.root / self.step_name(step, attempt)

    @staticmethod
    def trash_name(step_dir_name: str, token: str) -> str:
        """What a step directory is renamed to before it is deleted: atomic, and no longer a
        step name, so a crash mid-delete never leaves anything that looks like a checkpoint."""
        return f".trash-{step_dir_name}-{token}"

    @staticmethod
    def is_step_trash(name: str) -> bool:
        """Whether ``name`` is a step directory renamed for deletion (``trash_name``)."""
        return name.startswith(".trash-step_")

    @staticmethod
    def damaged_name(step_dir_name: str, why: str, n: int = 0) -> str:
        """What a checkpoint that resume found damaged is renamed to (kept for inspection,
        never a step name again); ``n`` tells apart the same step damaged twice."""
        return f".damaged-{step_dir_name}-{why}" + (f".{n}" if n else "")

    @staticmethod
    def parse_damaged_name(name: str) -> str | None:
        """The step directory's name a set-aside checkpoint had (``damaged_name`` read back),
        else None."""
        m = _DAMAGED_RE.match(name)
        return m.group(1) if m else None

    def set_aside(self) -> list[Path]:
        """Every checkpoint set aside as damaged (``damaged_name``) that is still here."""
        return sorted(p for p in self.root.glob(".damaged-step_*")
                      if self.parse_damaged_name(p.name) is not None)

    # ----- the run's own files

    @property
    def run_file(self) -> Path:
        """``run.json``: the run id across requeues, and the lineage."""
        return self.root / "run.json"

    @property
    def lease(self) -> Path:
        """``.lease``: one live run per directory."""
        return self.root / ".lease"

    def lease_probe(self, host: str, pid: int) -> Path:
        """The file whose mtime gives the filesystem's clock to the lease (NFS: the server's)."""
        return self.root / f".lease.probe.{host}.{pid}"

    def lease_aside(self, token: str) -> Path:
        """Where a contender moves a stale lease to before it takes the directory over."""
        return self.root / f".lease.stale.{token}"

    @property
    def ledger(self) -> Path:
        """``ledger.jsonl``: one line per event of every attempt."""
        return self.root / "ledger.jsonl"

    @property
    def pinned(self) -> Path:
        """``pinned.json``: checkpoints retention keeps whatever ``keep_last`` says."""
        return self.root / "pinned.json"

    @property
    def restarts(self) -> Path:
        """``.kempner_restarts.json``: the requeue decisions (the no-progress guard)."""
        return self.root / ".kempner_restarts.json"

    @property
    def bad_nodes(self) -> Path:
        """``bad-nodes.json``: nodes kept out of this run's relaunches and requeues."""
        return self.root / "bad-nodes.json"

    @property
    def bad_nodes_lock(self) -> Path:
        """``.bad-nodes.lock``: the lock the writers of ``bad_nodes`` take."""
        return self.root / ".bad-nodes.lock"

    # ----- markers and scratch

    def forced_marker(self, token: str) -> Path:
        """``.forced-exit.<token>``: a rank's forced exit announced for this attempt
        (``token``), outliving the process group's store."""
        return self.root / f".forced-exit.{token}"

    def forced_markers(self) -> list[Path]:
        """Every forced-exit marker present, of any attempt."""
        return sorted(self.root.glob(".forced-exit.*"))

    def probe(self, host: str, rank: int, pid: int) -> Path:
        """The file the start-up check writes and removes to learn the directory is writable."""
        return self.root / f".kempner_probe-{host}-{rank}-{pid}"

    # ----- the ranks' endings (no supervisor: rank 0 decides from them)

    def endings(self, token: str) -> Path:
        """``.endings.<token>/``: how each rank of attempt ``token`` ended
        (``supervise/endings.py``); a new name in every attempt, like ``forced_marker``."""
        return self.root / f".endings.{token}"

    def rank_ending(self, token: str, rank: int) -> Path:
        """``.endings.<token>/rank-<rank>.json``: one rank's ending in attempt ``token``."""
        return self.endings(token) / f"rank-{int(rank)}.json"

    def job_verdict(self, token: str) -> Path:
        """``.endings.<token>/job.json``: rank 0's decision from the endings, for the others."""
        return self.endings(token) / "job.json"

    def all_endings(self) -> list[Path]:
        """Every attempt's endings directory present."""
        return sorted(self.root.glob(".endings.*"))

    # ----- the rescue

    @property
    def rescue(self) -> Path:
        """``.rescue/``: the survivors' files of a rescue, one directory per attempt."""
        return self.root / ".rescue"

    def rescue_attempt(self, attempt: str) -> Path:
        """``.rescue/<attempt>/``: one attempt's claim, offered state and outcome."""
        return self.rescue / attempt
