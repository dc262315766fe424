"""The configuration's schema: dataclass sections, their defaults, help texts and validation.

Every field carries a one-line ``help`` in its metadata. That text is the single source for
``configs/default.yaml``'s comments and ``docs/config.md`` (see ``render``); tests keep all
three in sync. ``__post_init__`` validates each section and names every mistake at once.
"""

from __future__ import annotations

import enum
import os
import signal as _signal
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from kempner_resilience.config.errors import ConfigError, ConfigFileNotFoundError
from kempner_resilience.config.serial import build, dump

__all__ = ["Action", "CheckpointConfig", "ConfigError", "ConfigFileNotFoundError", "ExitMode",
           "IntegrationsConfig", "RequeueConfig", "RescueConfig", "ResilienceConfig",
           "SignalsConfig", "StagingMode", "WatchdogConfig", "normalize_signal", "ENV_CONFIG"]

ENV_CONFIG = "KEMPNER_RESILIENCE_CONFIG"


class Action(str, enum.Enum):
    """What a shutdown signal asks for."""

    REQUEUE = "requeue"  # emergency checkpoint, then requeue the job (exit code REQUEUE)
    STOP = "stop"  # emergency checkpoint, then stop for good (130/143, or STOPPED)
    OFF = "off"  # not handled by us: the signal keeps whatever handler it had

    def __str__(self) -> str:
        return self.value


class ExitMode(str, enum.Enum):
    """How a run that ended leaves (see ``kempner_resilience.shutdown.exit``)."""

    AUTO = "auto"    # raise in IPython/interactive sessions, exit in SLURM/launched ranks
    EXIT = "exit"    # the process ends with the run: exit bounded, slow finalisation skipped
    RAISE = "raise"  # the caller lives on after SystemExit: nothing stays armed

    def __str__(self) -> str:
        return self.value


class StagingMode(str, enum.Enum):
    """Host buffers that device (CUDA) state is copied through on its way to and from disk."""

    PINNED = "pinned"      # page-locked: fast, asynchronous copies (~1 s per GiB to allocate)
    PAGEABLE = "pageable"  # ordinary memory, allocated and touched once, reused
    OFF = "off"            # no staging: a fresh .cpu() copy per tensor at every save

    def __str__(self) -> str:
        return self.value


def normalize_signal(name: str | int) -> str:
    """``"usr1"``, ``"SIGUSR1"``, ``10`` -> ``"SIGUSR1"``; raises ValueError for unknown names."""
    if isinstance(name, bool):
        raise ValueError(f"{name!r} is not a signal")
    if isinstance(name, int):
        try:
            return _signal.Signals(name).name
        except ValueError:
            raise ValueError(f"{name} is not a signal number") from None
    text = str(name).strip().upper()
    if not text.startswith("SIG"):
        text = "SIG" + text
    if text not in _signal.Signals.__members__:
        raise ValueError(f"{name!r} is not a signal name")
    return text


# Signals a training job cannot meaningfully catch, or whose handling would break the process.
_UNCATCHABLE = {"SIGKILL", "SIGSTOP", "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGCHLD"}


def _help(text: str, yaml_key: str | None = None) -> dict[str, str]:
    meta = {"help": text}
    if yaml_key:
        meta["yaml"] = yaml_key
    return meta


def _problems_nonneg(obj: Any, names: Iterable[str]) -> list[tuple[str, str]]:
    out = []
    for n in names:
        v = getattr(obj, n)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v < 0:
            out.append((n, f"{v!r} is negative; must be >= 0 (0 turns it off)"))
    return out


