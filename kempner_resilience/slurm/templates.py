"""Render the sbatch templates shipped in ``kempner_resilience/templates/``.

The repository's ``slurm/*.sbatch`` are the source; the package copies must be byte-identical
(a test checks; after editing ``slurm/``, run ``cp slurm/*.sbatch kempner_resilience/templates/``).
Placeholders look like ``{{name}}`` so they never clash with the shell's ``${VAR}``; lines
starting with ``#%`` are notes for people reading the raw template and are dropped.
"""

from __future__ import annotations

import math
import re
import shlex
from importlib import resources
from typing import Mapping

from kempner_resilience.config import Action, ResilienceConfig
from kempner_resilience.log import get_logger

__all__ = ["TEMPLATES", "template_text", "signal_lead_time", "requeue_signal", "render_sbatch"]

_log = get_logger(__name__)

TEMPLATES = ("single_node", "multi_node", "job_array")
_PLACEHOLDER = re.compile(r"\{\{(\w+)\}\}")
# SLURM's time-limit check runs every 30 s: the warning lands lead..lead+30 s before the end, so
# the lead itself is the worst case and needs no extra slack for it.


def template_text(name: str) -> str:
    """The raw template ``name`` (one of TEMPLATES) as shipped in the package."""
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

    ``lead_time_s`` wins when given. Otherwise the signal's grace period from the config (the
    time our shutdown may take), raised to a measured emergency-save time plus
    ``checkpoint.save_margin_s`` when ``save_seconds`` is given.
    """
    if lead_time_s is not None:
        return max(1, math.ceil(lead_time_s))
    sig = requeue_signal(config)
    lead = config.signals.grace_for(sig)
    if save_seconds is not None:
        lead = max(lead, save_seconds + config.checkpoint.save_margin_s)
    return max(1, math.ceil(lead))


def _sbatch_value(value: object) -> str:
    text = str(value)
    if "\n" in text:
        raise ValueError(f"sbatch option value {text!r} contains a newline")
    return text


def render_sbatch(config: ResilienceConfig | None = None, *, template: str = "single_node",
                  job_name: str = "train", command: str | list[str] = "python train.py",
                  time: str = "01:00:00", nodes: int = 1, ntasks_per_node: int = 1,
                  gpus_per_node: int | None = None, array: str | None = None,
                  output: str | None = None, config_path: str | None = None,
                  save_seconds: float | None = None, lead_time_s: float | None = None,
                  extra: Mapping[str, object | None] | None = None) -> str:
    """Fill a template; the result is a complete batch script for ``sbatch``.

    ``command``: what each srun task runs (a string, used as written, or an argument list,
    shell-quoted). ``extra``: more ``#SBATCH --key=value`` lines (``{"partition": "gpu"}``; a
    value of None gives a bare ``--key``). ``config_path`` is exported as
    ``KEMPNER_RESILIENCE_CONFIG``. The ``--signal`` lead time comes from ``signal_lead_time``.
    """
    config = config or ResilienceConfig()
    if template == "multi_node" and nodes < 1:
        raise ValueError("nodes must be >= 1")
    if template != "multi_node" and nodes != 1:
        raise ValueError(f"template {template!r} runs on one node; use template='multi_node' "
                         f"for nodes={nodes}")
    if template == "job_array" and not array:
        raise ValueError("template 'job_array' needs array='0-9' (an sbatch --array spec)")
    if ntasks_per_node < 1:
        raise ValueError("ntasks_per_node must be >= 1 (one task per GPU)")
    if isinstance(command, (list, tuple)):
        command = shlex.join(str(c) for c in command)
    if not str(command).strip() or "\n" in str(command):
        raise ValueError("command must be one non-empty line")
    if output is None:
        output = "slurm-%x-%A_%a.out" if template == "job_array" else "slurm-%x-%j.out"
    extra_lines = []
    for key, val in (extra or {}).items():
        key = str(key).lstrip("-")
        extra_lines.append(f"#SBATCH --{key}" if val is None else
                           f"#SBATCH --{key}={_sbatch_value(val)}")
    lead = signal_lead_time(config, save_seconds, lead_time_s)
    values = {
        "job_name": _sbatch_value(job_name),
        "time": _sbatch_value(time),
        "nodes": str(int(nodes)),
        "ntasks_per_node": str(int(ntasks_per_node)),
        "gpu_line": f"#SBATCH --gpus-per-node={int(gpus_per_node)}" if gpus_per_node else "",
        "signal": requeue_signal(config).removeprefix("SIG"),
        "lead_s": str(lead),
        "output": _sbatch_value(output),
        "array": _sbatch_value(array or ""),
        "extra": "\n".join(extra_lines),
        "config_line": (f"export KEMPNER_RESILIENCE_CONFIG={shlex.quote(config_path)}"
                        if config_path else ""),
        "command": str(command),
    }

    def fill(m: re.Match[str]) -> str:
        try:
            return values[m.group(1)]
        except KeyError:
            raise ValueError(f"template {template!r} has unknown placeholder {m.group(0)}"
                             ) from None

    out = []
    for line in template_text(template).splitlines():
        if line.startswith("#%"):
            continue  # a note about the template itself
        has_placeholder = _PLACEHOLDER.search(line) is not None
        line = _PLACEHOLDER.sub(fill, line)
        if has_placeholder and not line.strip():
            continue  # an optional line left empty (no GPUs, no extras, no config path)
        out.append(line)
    return "\n".join(out) + "\n"
