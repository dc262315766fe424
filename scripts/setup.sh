#!/usr/bin/env bash
# Create .venv and install the package with its test extras. Idempotent and quick when done.
# torch goes in first, pinned to a CPU build that a later `torch>=2.4` requirement accepts, so
# resolving the package's own dependencies pulls nothing more (no multi-GB CUDA wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
# pip warns once per package about find-links/index entries that do not exist on this machine.
quiet_pip() { .venv/bin/pip install -q "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  quiet_pip "$TORCH_SPEC"
fi
# Installed again whenever pyproject.toml changed (a new dependency), not only when one is missing.
stamp=.venv/.kr-pyproject.sha256
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! .venv/bin/python -c \
    "import kempner_resilience, pytest, xdist, submitit, nbclient, matplotlib, wandb, torchdata, ray, accelerate, transformers, pytorch_lightning" 2>/dev/null
then
  quiet_pip -e ".[test]"
  echo "$want" > "$stamp"
fi
# Bytecode for the package and the tests, written once: a shell may set PYTHONDONTWRITEBYTECODE,
# and then every process of the suite (over a thousand) would compile what it imports again.
.venv/bin/python -m compileall -q kempner_resilience tests >/dev/null || true