@dataclass
class CheckpointConfig:
    """Where and how often checkpoints are written, kept and verified."""

    dir: str = field(default="checkpoints", metadata=_help(
        "directory holding one step_* directory per checkpoint (created if missing)"))
    every_steps: int = field(default=0, metadata=_help(
        "periodic save every N completed steps; 0 = off"))
    every_minutes: float = field(default=0.0, metadata=_help(
        "periodic save when this many minutes passed since the last one; 0 = off"))
    keep_last: int = field(default=3, metadata=_help(
        "committed checkpoints to keep (the newest is never deleted); >= 1"))
    keep_every: int = field(default=0, metadata=_help(
        "also keep forever every checkpoint whose step is a multiple of N; 0 = off"))
    async_: bool = field(default=False, metadata=_help(
        "write periodic saves in the background (emergency saves are always synchronous)",
        yaml_key="async"))
    verify: bool = field(default=True, metadata=_help(
        "verify per-file checksums before resuming from a checkpoint"))
    allow_foreign_owner: bool = field(default=False, metadata=_help(
        "allow loading checkpoint files owned by another user (they are unpickled: trust them)"))
    save_margin_s: float = field(default=5.0, metadata=_help(
        "seconds kept free before the deadline when deciding whether an emergency save fits"))
    io_threads: int = field(default=4, metadata=_help(
        "writer threads per rank for saves; >= 1"))
    resume: bool = field(default=True, metadata=_help(
        "resume from the newest committed checkpoint in dir at start"))
    max_failed_saves: int = field(default=3, metadata=_help(
        "periodic saves that may fail in a row (full disk, I/O error) while training goes on and "
        "retries at the next cadence; at this many the run stops with 80 CHECKPOINT_FAILED; >= 1"))
    ddp_buckets: bool = field(default=True, metadata=_help(
        "save DDP's gradient bucket layout and restore it at resume, so a resumed run with 3+ "
        "ranks reduces gradients in the same order as an uninterrupted one (bitwise equal); "
        "false leaves DDP's reducer untouched"))
    allow_other_run: bool = field(default=False, metadata=_help(
        "resume even when dir holds checkpoints of another run (a different run id in run.json "
        "or a step's manifest); off: such a resume is refused with exit 78 CONFIG"))
    ledger: bool = field(default=True, metadata=_help(
        "rank 0 appends one line per event (start, resume, saves, stop, exit) to "
        "dir/ledger.jsonl, read by `kempner-resilience report`"))
    staging: StagingMode = field(default=StagingMode.PINNED, metadata=_help(
        "host buffers GPU state is copied through when saved and loaded, allocated once at "
        "start and reused: pinned (pageable when CUDA is absent or pinning fails), pageable, or "
        "off (a fresh host copy per tensor at every save)"))
    staging_cap_gib: float = field(default=2.0, metadata=_help(
        "most host memory (GiB per rank) the staging buffers may take; the start-up log says "
        "how much they took; > 0"))

    def __post_init__(self) -> None:
        problems = _problems_nonneg(self, ["every_steps", "every_minutes", "keep_every",
                                           "save_margin_s"])
        try:
            self.staging = StagingMode(str(getattr(self.staging, "value", self.staging)).lower())
        except ValueError:
            problems.append(("staging", f"{self.staging!r} is not allowed; use one of "
                             + ", ".join(m.value for m in StagingMode)))
        if isinstance(self.staging_cap_gib, (int, float)) and not self.staging_cap_gib > 0:
            problems.append(("staging_cap_gib", f"{self.staging_cap_gib!r} is not allowed; must "
                             "be > 0 GiB (staging: off turns staging off)"))
        if not isinstance(self.dir, (str, os.PathLike)) or not str(self.dir).strip():
            problems.append(("dir", f"{self.dir!r} is not a directory path; give a non-empty path"))
        if isinstance(self.keep_last, int) and self.keep_last < 1:
            problems.append(("keep_last", f"{self.keep_last!r} is not allowed; must be >= 1 "
                             "(the newest committed checkpoint is always kept)"))
        if isinstance(self.io_threads, int) and self.io_threads < 1:
            problems.append(("io_threads", f"{self.io_threads!r} is not allowed; must be >= 1"))
        if isinstance(self.max_failed_saves, int) and self.max_failed_saves < 1:
            problems.append(("max_failed_saves", f"{self.max_failed_saves!r} is not allowed; must "
                             "be >= 1 (1 stops at the first failed periodic save)"))
        if problems:
            raise ConfigError(problems)
        self.dir = str(self.dir)


def _normalize_or_keep(name: str) -> str:
    try:
        return normalize_signal(name)
    except ValueError:
        return name


def _default_actions() -> dict[str, Action]:
    return {"SIGUSR1": Action.REQUEUE, "SIGUSR2": Action.REQUEUE,
            "SIGTERM": Action.STOP, "SIGINT": Action.STOP}


