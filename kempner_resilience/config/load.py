"""``load_config``: a YAML file (or a mapping, or the defaults) plus dotted overrides."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Mapping

import yaml

from kempner_resilience.config.errors import shown
from kempner_resilience.config.schema import (ENV_CONFIG, ConfigError, ConfigFileNotFoundError,
                                              ResilienceConfig, signal_or_key)
from kempner_resilience.config.yamlread import (LIMITS, SIGNAL_TABLES, check_plain_size,
                                                parse_yaml)

__all__ = ["load_config", "SHIPPED_DEFAULTS", "shipped_path"]

# configs/default.yaml ships inside the package (scripts/regen_docs.py writes both copies from the
# schema, a test keeps them identical), so the documented ``load_config("configs/default.yaml")``
# works from any directory, not only from a checkout's root.
SHIPPED_DEFAULTS = Path(__file__).resolve().parent / "default.yaml"
_SHIPPED_DIRS = {"", ".", "configs"}


def shipped_path(path: Path) -> Path | None:
    """The shipped copy of ``path`` when ``path`` names a config shipped with the package
    (``configs/default.yaml`` or ``default.yaml``, relative), else None."""
    if path.is_absolute() or path.parent.as_posix() not in _SHIPPED_DIRS:
        return None
    candidate = SHIPPED_DEFAULTS.parent / path.name
    return candidate if path.name == SHIPPED_DEFAULTS.name and candidate.is_file() else None


def _apply_override(data: dict[str, Any], text: str) -> None:
    if "=" not in text:
        raise ConfigError([(text, "override must look like section.key=value, "
                            "e.g. signals.grace_s=90")])
    dotted, raw = text.split("=", 1)
    parts = [p.strip() for p in dotted.strip().split(".")]
    if not all(parts):
        raise ConfigError([(dotted, "empty key in override; write section.key=value")])
    try:
        value = parse_yaml(raw, signal_or_key) if raw.strip() else ""
    except ConfigError as e:
        raise ConfigError([(dotted, f"value: {m}") for _, m in e.problems]) from None
    except yaml.YAMLError as e:
        raise ConfigError([(dotted, f"value {shown(raw)} is not valid YAML: {e}")]) from None
    node = data
    for p in parts[:-1]:
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise ConfigError([(dotted, f"'{p}' is not a section; cannot set a key inside it")])
        node = nxt
    if tuple(parts[:-1]) in SIGNAL_TABLES:
        # `--set signals.actions.USR1=stop` replaces the file's `SIGUSR1:` entry: an override
        # overrides, whichever spelling each side used.
        for other in [k for k in node if signal_or_key(str(k)) == signal_or_key(parts[-1])]:
            del node[other]
    node[parts[-1]] = value


def _read_yaml(p: Path, source: str) -> Any:
    """The file's data: read at most ``LIMITS.max_bytes`` (+1, to know it is longer), parsed by
    ``yamlread`` (sizes bounded, duplicate keys and signal spellings refused, YAML 1.2 floats)."""
    try:
        with open(p, "rb") as f:
            raw = f.read(LIMITS.max_bytes + 1)
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError([("", f"not UTF-8 text ({e.reason} at byte {e.start}); is this the "
                            "right file?")], source) from None
    except OSError as e:
        raise ConfigError([("", f"cannot be read: {e.strerror or e}")], source) from None
    try:
        return parse_yaml(text, signal_or_key)
    except ConfigError as e:
        raise ConfigError(e.problems, source) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError([("", f"not valid YAML{where}: {problem}; fix the file's syntax "
                            "(indentation, `key: value`, quotes)")], source) from None


def load_config(path: str | os.PathLike[str] | Mapping[str, Any] | None = None,
                overrides: Iterable[str] = ()) -> ResilienceConfig:
    """Read a YAML config (defaults for anything missing) and apply ``key.path=value`` overrides.

    ``path`` may also be a mapping with the YAML file's structure (``{"checkpoint": {...}}``).
    ``path=None`` uses ``$KEMPNER_RESILIENCE_CONFIG`` when set, else the built-in defaults
    (identical to ``configs/default.yaml``). A relative ``configs/default.yaml`` (or
    ``default.yaml``) that does not exist from the current directory is the copy shipped in the
    package, so the documented call works from anywhere; an existing file always wins. Raises ``ConfigError`` naming every bad key path,
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

        check_plain_size(path)       # before the copy: a shared or cyclic structure stops here
        data = copy.deepcopy(dict(path))
    elif path is not None:
        p = Path(path)
        source = str(p)
        if not p.exists() and shipped_path(p) is not None:
            p = shipped_path(p)  # type: ignore[assignment]
            source = f"{source} (shipped with kempner_resilience: {p})"
        if not p.is_file():
            raise ConfigFileNotFoundError(f"config file not found: {p} (pass an existing YAML "
                                          "file, or no path for the built-in defaults)")
        loaded = _read_yaml(p, source)
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
