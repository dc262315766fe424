#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what it needs, starts a real single-node
# SLURM cluster for the SLURM tests (apt packages; root), runs pytest in two streams: the tests
# on the SLURM clusters (mostly waiting on the scheduler) beside the local ones (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q -n 2 --dist loadgroup "$@"
