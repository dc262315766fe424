"""Plain data (as YAML gives it) to the typed sections and back, with precise errors."""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import math
import os
import typing
from typing import Any, Mapping

from kempner_resilience.config.bounds import Range
from kempner_resilience.config.errors import ConfigError, shown

__all__ = ["build", "check_fields", "dump", "yaml_name"]


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


def _number(tp: Any, value: Any, path: str, bounds: Range | None) -> int | float:
    """``value`` as ``tp`` (int or float) within ``bounds``: finite, and an int is a whole number
    (a count of 2.5 threads is a mistake, not something to round)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError([(path, f"{shown(value)} has the wrong type; expected {_type_name(tp)}"
                            + (f" {bounds.text()}" if bounds else ""))])
    problem = bounds.problem(value) if bounds else None
    if problem is None and isinstance(value, float) and not math.isfinite(value):
        problem = f"{shown(value)} is not a finite number"
    if problem is None and tp is int and isinstance(value, float) and not value.is_integer():
        problem = f"{shown(value)} is not a whole number; must be an integer" + \
            (f" {bounds.text()}" if bounds else "")
    if problem is not None:
        raise ConfigError([(path, problem)])
    if tp is int:
        return int(value)
    try:
        return float(value)
    except OverflowError:  # an int too large for a float, in a field without bounds
        raise ConfigError([(path, f"{shown(value)} is too large")]) from None


def _coerce(tp: Any, value: Any, path: str, bounds: Range | None = None) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):  # built in Python, perhaps changed since: check it again
            try:
                value.validate()
            except ConfigError as e:
                raise e.prefixed(path) from None
            return value
        return build(tp, value, path)
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError([(path, f"{shown(value)} is not a mapping; write `key: value` "
                                "lines")])
        _, vt = typing.get_args(tp)
        problems, out = [], {}
        for k, v in value.items():
            try:
                out[str(k)] = _coerce(vt, v, f"{path}.{k}", bounds)
            except ConfigError as e:
                problems += e.problems
        if problems:
            raise ConfigError(problems)
        return out
    if tp is int or tp is float:
        return _number(tp, value, path, bounds)
    bad = ConfigError([(path, f"{shown(value)} has the wrong type; expected {_type_name(tp)}")])
    if tp is bool:
        if not isinstance(value, bool):
            raise bad
        return value
    if tp is str:
        if not isinstance(value, (str, os.PathLike)):
            raise bad
        return str(value)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        if isinstance(value, bool):  # YAML 1.1 reads a bare `off` as False, `on` as True
            value = "on" if value else "off"
        try:
            return tp(str(value).lower())
        except ValueError:
            raise bad from None
    return value


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def check_fields(obj: Any) -> list[tuple[str, str]]:
    """Check and normalise every field of the dataclass ``obj`` in place (type, finite, within
    its declared ``bounds``); returns one ``(yaml key, message)`` per bad field, all of them.

    Each section's ``__post_init__`` calls it, so a config built in Python is held to the same
    rules as one read from YAML, and one mistake never hides another."""
    hints = _hints(type(obj))
    problems: list[tuple[str, str]] = []
    for f in dataclasses.fields(obj):
        try:
            setattr(obj, f.name, _coerce(hints[f.name], getattr(obj, f.name), yaml_name(f),
                                         f.metadata.get("bounds")))
        except ConfigError as e:
            problems += e.problems
    return problems


def build(cls: type, data: Any, prefix: str) -> Any:
    """``cls`` from plain data: unknown keys and every field's problems in one ``ConfigError``
    (paths prefixed with ``prefix``)."""
    where = prefix or "top level"
    if not isinstance(data, Mapping):
        raise ConfigError([(prefix, f"{where} must be a mapping of keys, got {shown(data)}")])
    fields = _fields_by_yaml(cls)
    problems: list[tuple[str, str]] = []
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        f = fields.get(str(key))
        if f is None:
            close = difflib.get_close_matches(str(key), list(fields), n=1, cutoff=0.6)
            hint = f"did you mean '{close[0]}'? " if close else ""
            problems.append((str(key), f"unknown key; {hint}allowed keys in {where}: "
                             + ", ".join(fields)))
            continue
        kwargs[f.name] = value
    # A section may complete partial data (SignalsConfig merges `actions` over the defaults).
    complete = getattr(cls, "complete_fields", None)
    if complete is not None:
        kwargs = complete(kwargs)
    # Built even after an unknown key, so that its type and range mistakes are reported too.
    try:
        obj = cls(**kwargs)
    except ConfigError as e:
        problems += e.problems
    if problems:
        err = ConfigError(problems)
        raise (err.prefixed(prefix) if prefix else err)
    return obj


def dump(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        return {yaml_name(f): dump(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {k: dump(v) for k, v in obj.items()}
    if isinstance(obj, enum.Enum):
        return obj.value
    return obj
