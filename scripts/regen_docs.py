"""Regenerate the files that mirror config.py and exitcodes.py, and slurm/*.sbatch, which the
config's signal settings render into (tests check they are all in sync)."""

import re
from pathlib import Path

from kempner_resilience.config import render_default_yaml, render_reference_markdown
from kempner_resilience.exitcodes import TABLE, endings_markdown
from regen_slurm import regenerate as regen_slurm  # scripts/, next to this file

ROOT = Path(__file__).resolve().parents[1]
# The repository's copy and the one shipped in the package (load_config's fallback).
for copy in (ROOT / "configs" / "default.yaml", ROOT / "kempner_resilience" / "config" /
             "default.yaml"):
    copy.write_text(render_default_yaml())

doc = ROOT / "docs" / "config.md"
text = doc.read_text()
table = re.compile(r"\| key \| default \|( allowed \|)? meaning \|\n(\|.*\|\n?)+")
doc.write_text(table.sub(render_reference_markdown() + "\n", text))

doc = ROOT / "docs" / "exit-codes.md"
rows = "\n".join(f"| {int(c)} | `{c.name}` | {t} |" for c, t in TABLE.items())
text = doc.read_text()
doc.write_text(re.sub(r"\| code \| name \| meaning \|\n\| --- \| --- \| --- \|\n(\|.*\|\n?)+",
                      "| code | name | meaning |\n| --- | --- | --- |\n" + rows + "\n", text))
# The one table from what happened to the code (exitcodes.exit_code), row by row.
text = doc.read_text()
doc.write_text(re.sub(r"\| ending \| signal \| requeue \| when \| code \|\n(\|.*\|\n?)+",
                      lambda _: endings_markdown() + "\n", text))
regen_slurm()
print("regenerated configs/default.yaml, docs/config.md, docs/exit-codes.md, slurm/*.sbatch")
