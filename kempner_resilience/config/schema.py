"""The configuration's schema: dataclass sections, their defaults, help texts and validation.

Every field carries a one-line ``help`` in its metadata. That text is the single source for
``configs/default.yaml``'s comments and ``docs/config.md`` (see ``render``); tests keep all
three in sync. Each numeric field declares its allowed range (``bounds=Range(...)``, see
``bounds``), also rendered into both. ``__post_init__`` checks every field generically (type,
finite, within its range; ``serial.check_fields``) plus each section's own rules, and names every
mistake at once; ``validate()`` checks a section again after it was changed in Python.
"""

from __future__ import annotations

import os
import signal as _signal
from dataclasses import dataclass, field
from typing import Any, Mapping

from kempner_resilience.config.bounds import Range
from kempner_resilience.config.errors import ConfigError, ConfigFileNotFoundError, shown
from kempner_resilience.config.modes import Action, DirectIOMode, ExitMode, StagingMode
from kempner_resilience.config.serial import build, check_fields, dump

__all__ = ["Action", "CheckpointConfig", "ConfigError", "ConfigFileNotFoundError", "DirectIOMode",
           "ExitMode", "IntegrationsConfig", "RequeueConfig", "RescueConfig", "ResilienceConfig",
           "SignalsConfig", "StagingMode", "WatchdogConfig", "normalize_signal", "signal_or_key",
           "ENV_CONFIG", "UNLIMITED"]

ENV_CONFIG = "KEMPNER_RESILIENCE_CONFIG"

#: ``requeue.max_restarts`` without a limit (Ray Train's ``max_failures=-1``); written
#: ``unlimited`` in a config. 0 means no restart, as torchrun's ``--max-restarts 0``.
UNLIMITED = -1
UNLIMITED_WORDS = ("unlimited", "inf", "infinite")
UNLIMITED_NOTE = "0 = never run again; -1 = unlimited"


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


def _help(text: str, yaml_key: str | None = None, bounds: Range | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"help": text}
    if yaml_key:
        meta["yaml"] = yaml_key
    if bounds is not None:
        meta["bounds"] = bounds
    return meta


# The ranges of the numeric keys. The upper ends are far beyond any sensible setting and well
# inside what timers, threads and memory can take: they catch a unit mistake (milliseconds for
# seconds) or a runaway number, never a real job's choice.
_DAY_S = 86400.0
_WEEK_S = 7 * _DAY_S
_OFF = "0 turns it off"


def _count(lo: int, hi: int, note: str = "") -> Range:
    return Range(lo, hi, note=note)


def _seconds(hi: float, *, zero: str | None = None) -> Range:
    """``> 0 and <= hi`` seconds, or ``>= 0`` when 0 means ``zero``."""
    return Range(0, hi, lo_open=zero is None, unit="seconds", note=zero or "")


class _Section:
    """What every section has: ``validate()`` checks it again (after a change in Python)."""

    def validate(self) -> None:
        """Raise ``ConfigError`` naming every bad key (type, NaN/inf, out of its range)."""
        self.__post_init__()  # type: ignore[attr-defined]

    def __post_init__(self) -> None:
        problems = check_fields(self)
        if problems:
            raise ConfigError(problems)


