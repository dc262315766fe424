"""Reading a config's YAML so that no key is lost without a word and no document runs away.

PyYAML's ``safe_load`` keeps only the last of two equal keys (a ``checkpoint:`` section given
twice silently loses the first one's keys), reads ``1e-9`` as a string (YAML 1.1 wants a dot in
a float), and builds whatever an alias bomb expands to. Here, before anything is constructed:

* the document is composed into nodes (aliases stay shared: composing a "billion laughs" is
  cheap) and its size is counted with every alias counted at each use, so a bomb, a cycle, an
  oversized value or a too-deep nesting is refused in milliseconds (``Limits``);
* every mapping is checked for a key given twice, and the signal tables for two spellings of one
  signal (``SIGUSR1`` and ``USR1``), each named with both lines;
* floats resolve as YAML 1.2 does (``1e-9``, ``1E+3``, ``.5``).

All of it raises ``ConfigError`` (exit 78 when a script leaves it uncaught).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import yaml

from kempner_resilience.config.errors import ConfigError, shown

__all__ = ["Limits", "LIMITS", "parse_yaml", "check_plain_size", "SIGNAL_TABLES"]


@dataclass(frozen=True)
class Limits:
    """How large a config may be. Far beyond any real config (the shipped default is ~5 KiB,
    about 60 values), far below what takes noticeable time or memory to validate."""

    max_bytes: int = 1 << 20          # the file (or an override's value)
    max_nodes: int = 10_000           # values, counting every use of an alias
    max_depth: int = 32               # nested mappings/lists
    max_scalar: int = 4096            # characters of one value (PATH_MAX is 4096)


LIMITS = Limits()

# Tables keyed by signal: two spellings of one signal (SIGUSR1, USR1, usr1) are one key.
SIGNAL_TABLES = (("signals", "actions"), ("signals", "grace_per_signal_s"))

_FLOAT_TAG = "tag:yaml.org,2002:float"


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2's float syntax (``1e-9`` is a float, not a string)."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != _FLOAT_TAG]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()}
_Loader.add_implicit_resolver(_FLOAT_TAG, re.compile(r"""^(?:
     [-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X), list("-+0123456789."))


def _line(node: yaml.Node) -> int:
    return node.start_mark.line + 1


def _too_large(what: str, limit: int, unit: str) -> str:
    return f"{what}; a config holds at most {limit:,} {unit} (is this the right file?)"


def _count(node: yaml.Node, limits: Limits) -> None:
    """Refuse a document that expands past ``limits`` (an alias counted at each use), that
    nests too deep, refers to itself or holds an oversized value. Each node is sized once
    (memoised), so a bomb of shared aliases costs its number of distinct nodes."""
    sizes: dict[int, int] = {}
    open_: set[int] = set()

    def size(n: yaml.Node, depth: int) -> int:
        if id(n) in sizes:
            return sizes[id(n)]
        if depth > limits.max_depth:
            raise ConfigError([("", _too_large(f"line {_line(n)}: nested more than "
                                               f"{limits.max_depth} levels deep",
                                               limits.max_depth, "levels"))])
        if isinstance(n, yaml.ScalarNode):
            if len(n.value) > limits.max_scalar:
                raise ConfigError([("", _too_large(
                    f"line {_line(n)}: a value of {len(n.value):,} characters",
                    limits.max_scalar, "characters per value"))])
            total = 1
        else:
            if id(n) in open_:
                raise ConfigError([("", f"line {_line(n)}: an alias refers to the value that "
                                    "holds it (a cycle); write the value out")])
            open_.add(id(n))
            children = [c for pair in n.value for c in pair] \
                if isinstance(n, yaml.MappingNode) else list(n.value)
            total = 1
            for c in children:
                total += size(c, depth + 1)
                if total > limits.max_nodes:
                    break
            open_.discard(id(n))
        if total > limits.max_nodes:
            raise ConfigError([("", _too_large(
                f"line {_line(n)}: the document expands to more than {limits.max_nodes:,} "
                "values (aliases counted at each use)", limits.max_nodes, "values"))])
        sizes[id(n)] = total
        return total

    size(node, 0)


