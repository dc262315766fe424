"""Render the sbatch templates shipped in ``kempner_resilience/templates/``.

The templates are complete, directly usable batch scripts with concrete defaults (``sbatch
slurm/single_node.sbatch`` works as is on a GPU cluster). The package copies are the source: the
repository's ``slurm/*.sbatch`` are what ``kempner-resilience sbatch`` renders from them with
those defaults, written by ``scripts/regen_slurm.py`` (a test checks they are in sync).

``render_sbatch`` rewrites a template's values in place: it replaces ``#SBATCH --key=value``
lines, adds or removes the optional ones (GPUs, extra site options, the config export) and
replaces the command of the ``srun --kill-on-bad-exit=1 ...`` line (in ``multi_node_torchrun``,
``kempner-resilience srun ... -- "${TORCHRUN[@]}" ...``: what follows ``"${TORCHRUN[@]}"``, each
worker's command); every comment stays.
"""

from __future__ import annotations

import math
import re
import shlex
from importlib import resources
from typing import Mapping, Sequence

from kempner_resilience.config import Action, ResilienceConfig
from kempner_resilience.core.log import get_logger

__all__ = ["TEMPLATES", "template_text", "signal_lead_time", "requeue_signal", "render_sbatch",
           "LIMIT_MARGIN_S", "REQUEUE_TEARDOWN_S"]

_log = get_logger(__name__)

TEMPLATES = ("single_node", "multi_node", "job_array", "multi_node_torchrun", "ray")
# Templates that span nodes; multi_node_torchrun runs one srun task (a torchrun agent) per node
# and its ``ntasks_per_node`` workers on each; ray one Ray node per SLURM node.
_MULTI_NODE = ("multi_node", "multi_node_torchrun", "ray")
# Templates with one srun task per node, whatever ``ntasks_per_node`` says.
_ONE_TASK_PER_NODE = ("multi_node_torchrun", "ray")
# The ray template's driver line: the command, started in the batch shell's background (its
# traps pass SLURM's signal on to it). ``B:``: SLURM signals that shell, not srun tasks.
_RAY_DRIVER = " & DRIVER=$!"

# The shutdown may take the signal's whole grace before the deadline watchdog forces the exit;
# this much more keeps that forced exit before the time limit (SLURM's own SIGTERM/SIGKILL).
# SLURM's time-limit check runs every 30 s, so the warning lands lead..lead+30 s (up to ~60 s)
# before the end: the lead itself is the worst case and needs no extra slack for that.
LIMIT_MARGIN_S = 20.0
# What comes after the emergency save: `scontrol requeue` (milliseconds, up to its timeout when
# slurmctld is slow), teardown (process group, log flush) and the processes' exit.
REQUEUE_TEARDOWN_S = 20.0

_SBATCH = re.compile(r"^#SBATCH\s+--([\w-]+)(?:[=\s](.*))?$")
_SRUN = "srun --kill-on-bad-exit=1 "
# The part of the launch line that stays: ``command`` replaces the rest.
_LAUNCH = {"multi_node_torchrun":
           'kempner-resilience srun --agents -- "${TORCHRUN[@]}" '}
_NPROC = re.compile(r"^NPROC_PER_NODE=\d+$")
_SPARES = re.compile(r"^SPARES=\d+$")
_RESTARTS = re.compile(r"^IN_JOB_RESTARTS=\d+$")
_CONFIG_EXPORT = re.compile(r"^#?\s*export KEMPNER_RESILIENCE_CONFIG=")
_SIGNAL_COMMENT = re.compile(r"^# (?:SIG)?[A-Z0-9]+ \d+ s before the time limit")


_SPARES_COMMENT = [
    "# Spare nodes (`kempner-resilience sbatch --spares K`, with `#SBATCH --no-kill` so that a",
    "# dead node does not end the allocation; --nodes above counts them): `kempner-resilience",
    "# srun` runs the training as srun steps (--kill-on-bad-exit=1) on the nodes not recorded",
    "# bad, K fewer than the job has. After a node or rank failure whose rescue (or periodic save)",
    "# committed, it ends the old step at once (without waiting for SLURM to notice a dead node),",
    "# records the failed node and starts a new step on the survivors plus a spare, from that",
    "# checkpoint: same job, no requeue, at most --in-job-restarts times. No spare left: requeue.",
    "# A time limit or a preemption: save, requeue and exit, as without spares. docs/slurm.md.",
    "# Warm ranks: a standby on each node imports torch once and forks the ranks of every step",
    "# (KEMPNER_RESILIENCE_WARM=0: every rank starts cold).",
    "export KEMPNER_RESILIENCE_WARM=${KEMPNER_RESILIENCE_WARM:-1}",
]


def _relaunch_line(spares: int, restarts: int, config_path: str | None,
                   overrides: Sequence[str], command: str) -> str:
    """The multi_node launch line with spares: ``kempner-resilience srun`` runs the steps."""
    args = ["kempner-resilience", "srun", f"--spares={int(spares)}",
            f"--in-job-restarts={int(restarts)}"]
    if config_path:
        args.append(f"--config={config_path}")
    args += [f"--set={o}" for o in overrides]
    return shlex.join(args) + " -- " + command


