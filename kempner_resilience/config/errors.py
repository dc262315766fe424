"""The configuration's errors: each names the key path, the bad value and the fix."""

from __future__ import annotations

from kempner_resilience.core.startup import StartupError

__all__ = ["ConfigError", "ConfigFileNotFoundError"]


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