def _key_text(node: yaml.Node) -> str | None:
    return node.value if isinstance(node, yaml.ScalarNode) else None


def _duplicates(node: yaml.Node, path: tuple[str, ...], problems: list[tuple[str, str]],
                signal_key: Callable[[str], str]) -> None:
    """Every key given twice in one mapping, and two spellings of one signal in a signal table,
    each with both lines. Walks every use of an alias (bounded by ``_count`` before)."""
    if isinstance(node, yaml.SequenceNode):
        for i, child in enumerate(node.value):
            _duplicates(child, (*path, str(i)), problems, signal_key)
        return
    if not isinstance(node, yaml.MappingNode):
        return
    table = path in SIGNAL_TABLES
    seen: dict[str, tuple[str, yaml.Node]] = {}
    where = ".".join(path)
    for key_node, value_node in node.value:
        key = _key_text(key_node)
        if key is None:
            continue
        same = signal_key(key) if table else key
        if same in seen:
            first, first_node = seen[same]
            if first == key:
                what = "section" if not path else "key"
                problems.append((".".join((*path, key)), (
                    f"{what} given twice, at line {_line(first_node)} and line "
                    f"{_line(key_node)}; YAML would keep only the second and silently lose the "
                    f"first's {'keys' if what == 'section' else 'value'}: merge them into one")))
            else:
                problems.append((where, (
                    f"{shown(first)} (line {_line(first_node)}) and {shown(key)} (line "
                    f"{_line(key_node)}) both name {same}; keep one of them")))
            continue
        seen[same] = (key, key_node)
        if key != "<<":
            _duplicates(value_node, (*path, key), problems, signal_key)


def parse_yaml(text: str, signal_key: Callable[[str], str] = lambda k: k,
               limits: Limits = LIMITS) -> Any:
    """The data in the YAML ``text``, checked before it is built (see the module docstring).

    ``signal_key`` maps a signal table's key to the signal it names (``normalize_signal``,
    passed in by the caller so this module does not import the schema). Raises ``ConfigError``
    for a size limit, a duplicate or a conflict; ``yaml.YAMLError`` for a syntax error (the
    caller names the file and the line).
    """
    if len(text) > limits.max_bytes:
        raise ConfigError([("", f"the document is longer than {limits.max_bytes:,} "
                            "characters, far more than a config holds (is this the right file?)")])
    loader = _Loader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise ConfigError([("", _too_large("nested too deeply to read", limits.max_depth,
                                               "levels"))]) from None
        if node is None:
            return None
        _count(node, limits)
        problems: list[tuple[str, str]] = []
        _duplicates(node, (), problems, signal_key)
        if problems:
            raise ConfigError(problems)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def check_plain_size(data: Mapping[str, Any], limits: Limits = LIMITS) -> None:
    """The same bounds for a config given as Python data (``load_config({...})``): stops at the
    first value past ``limits.max_nodes`` (a shared or cyclic structure counts at each use), so
    it takes bounded time whatever ``data`` is."""
    count = 0
    stack: list[tuple[Any, int]] = [(data, 0)]
    while stack:
        value, depth = stack.pop()
        count += 1
        if count > limits.max_nodes:
            raise ConfigError([("", _too_large(f"the mapping holds more than "
                                               f"{limits.max_nodes:,} values",
                                               limits.max_nodes, "values"))])
        if depth > limits.max_depth:
            raise ConfigError([("", _too_large(f"the mapping nests more than {limits.max_depth} "
                                               "levels deep", limits.max_depth, "levels"))])
        if isinstance(value, str) and len(value) > limits.max_scalar:
            raise ConfigError([("", _too_large(f"a value of {len(value):,} characters",
                                               limits.max_scalar, "characters per value"))])
        if isinstance(value, Mapping):
            stack.extend((v, depth + 1) for kv in value.items() for v in kv)
        elif isinstance(value, (list, tuple, set, frozenset)):
            stack.extend((v, depth + 1) for v in value)