@dataclass
class SignalsConfig:
    """Which signals start a graceful shutdown, what each asks for, and how long it may take."""

    actions: dict[str, Action] = field(default_factory=_default_actions, metadata=_help(
        "signal -> requeue | stop | off; merged over the defaults (SIGUSR1/SIGUSR2 requeue, "
        "SIGTERM/SIGINT stop)"))
    grace_s: float = field(default=100.0, metadata=_help(
        "seconds from the first signal until the process is forced out (checkpoint, requeue and "
        "teardown must fit); > 0"))
    grace_per_signal_s: dict[str, float] = field(
        default_factory=lambda: {"SIGTERM": 25.0, "SIGINT": 30.0}, metadata=_help(
            "per-signal grace overriding grace_s (SIGTERM: SLURM sends SIGKILL KillWait later)"))

    @classmethod
    def complete_fields(cls, fields: dict[str, Any]) -> dict[str, Any]:
        """A partial ``actions`` mapping is merged over the defaults, so that listing one
        signal never silently unhandles SIGTERM & co."""
        if "actions" in fields:
            fields = {**fields, "actions": {**_default_actions(),
                                            **{_normalize_or_keep(k): v
                                               for k, v in fields["actions"].items()}}}
        return fields

    def __post_init__(self) -> None:
        problems: list[tuple[str, str]] = []
        actions: dict[str, Action] = {}
        for key, val in dict(self.actions).items():
            try:
                name = normalize_signal(key)
            except ValueError as e:
                problems.append((f"actions.{key}", f"{e}; use a name such as SIGUSR1, SIGUSR2, "
                                 "SIGTERM, SIGINT"))
                continue
            if name in _UNCATCHABLE:
                problems.append((f"actions.{key}", f"{name} cannot be used for a graceful "
                                 "shutdown; use SIGUSR1, SIGUSR2, SIGTERM, SIGINT or SIGHUP"))
                continue
            try:
                actions[name] = Action(val.value if isinstance(val, Action) else str(val).lower())
            except ValueError:
                problems.append((f"actions.{key}", f"{val!r} is not an action; allowed: "
                                 + ", ".join(a.value for a in Action)))
        graces: dict[str, float] = {}
        for key, val in dict(self.grace_per_signal_s).items():
            try:
                name = normalize_signal(key)
            except ValueError as e:
                problems.append((f"grace_per_signal_s.{key}", str(e)))
                continue
            if isinstance(val, bool) or not isinstance(val, (int, float)) or val <= 0:
                problems.append((f"grace_per_signal_s.{key}", f"{val!r} is not allowed; must "
                                 "be a number of seconds > 0"))
                continue
            graces[name] = float(val)
        if isinstance(self.grace_s, (int, float)) and self.grace_s <= 0:
            problems.append(("grace_s", f"{self.grace_s!r} is not allowed; must be > 0 seconds"))
        if problems:
            raise ConfigError(problems)
        self.actions = actions
        self.grace_per_signal_s = graces

    def handled(self) -> dict[str, Action]:
        """The signals we install handlers for (action is not ``off``)."""
        return {k: v for k, v in self.actions.items() if v is not Action.OFF}

    def grace_for(self, name: str) -> float:
        return self.grace_per_signal_s.get(normalize_signal(name), float(self.grace_s))


@dataclass
class RequeueConfig:
    """When and how the job is put back in the queue after an emergency checkpoint."""

    enabled: bool = field(default=True, metadata=_help(
        "requeue after a committed emergency checkpoint when the signal's action is requeue"))
    max_restarts: int = field(default=20, metadata=_help(
        "restart budget: stop with NO_REQUEUE once the job has been restarted this often; "
        "0 = unlimited"))
    max_no_progress: int = field(default=2, metadata=_help(
        "stop with NO_REQUEUE after this many restarts in a row without a newer committed "
        "checkpoint; 0 = off"))
    scontrol_timeout_s: float = field(default=15.0, metadata=_help(
        "seconds to wait for `scontrol requeue` before treating it as failed; > 0"))
    retries: int = field(default=1, metadata=_help(
        "extra attempts when `scontrol requeue` fails"))
    time_limit_stop: bool = field(default=True, metadata=_help(
        "when the job's end time is known (SLURM_JOB_END_TIME, squeue) and no signal came, stop "
        "and save on its own once the time left falls below the estimated emergency save + one "
        "step + time_limit_margin_s, as if the first requeue signal had come"))
    time_limit_margin_s: float = field(default=30.0, metadata=_help(
        "seconds kept free before the allocation's end by the time-limit stop (the save "
        "estimate and one step come on top)"))

    def __post_init__(self) -> None:
        problems = _problems_nonneg(self, ["max_restarts", "max_no_progress", "retries",
                                           "time_limit_margin_s"])
        if isinstance(self.scontrol_timeout_s, (int, float)) and self.scontrol_timeout_s <= 0:
            problems.append(("scontrol_timeout_s", f"{self.scontrol_timeout_s!r} is not allowed; "
                             "must be > 0 seconds"))
        if problems:
            raise ConfigError(problems)


