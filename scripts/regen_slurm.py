"""Regenerate ``slurm/*.sbatch`` from the package templates (a test checks they are in sync).

The package data ``kempner_resilience/templates/*.sbatch`` is the one source. Each file in
``slurm/`` is exactly what ``kempner-resilience sbatch --template NAME`` prints with the
arguments in ``SHIPPED_ARGS``: the template's own example values (4 GPUs, 4 hours, ...), so the
shipped copy reads like the template and is ready to ``sbatch`` after editing. Never edit
``slurm/`` by hand: edit the template, then run

    PYTHONPATH=. .venv/bin/python scripts/regen_slurm.py
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_COMMON = ["--time", "04:00:00", "--ntasks-per-node", "4", "--gpus-per-node", "4"]
_COMMAND = ["--", "python", "train.py", "--config", "configs/default.yaml"]

# `kempner-resilience sbatch` arguments that render each shipped slurm/NAME.sbatch.
SHIPPED_ARGS: dict[str, list[str]] = {
    "single_node": ["--template", "single_node", *_COMMON, *_COMMAND],
    "multi_node": ["--template", "multi_node", "--nodes", "2", *_COMMON, *_COMMAND],
    "job_array": ["--template", "job_array", "--array", "0-3", *_COMMON, *_COMMAND],
    "multi_node_torchrun": ["--template", "multi_node_torchrun", "--nodes", "2", *_COMMON,
                            *_COMMAND],
    "ray": ["--template", "ray", "--nodes", "2", *_COMMON, *_COMMAND],
}


def render(name: str) -> str:
    """What ``kempner-resilience sbatch SHIPPED_ARGS[name]`` writes to stdout, with the built-in
    config (``$KEMPNER_RESILIENCE_CONFIG`` would change the signal lead time)."""
    from kempner_resilience.cli import main

    saved = os.environ.pop("KEMPNER_RESILIENCE_CONFIG", None)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            code = main(["sbatch", *SHIPPED_ARGS[name]])
    finally:
        if saved is not None:
            os.environ["KEMPNER_RESILIENCE_CONFIG"] = saved
    if code != 0:
        raise SystemExit(f"kempner-resilience sbatch {' '.join(SHIPPED_ARGS[name])} exited {code}")
    return out.getvalue()


def regenerate() -> list[Path]:
    """Write every ``slurm/NAME.sbatch``; returns the files written."""
    from kempner_resilience.slurm.templates import TEMPLATES

    if set(SHIPPED_ARGS) != set(TEMPLATES):
        raise SystemExit(f"SHIPPED_ARGS names {sorted(SHIPPED_ARGS)}, the package ships "
                         f"{sorted(TEMPLATES)}: add or remove the entry in {__file__}")
    written = []
    for name in TEMPLATES:
        path = ROOT / "slurm" / f"{name}.sbatch"
        path.write_text(render(name))
        written.append(path)
    return written


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    files = regenerate()
    print("regenerated " + ", ".join(str(p.relative_to(ROOT)) for p in files))
