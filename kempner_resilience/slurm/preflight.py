"""Checks that the shutdown signal can reach this process and the job can be requeued.

Run at start-up (``ResilientRun``) and by ``kempner-resilience doctor``. Every problem becomes a
``Finding`` naming the fix; nothing here raises or changes the environment.
"""

from __future__ import annotations

import os
import signal as _signal
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from kempner_resilience.config import Action, ResilienceConfig
from kempner_resilience.core.log import get_logger
from kempner_resilience.slurm.budget import SaveFacts, save_budget
from kempner_resilience.slurm.clock import END_TIME_ENV
from kempner_resilience.slurm.env import SignalSpec, SlurmJob
from kempner_resilience.slurm.scontrol import (find_scontrol, kill_wait, parse_slurm_time,
                                               show_job)
from kempner_resilience.slurm.templates import requeue_signal

__all__ = ["Finding", "preflight", "format_findings", "plain_torchrun", "TORCHRUN_AGENT_ENV"]

_log = get_logger(__name__)

LEVELS = ("error", "warn", "info")
# Set by `kempner-resilience torchrun` in its workers' environment (the agent's pid): that agent
# forwards every signal once and waits for the workers, unlike a plain torchrun.
TORCHRUN_AGENT_ENV = "KEMPNER_RESILIENCE_TORCHRUN_AGENT"


@dataclass(frozen=True)
class Finding:
    """One preflight result: ``level`` is error, warn or info; ``code`` a stable identifier."""

    level: str
    code: str
    message: str
    fix: str = ""


def _parent_cmdline(pid: int | None = None) -> str:
    try:
        ppid = os.getppid() if pid is None else pid
        raw = Path(f"/proc/{ppid}/cmdline").read_bytes()
        return raw.replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _torchrun_parent(environ: Mapping[str, str]) -> str | None:
    """Why we think torchrun (torch.distributed.run / elastic agent) started us, or None."""
    for var in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS"):
        if var in environ:
            return f"{var} is set"
    cmd = _parent_cmdline()
    if "torchrun" in cmd or "torch.distributed.run" in cmd or "torch.distributed.launch" in cmd:
        return f"the parent process is `{cmd[:80]}`"
    return None


def plain_torchrun(environ: Mapping[str, str] | None = None) -> str | None:
    """One line for a run that plain torchrun started (not ``kempner-resilience torchrun``,
    whose agent names itself in its workers' environment), pointing to the latter; else None.
    Plain torchrun reports every intended stop (a signal's checkpoint, Ctrl+C, a requeue) as a
    failed worker: exit 1 and a ``ChildFailedError`` traceback, however well the ranks ended."""
    env = os.environ if environ is None else environ
    why = _torchrun_parent(env)
    if why is None or env.get(TORCHRUN_AGENT_ENV):
        return None
    return (f"started by plain torchrun ({why}): it turns every intended stop (a signal's "
            "checkpoint, Ctrl+C, a requeue) into exit 1 with a ChildFailedError traceback, and "
            "its agent dies on SIGUSR1; run `kempner-resilience torchrun` with the same "
            "arguments instead (its agent passes signals on and exits with the ranks' code)")


def _signal_numbers(config: ResilienceConfig) -> dict[int, str]:
    out = {}
    for name in config.signals.handled():
        try:
            out[int(_signal.Signals[name])] = name
        except KeyError:
            pass
    return out


def _budget_finding(config: ResilienceConfig, save: SaveFacts, spec: SignalSpec | None,
                    kill_wait_s: float | None, end_known: bool) -> Finding:
    b = save_budget(config, save, lead_s=None if spec is None else spec.lead_s,
                    signal=None if spec is None else spec.signal, kill_wait_s=kill_wait_s,
                    end_known=end_known)
    return Finding(b.level, b.code, b.message, b.fix)


