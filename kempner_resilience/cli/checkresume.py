"""`kempner-resilience check-resume`: prove that a script resumes exactly, before the real job.

    kempner-resilience check-resume [--ranks N] [--steps 10] [--interrupt-at 3,7]
        [--signal USR1] [--kill-rank R] [--timeout 120] [--max-steps 300]
        -- python train.py [args]

Runs the script on N local ranks twice (``checkresume/``): uninterrupted to --steps, then
stopped at each --interrupt-at step and relaunched from its checkpoint, and compares the two
runs' checkpoints step by step. Exit 0: exact; 3 (RESUME_INEXACT): what differs, from which
step, and the likely cause; 4 (RESUME_UNCHECKED): the script failed, timed out or committed
nothing; 5 (RESUME_NONDETERMINISTIC): two uninterrupted runs already differ; 6
(RESUME_NOT_COVERED): exact, but the stops did not cross an epoch end, a scheduler milestone or
an eval (``run.event("eval")``) the script shows, within --max-steps (by default a run stops
across the first one), or, on 2+ ranks with the rescue on, no rescue checkpoint was written
after the last rank was SIGKILLed (by default a run checks a resume from it).
--config/--set are the settings the script's ResilientRun gets (its checkpoint.dir and cadence
are check-resume's own).
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from kempner_resilience.cli.common import CliError, Verb, config_args, training_command
from kempner_resilience.exitcodes import ExitCode

__all__ = ["VERBS"]


def _steps(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give steps as 3,7") from None


def _setup(p: argparse.ArgumentParser) -> None:
    p.usage = "%(prog)s [--ranks N] [--steps S] [--interrupt-at 3,7] -- COMMAND [ARGS...]"
    p.add_argument("--ranks", type=int, default=1, metavar="N",
                   help="local ranks (gloo on CPU where the script allows it); default 1")
    p.add_argument("--steps", type=int, default=10, metavar="S",
                   help="steps each run trains before its final stop; default 10")
    p.add_argument("--interrupt-at", type=_steps, default=(3, 7), metavar="STEPS",
                   help="steps at which the second run is stopped and relaunched; default 3,7")
    p.add_argument("--signal", default="USR1", metavar="SIG",
                   help="the interrupting signal (USR1: requeue, TERM/INT: stop); default USR1")
    p.add_argument("--kill-rank", type=int, default=None, metavar="R",
                   help="SIGKILL rank R at the interrupts instead (2+ ranks: the survivors' "
                        "rescue and the relaunch after 81); without it, 2+ ranks with the "
                        "rescue on get one run more whose last rank is SIGKILLed at the first "
                        "interrupt")
    p.add_argument("--timeout", type=float, default=120.0, metavar="S",
                   help="seconds each run may take before its ranks are stopped; default 120")
    p.add_argument("--max-steps", type=int, default=300, metavar="M",
                   help="how far a run may train to stop across the first epoch end or "
                        "scheduler milestone the script shows; default 300")
    p.add_argument("--workdir", type=Path, default=None, metavar="DIR",
                   help="where both runs' checkpoints and rank logs go (kept); default a "
                        "temporary directory, removed when the resume is exact")
    config_args(p)
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND",
                   help="the command every rank runs, e.g. python train.py --lr 0.1")
    p.epilog = ("Exit 0: exact; 3 RESUME_INEXACT: the report names the entries that differ, "
                "the first step that differs and the likely cause; 4 RESUME_UNCHECKED: the "
                "script failed, timed out or committed no checkpoint; 5 "
                "RESUME_NONDETERMINISTIC: two uninterrupted runs of it already differ; 6 "
                "RESUME_NOT_COVERED: exact, but no stop crossed an epoch end, milestone or eval "
                "within --max-steps (the report names it).")


def _run(args: argparse.Namespace) -> int:
    from kempner_resilience.checkresume.options import CheckOptions
    from kempner_resilience.config import load_config

    command = training_command(args.command)
    if not command:
        raise CliError("give the command every rank runs, e.g. `kempner-resilience "
                       "check-resume -- python train.py`", 2)
    if shutil.which(command[0]) is None:
        raise CliError(f"{command[0]!r}: no such command (not a file, not on PATH)", 2)
    cfg = load_config(args.config, args.overrides)
    try:
        opts = CheckOptions(tuple(command), ranks=args.ranks, steps=args.steps,
                            interrupt_at=args.interrupt_at, signal_name=args.signal,
                            kill_rank=args.kill_rank, timeout_s=args.timeout,
                            max_steps=args.max_steps,
                            workdir=args.workdir.resolve() if args.workdir else None,
                            config=cfg.to_dict())
    except ValueError as e:
        raise CliError(str(e), int(ExitCode.USAGE)) from None
    from kempner_resilience.checkresume.runs import warm_ranks

    # The ranks' warm parent imports torch in its own process while this one does.
    with warm_ranks(opts.command, opts.ranks) as zygote:
        from kempner_resilience.checkresume.check import check_resume, cleanup   # loads torch
        from kempner_resilience.checkresume.render import render

        try:
            verdict = check_resume(opts, zygote)
        except OSError as e:    # the work directory (or the temporary one) cannot be written
            where = e.filename or args.workdir or "the temporary directory"
            raise CliError(f"cannot write {where}: {e.strerror or e}; give --workdir a "
                           "writable directory (or set TMPDIR to one)",
                           int(ExitCode.CONFIG)) from None
    print(render(verdict))
    sys.stdout.flush()
    cleanup(verdict, keep=args.workdir is not None)
    return verdict.code


VERBS = [
    Verb("check-resume", "run your script uninterrupted and interrupted (a signal at chosen "
         "steps, relaunched from its checkpoint) and compare their checkpoints: exact, or what "
         "differs, from which step, and why", _setup, _run),
]