@dataclass
class CheckpointConfig(_Section):
    """Where and how often checkpoints are written, kept and verified."""

    dir: str = field(default="checkpoints", metadata=_help(
        "directory holding one step_* directory per checkpoint (created if missing); ~ is "
        "expanded and a relative path made absolute when the config is loaded"))
    every_steps: int = field(default=0, metadata=_help(
        "periodic save every N completed steps; 0 = off", bounds=_count(0, 10**9, _OFF)))
    every_minutes: float = field(default=0.0, metadata=_help(
        "periodic save when this many minutes passed since the last one; 0 = off",
        bounds=Range(0, 10080, unit="minutes", note=_OFF)))
    keep_last: int = field(default=3, metadata=_help(
        "committed checkpoints of this run's lineage to keep (the newest is never deleted; "
        "other lineages' checkpoints are never counted nor deleted)",
        bounds=_count(1, 10**6, "the newest committed checkpoint is always kept")))
    keep_every: int = field(default=0, metadata=_help(
        "also keep forever every checkpoint whose step is a multiple of N; 0 = off",
        bounds=_count(0, 10**9, _OFF)))
    async_: bool = field(default=False, metadata=_help(
        "write periodic saves in the background (emergency saves are always synchronous)",
        yaml_key="async"))
    verify: bool = field(default=True, metadata=_help(
        "verify per-file checksums before resuming from a checkpoint"))
    allow_foreign_owner: bool = field(default=False, metadata=_help(
        "allow loading checkpoint files owned by another user (they are unpickled: trust them)"))
    allow_partial_resume: bool = field(default=False, metadata=_help(
        "resume from a checkpoint whose entries differ from the live state (a layer or a "
        "`state` key removed or added since it was written): what both hold is loaded, the "
        "rest keeps its current values, and the checkpoint is pinned in dir/pinned.json so "
        "retention keeps it whole; off: such a resume is refused with exit 78 CONFIG naming "
        "the entries"))
    save_margin_s: float = field(default=5.0, metadata=_help(
        "seconds kept free before the deadline when deciding whether an emergency save fits",
        bounds=_seconds(3600, zero="no margin")))
    io_threads: int = field(default=4, metadata=_help(
        "writer threads per rank for saves", bounds=_count(1, 256)))
    resume: bool = field(default=True, metadata=_help(
        "resume from the newest committed checkpoint of the run run.json names (its lineage); "
        "false: start at step 0 as a new run (new run id), keeping the checkpoints in dir"))
    max_failed_saves: int = field(default=3, metadata=_help(
        "periodic saves that may fail in a row (full disk, I/O error) while training goes on and "
        "retries at the next cadence; at this many the run stops with 80 CHECKPOINT_FAILED",
        bounds=_count(1, 1000, "1 stops at the first failed periodic save")))
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
        "most host memory (GiB per rank) the staging buffers and the O_DIRECT write buffers "
        "(direct_io) may take together; the start-up log says how much each took (staging: "
        "off turns staging off)",
        bounds=Range(0, 1024, lo_open=True, unit="GiB")))
    direct_io: DirectIOMode = field(default=DirectIOMode.AUTO, metadata=_help(
        "write checkpoint files past the page cache (O_DIRECT) from buffers allocated at start "
        "(2 x 8 MiB per io_threads, within staging_cap_gib): auto (where checkpoint.dir's "
        "filesystem takes O_DIRECT, else through the page cache, said once at start), on "
        "(a filesystem that refuses it is a start-up error, exit 78 CONFIG) or off; the "
        "environment variable KEMPNER_RESILIENCE_DIRECT_IO (0/off, 1/on, auto) overrides it"))

    def __post_init__(self) -> None:
        problems = check_fields(self)
        if isinstance(self.dir, str) and not self.dir.strip():
            problems.append(("dir", f"{shown(self.dir)} is not a directory path; give a "
                             "non-empty path"))
        elif isinstance(self.dir, str):
            # Resolved here, once, for every user of the config: the checkpoints, run.json, the
            # ledger and the restart record all live under this one absolute path, whatever
            # the process's working directory later (and a pickled or dumped config says it).
            self.dir = os.path.abspath(os.path.expanduser(self.dir))
        if problems:
            raise ConfigError(problems)


def _normalize_or_keep(name: str | int) -> str | int:
    try:
        return normalize_signal(name)
    except ValueError:
        return name


def signal_or_key(name: str) -> str:
    """The signal ``name`` spells (``USR1`` -> ``SIGUSR1``), or ``name`` when it spells none:
    the key under which two spellings of one signal are one key (``10`` is SIGUSR1 too)."""
    return str(_normalize_or_keep(int(name) if name.strip().isdigit() else name))


def _spellings_conflict(table: Mapping[Any, Any]) -> bool:
    names = [_normalize_or_keep(k) for k in table]
    return len(set(names)) != len(names)