def _reach_findings(job: SlurmJob, known: bool, spec: SignalSpec | None,
                    config: ResilienceConfig, save: SaveFacts | None,
                    wanted: str, kill_wait_s: float | None = None,
                    end_known: bool = False) -> list[Finding]:
    """Does the job's --signal reach this process, early enough for the emergency save?"""
    out: list[Finding] = []
    lead_hint = f"#SBATCH --signal={wanted.removeprefix('SIG')}@<seconds>"
    is_batch_shell = not job.in_step and job.task_pid == os.getpid()
    if not job.in_step and not is_batch_shell:
        # A child of the batch shell: `--signal` goes to srun tasks, `B:` to the shell itself.
        out.append(Finding(
            "warn", "not-srun-task",
            "this process is neither an srun task nor the batch shell (started from the batch "
            "script without srun/exec): SLURM's --signal reaches neither it nor its ranks, "
            "only the final SIGTERM/SIGKILL",
            "launch the ranks with `srun` in the batch script (see slurm/single_node.sbatch), "
            "or `exec` the Python command"))
    if not known:
        out.append(Finding(
            "info", "signal-unknown",
            "could not read the job's --signal (scontrol unavailable or batch script unreadable)",
            f"make sure the batch script has `{lead_hint}` without `B:`"))
        return out
    if spec is None:
        out.append(Finding(
            "warn", "no-signal",
            "the job has no --signal in its batch script: at the time limit it gets only "
            "SIGTERM and SIGKILL KillWait later (often 30 s), too little for a checkpoint "
            "(an `sbatch --signal` on the command line is not visible here)",
            f"add `{lead_hint}` (render one with `kempner-resilience sbatch`)"))
        if save is not None:
            out.append(_budget_finding(config, save, None, kill_wait_s, end_known))
        return out
    if job.in_step and spec.batch_only:
        out.append(Finding(
            "error", "signal-batch-only",
            f"--signal={spec} has `B:`: only the batch shell gets {spec.signal}, never this srun "
            "task, so no emergency checkpoint will be taken at the time limit",
            f"drop `B:`: `#SBATCH --signal={spec.signal.removeprefix('SIG')}@{spec.lead_s}`"))
    if is_batch_shell and not spec.batch_only:
        out.append(Finding(
            "warn", "signal-to-steps-only",
            f"this process is the batch script itself, but --signal={spec} (no `B:`) goes only "
            "to srun tasks",
            "launch the training with `srun` (preferred), or use `B:` while the script execs "
            "Python directly"))
    handled = config.signals.handled()
    if spec.signal not in handled:
        out.append(Finding(
            "warn", "signal-not-handled",
            f"the job asks SLURM for {spec.signal}, which this config does not handle "
            f"(handled: {', '.join(sorted(handled)) or 'none'}): its default action kills the "
            "process without a checkpoint",
            f"use `#SBATCH --signal={wanted.removeprefix('SIG')}@{spec.lead_s}` or set "
            f"signals.actions.{spec.signal}: requeue"))
    elif save is not None:
        out.append(_budget_finding(config, save, spec, kill_wait_s, end_known))
    if spec.signal in handled and spec.lead_s < config.signals.grace_for(spec.signal):
        out.append(Finding(
            "info", "grace-exceeds-lead",
            f"signals grace for {spec.signal} ({config.signals.grace_for(spec.signal):.0f} s) "
            f"is longer than the --signal lead ({spec.lead_s} s): the time limit's SIGTERM may "
            "arrive while the shutdown still runs",
            "raise the --signal lead time or lower the grace"))
    return out


