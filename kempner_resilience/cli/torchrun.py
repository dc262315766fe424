"""`kempner-resilience torchrun`: torchrun as an srun task that shuts its workers down safely.

    kempner-resilience torchrun [--config F] [--set K=V] [--forward-signals M] \\
        --nnodes=2 --nproc-per-node=4 ... train.py [args]
    kempner-resilience accelerate [--config F] [--set K=V] [--forward-signals M] \\
        launch --multi_gpu --num_processes 4 ... train.py [args]

Our options come first; everything from the first other argument on (or after ``--``) is
torchrun's (accelerate's) command line, passed on unchanged. See ``supervise/torchrun/wrapper.py``
and ``supervise/torchrun/accelerate.py``.
"""

from __future__ import annotations

import argparse
from typing import Sequence

from kempner_resilience.cli.common import CliError, Verb, config_args
from kempner_resilience.config import load_config

__all__ = ["VERBS", "separate"]

_VALUED = ("--config", "-c", "--set", "--forward-signals")
_FLAGS = ("-h", "--help")
_WRAPPERS = ("torchrun", "accelerate")    # verbs followed by another launcher's command line


def separate(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``--`` put before torchrun's arguments when the verb is ``torchrun`` (or
    accelerate's, for ``accelerate``):
    argparse would otherwise reject torchrun's options (``--nnodes``) as unknown ones."""
    argv = list(argv)
    verb = next((i for i, a in enumerate(argv) if not a.startswith("-")), None)
    if verb is None or argv[verb] not in _WRAPPERS:
        return argv
    i = verb + 1
    while i < len(argv) and argv[i] != "--":
        arg = argv[i]
        if arg in _FLAGS or (arg.startswith("--") and arg.split("=", 1)[0] in _VALUED
                             and "=" in arg):
            i += 1
        elif arg in _VALUED:
            i += 2
        else:
            return argv[:i] + ["--"] + argv[i:]
    return argv


def _wrapper_args(p: argparse.ArgumentParser) -> None:
    config_args(p)
    p.add_argument("--forward-signals", choices=("auto", "yes", "no"), default=None,
                   help="send the agent's signals to the workers: yes, no (SLURM delivers them "
                        "to every process of the step), auto (default: from SLURM's "
                        "ProctrackType; also $KEMPNER_RESILIENCE_FORWARD_SIGNALS)")


def _setup(p: argparse.ArgumentParser) -> None:
    p.usage = "%(prog)s [options] [--] TORCHRUN_ARGS... SCRIPT [ARGS...]"
    _wrapper_args(p)
    p.add_argument("torchrun_args", nargs=argparse.REMAINDER, metavar="TORCHRUN_ARGS",
                   help="torchrun's own arguments, then the training script and its arguments")
    p.epilog = ("The exit status is the job's code from the workers' endings (a rank's own "
                "code before its peers' 81; 75 when the job was requeued). Run one per node: "
                "`srun --ntasks-per-node=1 kempner-resilience torchrun "
                "--nnodes=$SLURM_NNODES ...` (template multi_node_torchrun).")


def _run(args: argparse.Namespace) -> int:
    argv = list(args.torchrun_args)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        raise CliError("give torchrun's arguments and the training script, e.g. "
                       "`kempner-resilience torchrun --nproc-per-node=2 train.py`", 2)
    # Imported after the usage checks: it imports torch (1.5 s of CPU).
    from kempner_resilience.supervise.torchrun.wrapper import run

    forward = {"yes": True, "no": False}.get(args.forward_signals or "auto")
    # Read outside the `try`: a ConfigError is a ValueError too, and must leave as 78 (CONFIG)
    # with its message, like the `config` verb and a training script, not as a usage error.
    config = load_config(args.config, args.overrides)
    try:
        return run(argv, config, forward)
    except ValueError as e:   # a bad $KEMPNER_RESILIENCE_FORWARD_SIGNALS
        raise CliError(str(e), 2) from None


def _setup_accelerate(p: argparse.ArgumentParser) -> None:
    p.usage = "%(prog)s [options] [--] launch ACCELERATE_ARGS... SCRIPT [ARGS...]"
    _wrapper_args(p)
    p.add_argument("accelerate_args", nargs=argparse.REMAINDER, metavar="ACCELERATE_ARGS",
                   help="`launch`, accelerate's own options, then the training script and its "
                        "arguments")
    p.epilog = ("The exit status is the workers' (as for `kempner-resilience torchrun`). Several "
                "CPU ranks: `launch --multi_gpu --num_processes 2` (not --cpu: it starts one).")


def _run_accelerate(args: argparse.Namespace) -> int:
    from kempner_resilience.supervise.torchrun.accelerate import AccelerateArgsError, run

    argv = list(args.accelerate_args)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    forward = {"yes": True, "no": False}.get(args.forward_signals or "auto")
    config = load_config(args.config, args.overrides)
    try:
        return run(argv, config, forward)
    except AccelerateArgsError as e:
        raise CliError(str(e), 2) from None
    except ImportError as e:
        raise CliError(f"accelerate is not installed ({e}): pip install "
                       "'kempner-resilience[accelerate]'", 2) from None
    except ValueError as e:   # a bad $KEMPNER_RESILIENCE_FORWARD_SIGNALS
        raise CliError(str(e), 2) from None


VERBS = [
    Verb("torchrun", "run torchrun (one agent per node under srun) so that SLURM's signals reach "
         "every worker once and the agent waits for their checkpoint", _setup, _run),
    Verb("accelerate", "run `accelerate launch` with the torchrun agent of the `torchrun` verb: "
         "signals reach every rank once, the agent waits for their checkpoint",
         _setup_accelerate, _run_accelerate),
]
