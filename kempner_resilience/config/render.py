"""``configs/default.yaml`` and ``docs/config.md``'s table, generated from the schema."""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from kempner_resilience.config.bounds import Range
from kempner_resilience.config.schema import ResilienceConfig
from kempner_resilience.config.serial import dump, yaml_name

__all__ = ["render_default_yaml", "render_reference_markdown"]


def _yaml_scalar(value: Any) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml_scalar(v)}" for k, v in value.items()) + "}"
    text = yaml.safe_dump(dump(value), default_flow_style=True).strip()
    return text[:-4].strip() if text.endswith("...") else text


def _allowed(f: dataclasses.Field) -> str:
    """The declared range of a numeric key: ``>= 1 and <= 256`` (empty for other keys)."""
    bounds: Range | None = f.metadata.get("bounds")
    return bounds.text() if bounds else ""


def _default(obj: Any, f: dataclasses.Field) -> Any:
    """The key's default as declared (``checkpoint.dir``'s ``checkpoints``), not as resolved
    for this process (its absolute path under the current directory)."""
    return f.default if f.default is not dataclasses.MISSING else getattr(obj, f.name)


def _comment(f: dataclasses.Field) -> str:
    allowed = _allowed(f)
    return f.metadata["help"] + (f"; allowed: {allowed}" if allowed else "")


def render_default_yaml() -> str:
    """``configs/default.yaml``: every key with its default and a one-line comment."""
    lines = ["# kempner_resilience configuration: every key, its default and what it does.",
             "# Load with kempner_resilience.load_config(path, overrides=['section.key=value']).",
             "# docs/config.md has the same reference; both are generated from config/schema.py.", ""]
    root = ResilienceConfig()
    for sec in dataclasses.fields(root):
        lines.append(f"{yaml_name(sec)}:  # {sec.metadata['help']}")
        obj = getattr(root, sec.name)
        for f in dataclasses.fields(obj):
            value = _yaml_scalar(_default(obj, f))
            lines.append(f"  {yaml_name(f)}: {value}  # {_comment(f)}")
        lines.append("")
    return "\n".join(lines)


def render_reference_markdown() -> str:
    """The body of ``docs/config.md``'s reference table."""
    out = ["| key | default | allowed | meaning |", "| --- | --- | --- | --- |"]
    root = ResilienceConfig()
    for sec in dataclasses.fields(root):
        obj = getattr(root, sec.name)
        for f in dataclasses.fields(obj):
            value = _yaml_scalar(_default(obj, f)).replace("|", "\\|")
            allowed = _allowed(f).replace(">", "&gt;").replace("<", "&lt;")
            out.append(f"| `{yaml_name(sec)}.{yaml_name(f)}` | `{value}` | {allowed} | "
                       f"{f.metadata['help'].replace('|', chr(92) + '|')} |")
    return "\n".join(out)
