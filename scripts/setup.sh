#!/usr/bin/env bash
# Create .venv and install the package with its test extras. Idempotent and quick when done.
# torch goes in first, pinned to a CPU build that a later `torch>=2.4` requirement accepts, so
# resolving the package's own dependencies pulls nothing more (no multi-GB CUDA wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
# pip warns once per package about find-links/index entries that do not exist on this machine.
# --no-compile: pip byte-compiles what it installs file by file on one core (see below).
quiet_pip() { .venv/bin/pip install -q --no-compile "$@" 2>&1 | { grep -v "^WARNING: Location" || true; }; }
fresh=0
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  # pip, not uv: the machine's local torch wheels are pip's find-links (uv does not read them).
  quiet_pip "$TORCH_SPEC"
  fresh=1
fi
# Installed again whenever pyproject.toml changed (a new dependency), not only when one is missing.
stamp=.venv/.kr-pyproject.sha256
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || ! .venv/bin/python -c \
    "import kempner_resilience, pytest, xdist, submitit, nbclient, matplotlib, wandb, torchdata, ray, accelerate, transformers, pytorch_lightning" 2>/dev/null
then
  # uv resolves and installs the package and its test extras in seconds, where pip takes 40
  # (the torch installed above satisfies the package's requirement, so it stays). pip again
  # if uv cannot be had or fails.
  { [ -x .venv/bin/uv ] || quiet_pip uv; } && .venv/bin/uv pip install -q --python .venv/bin/python -e ".[test]" \
    || quiet_pip -e ".[test]"
  fresh=1
  echo "$want" > "$stamp"
fi
# Bytecode, written here: a shell may set PYTHONDONTWRITEBYTECODE, and then every process of the
# suite (over a thousand) would compile what it imports again. Of the installed packages, what
# the package and the suite import (compiling all 17,000 files of them took 45 s of CPU; these
# are a fifth); the package and the tests each time.
if [ "$fresh" = 1 ] || [ ! -e .venv/.kr-compiled ]; then
  warm() { env -u PYTHONDONTWRITEBYTECODE .venv/bin/python -c "import $1" >/dev/null 2>&1 || true; }
  warm "torch, torch.distributed.checkpoint, torch.optim, torch._dynamo, torch.distributed.run, numpy, yaml, submitit, pytest, xdist" &
  warm "ray, ray.util.collective, transformers, accelerate, pytorch_lightning, torchdata.stateful_dataloader, matplotlib.pyplot, nbclient, nbformat, wandb"
  wait
  touch .venv/.kr-compiled
fi
.venv/bin/python -m compileall -q kempner_resilience tests >/dev/null || true
