"""`kempner-resilience srun`: the training as srun steps that are relaunched in place, on a
spare node, after a node or rank failure (``supervise/srun/relaunch.py``).

    kempner-resilience srun --spares 1 [--config F] [--set K=V] -- python train.py ...

Run it in the batch script of a job that asked for N + K nodes with ``#SBATCH --no-kill``
(``kempner-resilience sbatch --spares K`` writes one); it trains on N of them.
"""

from __future__ import annotations

import argparse
import shlex

from kempner_resilience.cli.common import CliError, Verb, config_args, training_command
from kempner_resilience.config import load_config

__all__ = ["VERBS"]


def _setup(p: argparse.ArgumentParser) -> None:
    p.usage = "%(prog)s [--spares K | --agents] [options] -- COMMAND ..."
    p.add_argument("--spares", type=int, default=0, metavar="K",
                   help="nodes of the allocation kept as spares (the training runs on the "
                        "other ones, one srun task per --ntasks-per-node; default 0)")
    p.add_argument("--in-job-restarts", type=int, default=None, metavar="R",
                   help="relaunches in place before a failure requeues the job (default: "
                        "--spares)")
    p.add_argument("--agents", action="store_true",
                   help="each task restarts its own workers (`kempner-resilience torchrun` on "
                        "every node, standbys included): the step is never ended or relaunched "
                        "for a failure, only ended once the run finished; a failure that ends "
                        "it requeues the job (template multi_node_torchrun)")
    p.add_argument("--srun-args", default="", metavar="ARGS",
                   help="more options for every srun step, one shell-quoted string (submitit's "
                        "jobs: \"--unbuffered --output F --error F\", its per-task logs)")
    config_args(p)
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND",
                   help="what every srun task runs, after `--`")
    p.epilog = ("The exit status is the job's code by the one policy's rule over the ranks' "
                "codes (docs/design.md). After a failure ending (PEER_LOST, HANG, a killed "
                "rank, a dead node) the training starts again on the healthy nodes plus a "
                "spare, from the newest committed checkpoint, at most --in-job-restarts "
                "times; then, or with no spare left, the job is requeued (with a committed "
                "checkpoint). The ranks tell the loop their checkpoint.dir and requeue "
                "settings (KEMPNER_RESILIENCE_SUPERVISOR); --config/--set are read only "
                "until rank 0 first reports.")


def _run(args: argparse.Namespace) -> int:
    from kempner_resilience.supervise.srun.relaunch import run_in_place

    command = training_command(args.command)
    if not command:
        raise CliError("give the training command after `--`, e.g. -- python train.py", 2)
    restarts = args.spares if args.in_job_restarts is None else args.in_job_restarts
    if args.agents and (args.spares or restarts):
        raise CliError("--agents takes no --spares/--in-job-restarts: the agents (torchrun's "
                       "--max-restarts and standbys) relaunch in place themselves", 2)
    if args.spares < 0 or restarts < 0:
        raise CliError("--spares and --in-job-restarts must be >= 0", 2)
    cfg = load_config(args.config, args.overrides)
    try:
        return run_in_place(command, args.spares, cfg, restarts, agents=args.agents,
                            srun_args=shlex.split(args.srun_args))
    except ValueError as e:
        raise CliError(str(e), 2) from None


VERBS = [Verb("srun", "run the training as srun steps relaunched in place on a spare node "
              "after a node or rank failure (batch script of `sbatch --spares K`)", _setup,
              _run)]