def _default_actions() -> dict[str, Action]:
    return {"SIGUSR1": Action.REQUEUE, "SIGUSR2": Action.REQUEUE,
            "SIGTERM": Action.STOP, "SIGINT": Action.STOP}


@dataclass
class SignalsConfig(_Section):
    """Which signals start a graceful shutdown, what each asks for, and how long it may take."""

    actions: dict[str, Action] = field(default_factory=_default_actions, metadata=_help(
        "signal -> requeue | stop | off; merged over the defaults (SIGUSR1/SIGUSR2 requeue, "
        "SIGTERM/SIGINT stop)"))
    grace_s: float = field(default=100.0, metadata=_help(
        "seconds from the first signal until the process is forced out (checkpoint, requeue and "
        "teardown must fit)", bounds=_seconds(_DAY_S)))
    grace_per_signal_s: dict[str, float] = field(
        default_factory=lambda: {"SIGTERM": 25.0, "SIGINT": 30.0}, metadata=_help(
            "per-signal grace overriding grace_s (SIGTERM: SLURM sends SIGKILL KillWait later)",
            bounds=_seconds(_DAY_S)))

    @classmethod
    def complete_fields(cls, fields: dict[str, Any]) -> dict[str, Any]:
        """A partial ``actions`` mapping is merged over the defaults, so that listing one
        signal never silently unhandles SIGTERM & co."""
        actions = fields.get("actions")
        if isinstance(actions, Mapping) and not _spellings_conflict(actions):
            # (two spellings of one signal are left as given: __post_init__ names both)
            fields = {**fields, "actions": {**_default_actions(),
                                            **{_normalize_or_keep(k): v
                                               for k, v in fields["actions"].items()}}}
        return fields

    def __post_init__(self) -> None:
        problems = check_fields(self)  # values: actions and graces (NaN, inf, range)
        actions: dict[str, Any] = {}
        graces: dict[str, Any] = {}
        for key_name, table, out in (("actions", self.actions, actions),
                                     ("grace_per_signal_s", self.grace_per_signal_s, graces)):
            if not isinstance(table, Mapping):
                continue  # reported by check_fields
            spelled: dict[str, str] = {}     # signal -> the key that named it first
            for key, val in table.items():
                try:
                    name = normalize_signal(key)
                except ValueError as e:
                    hint = "; use a name such as SIGUSR1, SIGUSR2, SIGTERM, SIGINT" \
                        if key_name == "actions" else ""
                    problems.append((f"{key_name}.{key}", f"{e}{hint}"))
                    continue
                if key_name == "actions" and name in _UNCATCHABLE:
                    problems.append((f"actions.{key}", f"{name} cannot be used for a graceful "
                                     "shutdown; use SIGUSR1, SIGUSR2, SIGTERM, SIGINT or SIGHUP"))
                    continue
                if name in spelled:
                    # Both would land on one signal and one value would silently win.
                    problems.append((key_name, f"{shown(spelled[name])} and {shown(key)} both "
                                     f"name {name}; keep one of them"))
                    continue
                spelled[name] = key
                out[name] = val
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
class RequeueConfig(_Section):
    """When and how the job is put back in the queue after an emergency checkpoint."""

    enabled: bool = field(default=True, metadata=_help(
        "requeue after a committed emergency checkpoint when the signal's action is requeue"))
    max_restarts: int = field(default=20, metadata=_help(
        "restart budget, as torchrun's --max-restarts and Ray Train's max_failures: the job is "
        "run again at most this often, then stops with NO_REQUEUE; 0 = never run again; "
        "unlimited (or -1) = no limit", bounds=_count(-1, 10**6, UNLIMITED_NOTE)))
    max_no_progress: int = field(default=2, metadata=_help(
        "stop with NO_REQUEUE after this many restarts in a row without a newer committed "
        "checkpoint; 0 = off", bounds=_count(0, 10**6, _OFF)))
    scontrol_timeout_s: float = field(default=15.0, metadata=_help(
        "seconds to wait for `scontrol requeue` before treating it as failed",
        bounds=_seconds(3600)))
    retries: int = field(default=1, metadata=_help(
        "extra attempts when `scontrol requeue` fails", bounds=_count(0, 100)))
    time_limit_stop: bool = field(default=True, metadata=_help(
        "when the job's end time is known (SLURM_JOB_END_TIME, squeue) and no signal came, stop "
        "and save on its own once the time left falls below the estimated emergency save + one "
        "step + time_limit_margin_s, as if the first requeue signal had come"))
    time_limit_margin_s: float = field(default=30.0, metadata=_help(
        "seconds kept free before the allocation's end by the time-limit stop (the save "
        "estimate and one step come on top)", bounds=_seconds(_DAY_S, zero="no margin")))

    def __post_init__(self) -> None:
        # The explicit spelling of "no limit": YAML and --set give the word, Python may too.
        if isinstance(self.max_restarts, str) and \
                self.max_restarts.strip().lower() in UNLIMITED_WORDS:
            self.max_restarts = UNLIMITED
        super().__post_init__()

    @property
    def restart_limit(self) -> int | None:
        """The restart budget as every decider reads it: None = no limit, 0 = never again."""
        return None if self.max_restarts == UNLIMITED else int(self.max_restarts)