def template_text(name: str) -> str:
    """The template ``name`` (one of TEMPLATES) as shipped in the package: a usable script."""
    if name not in TEMPLATES:
        raise ValueError(f"unknown template {name!r}; choose one of {', '.join(TEMPLATES)}")
    return (resources.files("kempner_resilience") / "templates" / f"{name}.sbatch").read_text()


def requeue_signal(config: ResilienceConfig) -> str:
    """The signal to ask SLURM for: SIGUSR1 when it requeues, else another requeue signal."""
    handled = config.signals.handled()
    if handled.get("SIGUSR1") is Action.REQUEUE:
        return "SIGUSR1"
    for name, action in sorted(handled.items()):
        if action is Action.REQUEUE and name not in ("SIGTERM", "SIGINT"):
            return name
    _log.warning("no signal has action `requeue` in the config; the template asks for SIGUSR1, "
                 "which then stops the job without requeueing it")
    return "SIGUSR1"


def signal_lead_time(config: ResilienceConfig, save_seconds: float | None = None,
                     lead_time_s: float | None = None) -> int:
    """Seconds before the time limit at which SLURM should signal (whole seconds, >= 1).

    ``lead_time_s`` wins when given. Otherwise the signal's grace period (after which the
    deadline watchdog forces the exit) plus ``LIMIT_MARGIN_S``, so even a forced exit comes
    before the time limit: 100 + 20 = 120 s with the defaults. With a measured emergency-save
    time ``save_seconds``, at least ``save_seconds + checkpoint.save_margin_s +
    REQUEUE_TEARDOWN_S``.
    """
    if lead_time_s is not None:
        return max(1, math.ceil(lead_time_s))
    sig = requeue_signal(config)
    lead = config.signals.grace_for(sig) + LIMIT_MARGIN_S
    if save_seconds is not None:
        lead = max(lead, save_seconds + config.checkpoint.save_margin_s + REQUEUE_TEARDOWN_S)
    return max(1, math.ceil(lead - 1e-9))


def _sbatch_value(value: object) -> str:
    text = str(value)
    if "\n" in text or "\r" in text:
        raise ValueError(f"sbatch option value {text!r} contains a newline")
    return text


def _key(line: str) -> str | None:
    m = _SBATCH.match(line)
    return m.group(1) if m else None


class _Script:
    """A batch script as lines, with in-place edits of its #SBATCH directives."""

    def __init__(self, text: str, name: str) -> None:
        self.lines = text.splitlines()
        self.name = name

    def index(self, key: str) -> int | None:
        for i, line in enumerate(self.lines):
            if _key(line) == key:
                return i
        return None

    def header_end(self) -> int:
        """Index just after the last #SBATCH/##SBATCH line (sbatch reads only the header)."""
        last = 0
        for i, line in enumerate(self.lines):
            if line.startswith("#SBATCH") or line.startswith("##SBATCH"):
                last = i
            elif line.strip() and not line.startswith("#"):
                break
        return last + 1

    def set(self, key: str, value: object | None, after: str | None = None) -> None:
        """Replace ``--key`` in place, or add it (after ``--after`` or at the header's end)."""
        line = f"#SBATCH --{key}" if value is None else f"#SBATCH --{key}={_sbatch_value(value)}"
        i = self.index(key)
        if i is not None:
            self.lines[i] = line
            return
        j = self.index(after) if after else None
        self.lines.insert(j + 1 if j is not None else self.header_end(), line)

    def remove(self, key: str) -> None:
        self.lines = [line for line in self.lines if _key(line) != key]

    def require(self, key: str) -> None:
        if self.index(key) is None:
            raise ValueError(f"template {self.name!r} has no `#SBATCH --{key}` line")


