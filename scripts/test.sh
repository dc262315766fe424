#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what it needs, starts a real single-node
# SLURM cluster for the SLURM tests (apt packages; root), runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