@dataclass
class WatchdogConfig(_Section):
    """Hang detection and the time limits of the shutdown path."""

    hang_timeout_s: float = field(default=1800.0, metadata=_help(
        "exit with HANG when no step finishes for this long (stuck NCCL, dead peer); 0 = off",
        bounds=_seconds(_WEEK_S, zero=_OFF)))
    checkpoint_timeout_s: float = field(default=3600.0, metadata=_help(
        "hang budget while a checkpoint is saved or loaded, so slow saves are not hangs; a "
        "save's wait for the other ranks stays within hang_timeout_s + the save's estimate",
        bounds=_seconds(_WEEK_S, zero="no extra budget")))
    cleanup_timeout_s: float = field(default=10.0, metadata=_help(
        "default time limit of one cleanup callback at shutdown", bounds=_seconds(_DAY_S)))
    exit_timeout_s: float = field(default=15.0, metadata=_help(
        "after our shutdown finished, time left to the interpreter's own exit before it is "
        "forced (with the intended exit code)", bounds=_seconds(_DAY_S)))
    exit_mode: ExitMode = field(default=ExitMode.AUTO, metadata=_help(
        "after the run ends: exit (the process ends with it: exit bounded, slow finalisation "
        "skipped), raise (the caller lives on after SystemExit: notebooks, test runners), auto "
        "(raise in IPython/interactive sessions, exit when SLURM_JOB_ID or RANK is set)"))


@dataclass
class IntegrationsConfig(_Section):
    """Experiment trackers told how each attempt of the run ends (optional extras)."""

    wandb: bool = field(default=False, metadata=_help(
        "tell the active W&B run (wandb.run) how each attempt ends: mark_preempting() before a "
        "requeue, finish(exit_code=...) at its end, so a run initialised with "
        "wandb.init(id=run.run_id, resume=\"allow\") stays one W&B run across requeues, never "
        "\"crashed\"; needs pip install 'kempner_resilience[wandb]'"))


@dataclass
class RescueConfig(_Section):
    """Just-in-time rescue: after a peer is lost or hangs, the survivors write the last step."""

    enabled: bool = field(default=True, metadata=_help(
        "when a peer dies or hangs, the surviving ranks write the state at the last step "
        "boundary as a committed checkpoint (one step lost instead of a checkpoint interval); "
        "active only when the survivors hold the whole state: DDP or replicated modules, or "
        "HSDP (each shard on every replica group; not pure FSDP), 2+ ranks, see "
        "docs/design.md"))
    budget_s: float = field(default=120.0, metadata=_help(
        "seconds from the failure until the rescue checkpoint must be committed (waiting for "
        "the survivors' per-rank state included); past it the process exits with its failure "
        "code and the newest checkpoint stays the resume point", bounds=_seconds(_DAY_S)))


@dataclass
class ResilienceConfig(_Section):
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