def preflight(config: ResilienceConfig | None = None,
              environ: Mapping[str, str] | None = None, *,
              save_seconds: float | None = None, save: SaveFacts | None = None,
              timeout: float = 10.0) -> list[Finding]:
    """Check this process's launch against what graceful shutdown and requeue need.

    ``environ`` defaults to ``os.environ`` (its PATH is where ``scontrol`` is looked for).
    ``save`` (or just ``save_seconds``, a measured emergency-save time) is compared with the
    job's ``--signal`` lead time, its grace and ``KillWait`` (``slurm.budget``): one finding
    says whether the emergency save fits.
    """
    config = config or ResilienceConfig()
    env = os.environ if environ is None else environ
    if save is None and save_seconds is not None:
        save = SaveFacts(save_s=save_seconds, measured=True)
    out: list[Finding] = []
    numbers = _signal_numbers(config)
    nccl = env.get("NCCL_PROXY_DUMP_SIGNAL", "").strip()
    if nccl.isdigit() and int(nccl) in numbers:
        out.append(Finding(
            "warn", "nccl-dump-signal",
            f"NCCL_PROXY_DUMP_SIGNAL={nccl} is {numbers[int(nccl)]}, a shutdown signal here: "
            "NCCL also reacts to it (dumps proxy state) and may hide it from us",
            "unset NCCL_PROXY_DUMP_SIGNAL, or set it to a signal we do not handle"))
    torchrun = _torchrun_parent(env)
    if torchrun and env.get(TORCHRUN_AGENT_ENV):
        out.append(Finding(
            "info", "torchrun-agent",
            f"started by `kempner-resilience torchrun` (agent pid {env[TORCHRUN_AGENT_ENV]}): "
            "it sends every signal once to each worker and waits for their shutdown", ""))
    elif torchrun:
        usr = [n for n, a in config.signals.handled().items() if n in ("SIGUSR1", "SIGUSR2")
               and a is not Action.OFF]
        out.append(Finding(
            "warn", "torchrun",
            f"started by torchrun ({torchrun}): torchrun forwards only TERM/INT/HUP/QUIT to its "
            f"workers and its agent dies on {'/'.join(usr) or 'SIGUSR1'}, killing the ranks "
            "without a checkpoint",
            "launch one srun task per GPU without torchrun and call "
            "kempner_resilience.slurm.setup_torch_env() (see slurm/multi_node.sbatch), or run "
            "`kempner-resilience torchrun` instead of torchrun (slurm/multi_node_torchrun.sbatch)"))
    job = SlurmJob.from_env(env)
    if job is None:
        out.append(Finding("info", "not-slurm", "not running under SLURM (no SLURM_JOB_ID): "
                           "a REQUEUE exit asks the local launcher to relaunch", ""))
        return out
    if find_scontrol(env) is None:
        out.append(Finding(
            "warn", "scontrol-missing",
            "scontrol is not on PATH: the job cannot requeue itself (common inside "
            "enroot/pyxis containers); it will exit with REQUEUE_FAILED (79)",
            "bind-mount scontrol, /etc/slurm and the munge socket into the container, or "
            "resubmit when the job exits with 79"))
        known, spec = False, None
        info = None
    else:
        info = show_job(job.requeue_id, timeout, environ=env)
        known, spec = job.signal_spec(timeout, env) if info is not None else (False, None)
    kw, end_known = None, False
    if save is not None and known:
        kw = kill_wait(timeout, environ=env)
        end_known = _end_known(env, info)
    out += _reach_findings(job, known, spec, config, save, requeue_signal(config), kw,
                           end_known)
    if info is not None and info.get("Requeue") == "0":
        out.append(Finding(
            "warn", "no-requeue",
            f"job {job.requeue_id} cannot be requeued (Requeue=0: --no-requeue, or the cluster "
            "default JobRequeue=0): `scontrol requeue` will fail",
            "add `#SBATCH --requeue`"))
    if job.open_mode != "a":
        out.append(Finding(
            "warn", "log-truncate",
            "the job's log is not in append mode (SLURM_OPEN_MODE is not `a`): a requeued run "
            "truncates the earlier runs' output, unless the cluster sets JobFileAppend=1",
            "add `#SBATCH --open-mode=append`"))
    for f in out:
        _log.debug("preflight %s %s: %s", f.level, f.code, f.message)
    return out


def _end_known(env: Mapping[str, str], info: Mapping[str, str] | None) -> bool:
    """Whether the run can know its allocation's end (as ``slurm.clock.job_end_time`` reads it),
    from what is at hand: the environment and ``scontrol show job``."""
    if env.get(END_TIME_ENV, "").strip():
        return True
    if info is None or info.get("TimeLimit") in ("UNLIMITED", "Partition_Limit"):
        return False
    return parse_slurm_time(info.get("EndTime")) is not None


def format_findings(findings: list[Finding]) -> str:
    """Human-readable report, most severe first, for ``kempner-resilience doctor``."""
    if not findings:
        return "preflight: no problems found"
    order = {lvl: i for i, lvl in enumerate(LEVELS)}
    lines = []
    for f in sorted(findings, key=lambda f: order.get(f.level, len(LEVELS))):
        lines.append(f"{f.level.upper():5} [{f.code}] {f.message}")
        if f.fix:
            lines.append(f"      fix: {f.fix}")
    counts = {lvl: sum(f.level == lvl for f in findings) for lvl in LEVELS}
    lines.append("preflight: " + ", ".join(f"{n} {lvl}" for lvl, n in counts.items() if n))
    return "\n".join(lines)
