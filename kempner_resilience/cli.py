"""`kempner-resilience`: the command line.

Every verb has ``--help``. Errors are one line on stderr and a non-zero exit, never a traceback:
a user reading a SLURM log at 3 a.m. needs the problem and the fix, not our stack.
"""

from __future__ import annotations

import argparse
import signal
import sys
from typing import Callable, Sequence

from kempner_resilience import __version__
from kempner_resilience.config import load_config
from kempner_resilience.exitcodes import TABLE, ExitCode
from kempner_resilience.startup import StartupError

__all__ = ["main"]

_VERBS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None],
                        Callable[[argparse.Namespace], int]]] = {}


def register(name: str, help: str, setup: Callable[[argparse.ArgumentParser], None],
             run: Callable[[argparse.Namespace], int]) -> None:
    """Add the subcommand ``name``: ``setup(parser)`` adds its flags, ``run(args)`` -> exit code."""
    _VERBS[name] = (help, setup, run)


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", "-c", metavar="YAML", help="config file (default: built-in "
                   "defaults or $KEMPNER_RESILIENCE_CONFIG)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set signals.grace_s=90 (repeatable)")


def _setup_config(p: argparse.ArgumentParser) -> None:
    _config_args(p)
    p.add_argument("--defaults", action="store_true",
                   help="print the commented default config (configs/default.yaml)")


def _config(args: argparse.Namespace) -> int:
    import yaml

    from kempner_resilience.config import render_default_yaml

    if args.defaults:
        sys.stdout.write(render_default_yaml())
        return 0
    cfg = load_config(args.config, args.overrides)
    sys.stdout.write(yaml.safe_dump(cfg.to_dict(), sort_keys=False))
    return 0


def _codes(args: argparse.Namespace) -> int:
    for code, text in TABLE.items():
        sys.stdout.write(f"{int(code):>4}  {code.name:<18} {text}\n")
    return 0


register("config", "validate a config and print it with every key resolved", _setup_config,
         _config)
register("exit-codes", "list the exit codes and what each means", lambda p: None, _codes)


def build_parser() -> argparse.ArgumentParser:
    _load_verbs()
    parser = argparse.ArgumentParser(
        prog="kempner-resilience",
        description="Keep long PyTorch training jobs on SLURM alive through time limits, "
                    "preemption, Ctrl+C and hung collectives, without losing work.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug details")
    sub = parser.add_subparsers(dest="verb", metavar="VERB")
    for name, (help_text, setup, _) in _VERBS.items():
        setup(sub.add_parser(name, help=help_text, description=help_text))
    return parser


def _load_verbs() -> None:
    # Verbs with heavier imports live in their own modules and call register() on import.
    for mod in _VERB_MODULES:
        __import__(mod)


_VERB_MODULES = ["kempner_resilience.demo.cli", "kempner_resilience.checkpoint.cli",
                 "kempner_resilience.slurm.cli", "kempner_resilience.goodput_cli"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.verb:
        parser.print_help()
        return int(ExitCode.USAGE)
    from kempner_resilience.log import configure

    configure("DEBUG" if args.verbose else "INFO")
    try:
        return int(_VERBS[args.verb][2](args))
    except KeyboardInterrupt:
        return 128 + signal.SIGINT
    except StartupError as e:  # a bad config or a missing config file, as for a training script
        sys.stderr.write(f"kempner-resilience {args.verb}: {e}\n")
        return int(ExitCode.CONFIG)
    except (FileNotFoundError, PermissionError, NotADirectoryError, IsADirectoryError) as e:
        sys.stderr.write(f"kempner-resilience {args.verb}: {e}\n")
        return 1
    except CliError as e:
        sys.stderr.write(f"kempner-resilience {args.verb}: {e}\n")
        return e.code


class CliError(Exception):
    """A user-facing failure: printed as one line, exits with ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