def render_sbatch(config: ResilienceConfig | None = None, *, template: str = "single_node",
                  job_name: str = "train", command: str | list[str] = "python train.py",
                  time: str = "01:00:00", nodes: int = 1, ntasks_per_node: int = 1,
                  gpus_per_node: int | None = None, array: str | None = None,
                  output: str | None = None, config_path: str | None = None,
                  save_seconds: float | None = None, lead_time_s: float | None = None,
                  extra: Mapping[str, object | None] | None = None, spares: int = 0,
                  in_job_restarts: int | None = None, overrides: Sequence[str] = ()) -> str:
    """Rewrite a template's values; the result is a complete batch script for ``sbatch``.

    ``command``: what each srun task runs (a string, used as written, or an argument list,
    shell-quoted). In ``multi_node_torchrun`` each node runs one srun task, the torchrun agent,
    and ``command`` is what each of its ``ntasks_per_node`` workers runs. In ``ray`` it is the
    Ray driver, run once in the batch shell (which gets the ``B:`` signal and passes it on),
    after a Ray node was started on each of the ``nodes`` (one srun task each).
    ``gpus_per_node=None`` drops the template's ``--gpus-per-node`` line (a CPU-only cluster).
    ``extra``: more ``#SBATCH --key=value`` lines (``{"partition": "gpu"}``;
    a value of None gives a bare ``--key``; a key the template already has is replaced in
    place). ``config_path`` is exported as ``KEMPNER_RESILIENCE_CONFIG``. The ``--signal`` lead
    time comes from ``signal_lead_time``.
    ``spares`` (``multi_node_torchrun``): ask for ``nodes + spares`` nodes with ``--no-kill``
    and train on ``nodes``; a standby takes a failed node's place in the job, at most
    ``in_job_restarts`` times (default: ``spares``). In ``multi_node`` the launch line becomes
    ``kempner-resilience srun --spares K ...`` (``supervise/srun/relaunch.py``): srun steps on the
    healthy nodes, a new one on the survivors plus a spare after a failure; ``overrides``
    (``--set KEY=VALUE``) go on that line, so that it finds the training's checkpoint.dir.
    """
    config = config or ResilienceConfig()
    if template not in TEMPLATES:
        raise ValueError(f"unknown template {template!r}; choose one of {', '.join(TEMPLATES)}")
    if template in _MULTI_NODE and nodes < 1:
        raise ValueError("nodes must be >= 1")
    if template not in _MULTI_NODE and nodes != 1:
        raise ValueError(f"template {template!r} runs on one node; use template='multi_node' "
                         f"for nodes={nodes}")
    if template == "job_array" and not array:
        raise ValueError("template 'job_array' needs array='0-9' (an sbatch --array spec)")
    if template != "job_array" and array:
        raise ValueError(f"array={array!r} needs template='job_array'")
    if spares < 0 or (in_job_restarts is not None and in_job_restarts < 0):
        raise ValueError("spares and in_job_restarts must be >= 0")
    if spares and template not in ("multi_node", "multi_node_torchrun"):
        raise ValueError(f"template {template!r} takes no spares; spare nodes relaunch in place "
                         "with template 'multi_node' or 'multi_node_torchrun'")
    restarts = (spares if in_job_restarts is None else int(in_job_restarts)) if spares else 0
    if ntasks_per_node < 1:
        raise ValueError("ntasks_per_node must be >= 1 (one task per GPU)")
    if gpus_per_node is not None and int(gpus_per_node) < 0:
        raise ValueError("gpus_per_node must be >= 0")
    if isinstance(command, (list, tuple)):
        command = shlex.join(str(c) for c in command)
    command = str(command)
    if not command.strip() or "\n" in command or "\r" in command:
        raise ValueError("command must be one non-empty line")
    if output is None:
        output = "slurm-%x-%A_%a.out" if template == "job_array" else "slurm-%x-%j.out"
    lead = signal_lead_time(config, save_seconds, lead_time_s)
    sig = requeue_signal(config).removeprefix("SIG")

    s = _Script(template_text(template), template)
    for key in ("job-name", "time", "nodes", "ntasks-per-node", "signal", "output"):
        s.require(key)
    s.set("job-name", job_name)
    s.set("time", time)
    s.set("nodes", int(nodes) + int(spares))
    if spares:
        # A dead node must not take the allocation with it: the spare takes its place.
        s.set("no-kill", None, after="nodes")
    torchrun = template == "multi_node_torchrun"
    s.set("ntasks-per-node", 1 if template in _ONE_TASK_PER_NODE else int(ntasks_per_node))
    if gpus_per_node:
        s.set("gpus-per-node", int(gpus_per_node), after="ntasks-per-node")
    else:
        s.remove("gpus-per-node")
    if template == "job_array":
        s.set("array", array, after="gpus-per-node" if gpus_per_node else "ntasks-per-node")
    s.set("signal", f"{'B:' if template == 'ray' else ''}{sig}@{lead}")
    s.set("output", output)
    for key, val in (extra or {}).items():
        key = str(key).lstrip("-")
        if not re.fullmatch(r"[A-Za-z][\w-]*", key):
            raise ValueError(f"extra sbatch option {key!r} is not an option name")
        s.set(key, val)

    launch = _LAUNCH.get(template, _SRUN)
    out = []
    srun_seen = False
    for line in s.lines:
        if _SIGNAL_COMMENT.match(line):
            line = _SIGNAL_COMMENT.sub(f"# {sig} {lead} s before the time limit", line)
        elif _CONFIG_EXPORT.match(line) and config_path:
            line = f"export KEMPNER_RESILIENCE_CONFIG={shlex.quote(config_path)}"
        elif template == "ray" and line.endswith(_RAY_DRIVER) and not line.startswith("#"):
            line = command + _RAY_DRIVER
            srun_seen = True
        elif line.startswith(launch):
            line = launch + command
            if spares and not torchrun:
                out.extend(_SPARES_COMMENT)
                line = _relaunch_line(spares, restarts, config_path, overrides, command)
            srun_seen = True
        elif torchrun and _NPROC.match(line):
            line = f"NPROC_PER_NODE={int(ntasks_per_node)}"
        elif torchrun and _SPARES.match(line):
            line = f"SPARES={int(spares)}"
        elif torchrun and _RESTARTS.match(line):
            line = f"IN_JOB_RESTARTS={restarts}"
        out.append(line)
    if not srun_seen:
        raise ValueError(f"template {template!r} has no launch line")
    return "\n".join(out) + "\n"
