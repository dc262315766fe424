"""Plain data (as YAML gives it) to the typed sections and back, with precise errors."""

from __future__ import annotations

import dataclasses
import difflib
import enum
import os
import typing
from typing import Any, Mapping

from kempner_resilience.config.errors import ConfigError

__all__ = ["build", "dump", "yaml_name"]


def yaml_name(f: dataclasses.Field) -> str:
    return f.metadata.get("yaml", f.name)


def _fields_by_yaml(cls: type) -> dict[str, dataclasses.Field]:
    return {yaml_name(f): f for f in dataclasses.fields(cls)}


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
        return build(tp, value, path)
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


def build(cls: type, data: Any, prefix: str) -> Any:
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
    # A section may complete partial data (SignalsConfig merges `actions` over the defaults).
    complete = getattr(cls, "complete_fields", None)
    if complete is not None:
        kwargs = complete(kwargs)
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise (e.prefixed(prefix) if prefix else e) from None


def dump(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {yaml_name(f): dump(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: dump(v) for k, v in obj.items()}
    if isinstance(obj, enum.Enum):
        return obj.value
    return obj
