"""The SLURM layer: job environment, requeue with a restart budget, preflight checks, sbatch
templates. Importing it does not import torch and needs no SLURM installed."""

from kempner_resilience.slurm.budget import SaveBudget, SaveFacts, save_budget
from kempner_resilience.slurm.env import (
    SignalSpec,
    SlurmJob,
    expand_hostlist,
    first_host,
    master_port,
    parse_signal_spec,
    setup_torch_env,
)
from kempner_resilience.slurm.preflight import Finding, format_findings, preflight
from kempner_resilience.slurm.requeue import (
    RequeueResult,
    RestartLedger,
    decide_requeue,
    requeue_job,
    scheduler_decision,
)
from kempner_resilience.slurm.scontrol import ScontrolResult, run_scontrol, show_job
from kempner_resilience.slurm.templates import TEMPLATES, render_sbatch, signal_lead_time

__all__ = [
    "Finding", "RequeueResult", "RestartLedger", "SaveBudget", "SaveFacts", "ScontrolResult",
    "SignalSpec", "SlurmJob", "TEMPLATES", "decide_requeue", "expand_hostlist", "first_host",
    "format_findings", "master_port", "parse_signal_spec", "preflight", "render_sbatch",
    "requeue_job", "run_scontrol", "save_budget", "scheduler_decision", "setup_torch_env",
    "show_job", "signal_lead_time",
]
