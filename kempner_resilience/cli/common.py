"""What every verb module of the command line shares: the verb record, the user-facing error,
and the ``--config``/``--set`` options."""

from __future__ import annotations

import argparse
from typing import Callable, NamedTuple

__all__ = ["CliError", "Verb", "config_args", "training_command"]


class CliError(Exception):
    """A user-facing failure: printed as one line, exits with ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class Verb(NamedTuple):
    """One subcommand: ``setup(parser)`` adds its flags, ``run(args)`` returns the exit code."""

    name: str
    help: str
    setup: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


def config_args(p: argparse.ArgumentParser) -> None:
    """Add ``--config`` and ``--set`` (read with ``load_config(args.config, args.overrides)``)."""
    p.add_argument("--config", "-c", metavar="YAML", help="config file (default: built-in "
                   "defaults or $KEMPNER_RESILIENCE_CONFIG)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set signals.grace_s=90 (repeatable)")


def training_command(words: list[str]) -> list[str]:
    """The training command given after ``--`` (argparse's REMAINDER keeps the ``--``); a
    leading option is one of ours misspelled or misplaced, not the command (exit 2)."""
    command = list(words)
    if command[:1] == ["--"]:
        command = command[1:]
    if command and command[0].startswith("-"):
        raise CliError(f"unknown option {command[0]!r}; put the training command after `--`",
                       2)
    return command
