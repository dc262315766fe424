"""`kempner-resilience`: the command line.

Every verb has ``--help``. Errors are one line on stderr and a non-zero exit, never a traceback:
a user reading a SLURM log at 3 a.m. needs the problem and the fix, not our stack.

The small verbs (``config``, ``exit-codes``) live here; the others in their own modules, which
only use the library: ``checkpoints.py`` (ls, verify), ``slurm.py`` (doctor, sbatch),
``demo.py`` and ``demo_slurm.py`` (demo), ``launch.py`` (launch), ``torchrun.py`` (torchrun),
``srun.py`` (srun: relaunch in place on spare nodes), ``checkresume.py`` (check-resume).
``common.py`` holds what they share.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Callable, Sequence

from kempner_resilience import __version__
from kempner_resilience.cli.common import CliError, Verb, config_args
from kempner_resilience.config import load_config
from kempner_resilience.exitcodes import TABLE, ExitCode
from kempner_resilience.core.startup import StartupError

__all__ = ["main", "build_parser", "register", "CliError"]

_VERBS: dict[str, Verb] = {}


def register(name: str, help: str, setup: Callable[[argparse.ArgumentParser], None],
             run: Callable[[argparse.Namespace], int]) -> None:
    """Add the subcommand ``name``: ``setup(parser)`` adds its flags, ``run(args)`` -> exit code."""
    _VERBS[name] = Verb(name, help, setup, run)


def _setup_config(p: argparse.ArgumentParser) -> None:
    config_args(p)
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
    for verb in _VERBS.values():
        verb.setup(sub.add_parser(verb.name, help=verb.help, description=verb.help))
    return parser


def _load_verbs() -> None:
    # Verbs with heavier imports live in their own modules, loaded only to run the command.
    from kempner_resilience.cli import (checkpoints, checkresume, demo, launch, report, slurm,
                                        srun, torchrun)

    for module in (demo, launch, checkresume, checkpoints, report, slurm, srun, torchrun):
        for verb in module.VERBS:
            _VERBS.setdefault(verb.name, verb)


# How the command line's own log lines are labelled (never ``[rank N]``): the process that
# starts ranks, or the agent torchrun runs, says what it is; other verbs say their name.
_ROLES = {"launch": "launcher", "demo": "demo launcher", "srun": "srun supervisor",
          "torchrun": "agent", "accelerate": "agent", "check-resume": "check-resume"}


def _stdout_to_devnull() -> None:
    """The reader of stdout is gone: point stdout at /dev/null, so that the interpreter's own
    flush at exit does not raise BrokenPipeError again (the recipe in Python's signal docs)."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):       # not a real file (captured): nothing flushes it at exit
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def main(argv: Sequence[str] | None = None) -> int:
    from kempner_resilience.cli.torchrun import separate

    parser = build_parser()
    args = parser.parse_args(separate(sys.argv[1:] if argv is None else argv))
    if not args.verb:
        parser.print_help()
        return int(ExitCode.USAGE)
    from kempner_resilience.core.log import configure, set_role

    configure("DEBUG" if args.verbose else "INFO")
    # The command line is never a rank, even started with RANK or SLURM_PROCID set (a launcher
    # as an srun task): its own lines must not read as rank 0's.
    previous = set_role(_ROLES.get(args.verb, f"kempner-resilience {args.verb}"))
    try:
        return _run_verb(args)
    finally:
        set_role(previous)      # main() called in-process (a test, a notebook) leaves no trace


def _run_verb(args: argparse.Namespace) -> int:
    try:
        code = int(_VERBS[args.verb].run(args))
        sys.stdout.flush()    # a reader gone early (`ls | head`) shows here, not at exit
        return code
    except BrokenPipeError:
        _stdout_to_devnull()
        return 128 + signal.SIGPIPE     # what a shell reports for a writer killed by SIGPIPE
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
