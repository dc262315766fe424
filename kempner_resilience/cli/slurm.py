"""`kempner-resilience doctor` and `kempner-resilience sbatch`: the SLURM verbs.

``doctor`` runs the preflight checks (does the shutdown signal reach this process, can the job
requeue itself, does NCCL share our signal, ...) where the training would run: inside the job
(``srun kempner-resilience doctor``) or on a login node for the config-level checks.
``sbatch`` writes a batch script from one of the shipped templates with your values.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from kempner_resilience.cli.common import CliError, Verb, config_args, training_command
from kempner_resilience.config import load_config
from kempner_resilience.core.runpaths import RunPaths

if TYPE_CHECKING:
    from kempner_resilience.slurm import SaveFacts

__all__ = ["doctor", "sbatch", "VERBS"]


# ------------------------------------------------------------------------------------ doctor

def _setup_doctor(p: argparse.ArgumentParser) -> None:
    config_args(p)
    p.add_argument("--save-seconds", type=float, metavar="S",
                   help="a measured emergency-save time, compared with the job's --signal lead "
                        "(default: the newest checkpoint in checkpoint.dir says)")
    p.epilog = ("Exit status 0 when no error-level finding, 1 otherwise. Run it inside the job "
                "(`srun kempner-resilience doctor`) to check what the ranks will see. The "
                "emergency save's budget comes from the newest checkpoint in checkpoint.dir "
                "(its size and save time), as the run checks it at start.")


def last_save_facts(paths: RunPaths) -> SaveFacts | None:
    """What the newest committed checkpoint of the run says about the next emergency save
    (its size and save time, from its manifest), estimated as ``ResilientRun`` does after
    resuming from it; None without one."""
    from kempner_resilience.checkpoint import layout
    from kempner_resilience.checkpoint.estimate import SaveEstimator
    from kempner_resilience.slurm import SaveFacts

    try:
        entries = [e for e in layout.scan(paths) if e.committed]
    except OSError:
        return None
    if not entries:
        return None
    info = entries[-1].info()
    est = SaveEstimator()
    est.seed(info.save_seconds, info.nbytes)
    guess = est.estimate(info.nbytes)
    return SaveFacts(guess.seconds, guess.measured, info.nbytes, info.nbytes,
                     info.save_seconds)


def doctor(args: argparse.Namespace) -> int:
    from kempner_resilience.slurm import SaveFacts, format_findings, preflight, signal_lead_time
    from kempner_resilience.slurm.preflight import Finding
    from kempner_resilience.slurm.templates import requeue_signal

    if args.save_seconds is not None and args.save_seconds < 0:
        raise CliError("--save-seconds must be >= 0", 2)
    cfg = load_config(args.config, args.overrides)
    save = SaveFacts(args.save_seconds) if args.save_seconds is not None else \
        last_save_facts(RunPaths.from_config(cfg))
    findings = list(preflight(cfg, save=save))
    if "SLURM_JOB_ID" not in os.environ:
        save_s = None if save is None else save.save_s
        lead = signal_lead_time(cfg, save_s)
        sig = requeue_signal(cfg).removeprefix("SIG")
        findings.append(Finding(
            "info", "recommended-signal",
            f"for this config the batch script should ask for `#SBATCH --signal={sig}@{lead}` "
            f"(grace {cfg.signals.grace_for('SIG' + sig):.0f} s + margin"
            + (f", or the {save_s:.0f} s save + margins" if save_s else "") + ")",
            "render a script with `kempner-resilience sbatch`"))
    sys.stdout.write(format_findings(findings) + "\n")
    return 1 if any(f.level == "error" for f in findings) else 0


# ------------------------------------------------------------------------------------ sbatch

def _setup_sbatch(p: argparse.ArgumentParser) -> None:
    from kempner_resilience.slurm.templates import TEMPLATES

    p.usage = "%(prog)s [options] [-- COMMAND ...]"
    p.add_argument("--template", "-t", choices=TEMPLATES,
                   help="single_node (default), multi_node (default when --nodes > 1), "
                        "job_array (default when --array is given), multi_node_torchrun "
                        "(one torchrun agent per node: `kempner-resilience torchrun`) or ray "
                        "(a Ray cluster over the nodes, COMMAND is the Ray driver)")
    config_args(p)
    p.add_argument("--job-name", default="train", help="default: train")
    p.add_argument("--time", default="01:00:00", help="time limit; default 01:00:00")
    p.add_argument("--nodes", type=int, default=1, help="default 1 (>1: multi_node)")
    p.add_argument("--ntasks-per-node", type=int, default=1,
                   help="ranks per node, one per GPU: srun tasks, or torchrun's "
                        "--nproc-per-node with multi_node_torchrun; default 1")
    p.add_argument("--gpus-per-node", type=int, default=None,
                   help="GPUs per node; default: no --gpus-per-node line")
    p.add_argument("--spares", type=int, default=0, metavar="K",
                   help="spare nodes (templates multi_node, multi_node_torchrun): ask for "
                        "NODES + K with --no-kill; a spare takes a failed node's place in the "
                        "same job")
    p.add_argument("--in-job-restarts", type=int, default=None, metavar="R",
                   help="relaunches in place before a failure requeues (default: --spares)")
    p.add_argument("--array", help="sbatch --array spec, e.g. 0-9 (template job_array)")
    p.add_argument("--save-seconds", type=float, metavar="S",
                   help="measured emergency-save time: raises the --signal lead time if needed")
    p.add_argument("--lead-time", type=float, metavar="S",
                   help="--signal lead time in seconds (overrides the computed one)")
    p.add_argument("--extra", action="append", default=[], metavar="KEY[=VALUE]",
                   help="more #SBATCH options, e.g. --extra partition=gpu (repeatable)")
    p.add_argument("--output", "-o", metavar="FILE",
                   help="write the script here (default: stdout)")
    p.add_argument("--log", metavar="PATTERN",
                   help="the job's log (#SBATCH --output); default slurm-%%x-%%j.out")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND",
                   help="what every srun task (every torchrun worker) runs, after `--`; "
                        "default: python train.py")


def sbatch(args: argparse.Namespace) -> int:
    from kempner_resilience.slurm.templates import render_sbatch

    command = training_command(args.command)
    template = args.template
    if template is None:
        template = "job_array" if args.array else "multi_node" if args.nodes > 1 \
            else "single_node"
    extra: dict[str, str | None] = {}
    for item in args.extra:
        key, eq, val = item.partition("=")
        if not key.strip("-").strip():
            raise CliError(f"--extra {item!r}: give KEY=VALUE or KEY, e.g. partition=gpu", 2)
        extra[key.strip()] = val if eq else None
    cfg = load_config(args.config, args.overrides)
    try:
        text = render_sbatch(
            cfg, template=template, job_name=args.job_name,
            command=command or "python train.py", time=args.time, nodes=args.nodes,
            ntasks_per_node=args.ntasks_per_node, gpus_per_node=args.gpus_per_node,
            array=args.array, output=args.log,
            config_path=os.path.abspath(args.config) if args.config else None,
            save_seconds=args.save_seconds, lead_time_s=args.lead_time, extra=extra,
            spares=args.spares, in_job_restarts=args.in_job_restarts,
            overrides=args.overrides)
    except ValueError as e:
        raise CliError(str(e), 2) from None
    if not args.output or args.output == "-":
        sys.stdout.write(text)
        return 0
    out = Path(args.output)
    out.write_text(text)
    out.chmod(0o755)
    sys.stderr.write(f"wrote {out}; submit it with: sbatch {out}\n")
    return 0


VERBS = [
    Verb("doctor", "check that shutdown signals reach this process and the job can requeue "
         "itself (run it inside the job: srun kempner-resilience doctor)", _setup_doctor,
         doctor),
    Verb("sbatch", "write a batch script from a template (single_node, multi_node, job_array, "
         "multi_node_torchrun, ray) with the right --signal, --requeue and srun launch",
         _setup_sbatch, sbatch),
]