@dataclass
class WatchdogConfig:
    """Hang detection and the time limits of the shutdown path."""

    hang_timeout_s: float = field(default=1800.0, metadata=_help(
        "exit with HANG when no step finishes for this long (stuck NCCL, dead peer); 0 = off"))
    checkpoint_timeout_s: float = field(default=3600.0, metadata=_help(
        "hang budget while a checkpoint is saved or loaded, so slow saves are not hangs; a "
        "save's wait for the other ranks stays within hang_timeout_s + the save's estimate"))
    cleanup_timeout_s: float = field(default=10.0, metadata=_help(
        "default time limit of one cleanup callback at shutdown; > 0"))
    exit_timeout_s: float = field(default=15.0, metadata=_help(
        "after our shutdown finished, time left to the interpreter's own exit before it is "
        "forced (with the intended exit code); > 0"))
    exit_mode: ExitMode = field(default=ExitMode.AUTO, metadata=_help(
        "after the run ends: exit (the process ends with it: exit bounded, slow finalisation "
        "skipped), raise (the caller lives on after SystemExit: notebooks, test runners), auto "
        "(raise in IPython/interactive sessions, exit when SLURM_JOB_ID or RANK is set)"))

    def __post_init__(self) -> None:
        problems = _problems_nonneg(self, ["hang_timeout_s", "checkpoint_timeout_s"])
        try:
            self.exit_mode = ExitMode(str(getattr(self.exit_mode, "value", self.exit_mode))
                                      .lower())
        except ValueError:
            problems.append(("exit_mode", f"{self.exit_mode!r} is not allowed; use one of "
                             + ", ".join(m.value for m in ExitMode)))
        for n in ("cleanup_timeout_s", "exit_timeout_s"):
            v = getattr(self, n)
            if isinstance(v, (int, float)) and v <= 0:
                problems.append((n, f"{v!r} is not allowed; must be > 0 seconds"))
        if problems:
            raise ConfigError(problems)


@dataclass
class IntegrationsConfig:
    """Experiment trackers told how each attempt of the run ends (optional extras)."""

    wandb: bool = field(default=False, metadata=_help(
        "tell the active W&B run (wandb.run) how each attempt ends: mark_preempting() before a "
        "requeue, finish(exit_code=...) at its end, so a run initialised with "
        "wandb.init(id=run.run_id, resume=\"allow\") stays one W&B run across requeues, never "
        "\"crashed\"; needs pip install 'kempner_resilience[wandb]'"))


@dataclass
class RescueConfig:
    """Just-in-time rescue: after a peer is lost or hangs, the survivors write the last step."""

    enabled: bool = field(default=True, metadata=_help(
        "when a peer dies or hangs, the surviving ranks write the state at the last step "
        "boundary as a committed checkpoint (one step lost instead of a checkpoint interval); "
        "active only when every rank holds the full state (DDP or replicated modules, 2+ "
        "ranks), see docs/design.md"))
    budget_s: float = field(default=120.0, metadata=_help(
        "seconds from the failure until the rescue checkpoint must be committed (waiting for "
        "the survivors' per-rank state included); past it the process exits with its failure "
        "code and the newest checkpoint stays the resume point; > 0"))

    def __post_init__(self) -> None:
        if isinstance(self.budget_s, (int, float)) and not isinstance(self.budget_s, bool) \
                and self.budget_s <= 0:
            raise ConfigError([("budget_s", f"{self.budget_s!r} is not allowed; must be > 0 "
                                "seconds")])


@dataclass
class ResilienceConfig:
    """The whole configuration; every section has defaults, so ``ResilienceConfig()`` is valid."""

    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig, metadata=_help(
        "checkpoint location, cadence, retention and verification"))
    signals: SignalsConfig = field(default_factory=SignalsConfig, metadata=_help(
        "shutdown signals, their actions and grace periods"))
    requeue: RequeueConfig = field(default_factory=RequeueConfig, metadata=_help(
        "requeue after an emergency checkpoint, restart budget"))
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig, metadata=_help(
        "hang detection and shutdown time limits"))
    integrations: IntegrationsConfig = field(default_factory=IntegrationsConfig, metadata=_help(
        "experiment trackers told how each attempt ends (W&B)"))
    rescue: RescueConfig = field(default_factory=RescueConfig, metadata=_help(
        "just-in-time rescue checkpoint from the surviving replicas after a peer is lost"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, source: str | None = None
                  ) -> "ResilienceConfig":
        """Build from plain data (as YAML gives it); raises one ``ConfigError`` for all mistakes."""
        try:
            return build(cls, {} if data is None else data, "")
        except ConfigError as e:
            raise ConfigError(e.problems, source) from None

    def to_dict(self) -> dict[str, Any]:
        """Plain data with YAML key names, the inverse of ``from_dict``."""
        return dump(self)
