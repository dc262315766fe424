"""Typed configuration: dataclass sections, YAML loading, dotted overrides, precise errors.

Every field carries a one-line ``help`` in its metadata. That text is the single source for
``configs/default.yaml``'s comments and ``docs/config.md``; tests keep all three in sync.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
import signal as _signal
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from kempner_resilience.startup import StartupError

__all__ = [
    "Action",
    "CheckpointConfig",
    "ConfigError",
    "ConfigFileNotFoundError",
    "RequeueConfig",
    "ResilienceConfig",
    "SignalsConfig",
    "WatchdogConfig",
    "load_config",
    "normalize_signal",
]

ENV_CONFIG = "KEMPNER_RESILIENCE_CONFIG"


class ConfigError(ValueError, StartupError):
    """A configuration problem. ``problems`` holds one ``(key_path, message)`` per mistake.

    Uncaught in a script, it ends the process with exit code 78 (CONFIG) and this message.
    """

    def __init__(self, problems: list[tuple[str, str]], source: str | None = None) -> None:
        self.problems = problems
        self.source = source
        head = f"invalid configuration in {source}" if source else "invalid configuration"
        lines = [f"{path}: {msg}" if path else msg for path, msg in problems]
        super().__init__(head + ":\n  " + "\n  ".join(lines))

    def prefixed(self, prefix: str) -> "ConfigError":
        return ConfigError(
            [(f"{prefix}.{p}" if p else prefix, m) for p, m in self.problems], self.source
        )


class ConfigFileNotFoundError(FileNotFoundError, StartupError):
    """The config file does not exist (exit code 78 when uncaught in a script)."""


class Action(str, enum.Enum):
    """What a shutdown signal asks for."""

    REQUEUE = "requeue"  # emergency checkpoint, then requeue the job (exit code REQUEUE)
    STOP = "stop"  # emergency checkpoint, then stop for good (130/143, or STOPPED)
    OFF = "off"  # not handled by us: the signal keeps whatever handler it had

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
    ddp_buckets: bool = field(default=True, metadata=_help(
        "save DDP's gradient bucket layout and restore it at resume, so a resumed run with 3+ "
        "ranks reduces gradients in the same order as an uninterrupted one (bitwise equal); "
        "false leaves DDP's reducer untouched"))

    def __post_init__(self) -> None:
        problems = _problems_nonneg(self, ["every_steps", "every_minutes", "keep_every",
                                           "save_margin_s"])
        if not isinstance(self.dir, (str, os.PathLike)) or not str(self.dir).strip():
            problems.append(("dir", f"{self.dir!r} is not a directory path; give a non-empty path"))
        if isinstance(self.keep_last, int) and self.keep_last < 1:
            problems.append(("keep_last", f"{self.keep_last!r} is not allowed; must be >= 1 "
                             "(the newest committed checkpoint is always kept)"))
        if isinstance(self.io_threads, int) and self.io_threads < 1:
            problems.append(("io_threads", f"{self.io_threads!r} is not allowed; must be >= 1"))
        if problems:
            raise ConfigError(problems)
        self.dir = str(self.dir)


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

    def __post_init__(self) -> None:
        problems = _problems_nonneg(self, ["max_restarts", "max_no_progress", "retries"])
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
        "hang budget while a checkpoint is saved or loaded, so slow saves are not hangs"))
    cleanup_timeout_s: float = field(default=10.0, metadata=_help(
        "default time limit of one cleanup callback at shutdown; > 0"))
    exit_timeout_s: float = field(default=15.0, metadata=_help(
        "after our shutdown finished, time left to the interpreter's own exit before it is "
        "forced (with the intended exit code); > 0"))

    def __post_init__(self) -> None:
        problems = _problems_nonneg(self, ["hang_timeout_s", "checkpoint_timeout_s"])
        for n in ("cleanup_timeout_s", "exit_timeout_s"):
            v = getattr(self, n)
            if isinstance(v, (int, float)) and v <= 0:
                problems.append((n, f"{v!r} is not allowed; must be > 0 seconds"))
        if problems:
            raise ConfigError(problems)


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

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None, source: str | None = None
                  ) -> "ResilienceConfig":
        """Build from plain data (as YAML gives it); raises one ``ConfigError`` for all mistakes."""
        try:
            return _build(cls, {} if data is None else data, "")
        except ConfigError as e:
            raise ConfigError(e.problems, source) from None

    def to_dict(self) -> dict[str, Any]:
        """Plain data with YAML key names, the inverse of ``from_dict``."""
        return _dump(self)


# ---------------------------------------------------------------- generic (de)serialization

def _yaml_name(f: dataclasses.Field) -> str:
    return f.metadata.get("yaml", f.name)


def _fields_by_yaml(cls: type) -> dict[str, dataclasses.Field]:
    return {_yaml_name(f): f for f in dataclasses.fields(cls)}


def _type_name(tp: Any) -> str:
    if tp is bool:
        return "true or false"
    if tp is int:
        return "an integer"
    if tp is float:
        return "a number"
    if tp is str:
        return "a string"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(m.value for m in tp)
    return getattr(tp, "__name__", str(tp))


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError([(path, f"{value!r} is not a mapping; write `key: value` lines")])
        _, vt = typing.get_args(tp)
        problems, out = [], {}
        for k, v in value.items():
            try:
                out[str(k)] = _coerce(vt, v, f"{path}.{k}")
            except ConfigError as e:
                problems += e.problems
        if problems:
            raise ConfigError(problems)
        return out
    bad = ConfigError([(path, f"{value!r} has the wrong type; expected {_type_name(tp)}")])
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value):
            raise bad
        return int(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad
        return float(value)
    if tp is str:
        if not isinstance(value, (str, os.PathLike)):
            raise bad
        return str(value)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, bool):  # YAML 1.1 reads a bare `off` as False, `on` as True
            value = "on" if value else "off"
        try:
            return tp(str(value).lower())
        except ValueError:
            raise bad from None
    return value


def _build(cls: type, data: Any, prefix: str) -> Any:
    where = prefix or "top level"
    if not isinstance(data, Mapping):
        raise ConfigError([(prefix, f"{where} must be a mapping of keys, got {data!r}")])
    fields = _fields_by_yaml(cls)
    hints = typing.get_type_hints(cls)
    problems: list[tuple[str, str]] = []
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        f = fields.get(str(key))
        if f is None:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'? " if close else ""
            problems.append((path, f"unknown key; {hint}allowed keys in {where}: "
                             + ", ".join(fields)))
            continue
        try:
            kwargs[f.name] = _coerce(hints[f.name], value, path)
        except ConfigError as e:
            problems += e.problems
    if problems:
        raise ConfigError(problems)
    if cls is SignalsConfig and "actions" in kwargs:
        # A partial `actions` mapping must not silently unhandle SIGTERM & co.
        kwargs["actions"] = {**_default_actions(), **{normalize_or_keep(k): v
                                                      for k, v in kwargs["actions"].items()}}
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise (e.prefixed(prefix) if prefix else e) from None


def normalize_or_keep(name: str) -> str:
    try:
        return normalize_signal(name)
    except ValueError:
        return name


def _dump(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {_yaml_name(f): _dump(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: _dump(v) for k, v in obj.items()}
    if isinstance(obj, enum.Enum):
        return obj.value
    return obj


# ---------------------------------------------------------------- loading

def _apply_override(data: dict[str, Any], text: str) -> None:
    if "=" not in text:
        raise ConfigError([(text, "override must look like section.key=value, "
                            "e.g. signals.grace_s=90")])
    dotted, raw = text.split("=", 1)
    parts = [p.strip() for p in dotted.strip().split(".")]
    if not all(parts):
        raise ConfigError([(dotted, "empty key in override; write section.key=value")])
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError([(dotted, f"value {raw!r} is not valid YAML: {e}")]) from None
    node = data
    for p in parts[:-1]:
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigError([(dotted, f"'{p}' is not a section; cannot set a key inside it")])
        node = nxt
    node[parts[-1]] = value


def load_config(path: str | os.PathLike[str] | Mapping[str, Any] | None = None,
                overrides: Iterable[str] = ()) -> ResilienceConfig:
    """Read a YAML config (defaults for anything missing) and apply ``key.path=value`` overrides.

    ``path`` may also be a mapping with the YAML file's structure (``{"checkpoint": {...}}``).
    ``path=None`` uses ``$KEMPNER_RESILIENCE_CONFIG`` when set, else the built-in defaults
    (identical to ``configs/default.yaml``). Raises ``ConfigError`` naming every bad key path,
    the bad value and what is allowed; ``ConfigFileNotFoundError`` (a ``FileNotFoundError``)
    when the file does not exist. Both are ``StartupError``: a script that does not catch them
    exits with 78 (CONFIG) and the message, without a traceback.
    """
    if isinstance(overrides, str):
        overrides = [overrides]
    if path is None and os.environ.get(ENV_CONFIG):
        path = os.environ[ENV_CONFIG]
    data: dict[str, Any] = {}
    source = None
    if isinstance(path, Mapping):
        import copy

        data = copy.deepcopy(dict(path))
    elif path is not None:
        p = Path(path)
        source = str(p)
        if not p.is_file():
            raise ConfigFileNotFoundError(f"config file not found: {p} (pass an existing YAML "
                                          "file, or no path for the built-in defaults)")
        try:
            loaded = yaml.safe_load(p.read_text())
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            problem = getattr(e, "problem", None) or str(e)
            raise ConfigError([("", f"not valid YAML{where}: {problem}; fix the file's syntax "
                                "(indentation, `key: value`, quotes)")], source) from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError([("", f"the file must hold a mapping of sections (checkpoint:, "
                                f"signals:, ...), not {type(loaded).__name__}")], source)
        data = loaded
    for text in overrides:
        try:
            _apply_override(data, text)
        except ConfigError as e:
            raise ConfigError(e.problems, source or "overrides") from None
    return ResilienceConfig.from_dict(data, source)


# ---------------------------------------------------------------- documentation from metadata

def _yaml_scalar(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml_scalar(v)}" for k, v in value.items()) + "}"
    text = yaml.safe_dump(_dump(value), default_flow_style=True).strip()
    return text[:-4].strip() if text.endswith("...") else text


def render_default_yaml() -> str:
    """``configs/default.yaml``: every key with its default and a one-line comment."""
    lines = ["# kempner_resilience configuration: every key, its default and what it does.",
             "# Load with kempner_resilience.load_config(path, overrides=['section.key=value']).",
             "# docs/config.md has the same reference; both are generated from config.py.", ""]
    root = ResilienceConfig()
    for sec in dataclasses.fields(root):
        lines.append(f"{_yaml_name(sec)}:  # {sec.metadata['help']}")
        obj = getattr(root, sec.name)
        for f in dataclasses.fields(obj):
            value = _yaml_scalar(getattr(obj, f.name))
            lines.append(f"  {_yaml_name(f)}: {value}  # {f.metadata['help']}")
        lines.append("")
    return "\n".join(lines)


def render_reference_markdown() -> str:
    """The body of ``docs/config.md``'s reference table."""
    out = ["| key | default | meaning |", "| --- | --- | --- |"]
    root = ResilienceConfig()
    for sec in dataclasses.fields(root):
        obj = getattr(root, sec.name)
        for f in dataclasses.fields(obj):
            value = _yaml_scalar(getattr(obj, f.name)).replace("|", "\\|")
            out.append(f"| `{_yaml_name(sec)}.{_yaml_name(f)}` | `{value}` | "
                       f"{f.metadata['help'].replace('|', chr(92) + '|')} |")
    return "\n".join(out)
